"""The generate progress bar shows live prefill and decode tok/s (issue 11.11).

The rates were only drawn when a request finished: a long generation showed no rate at all
until its first request was done.
"""

from __future__ import annotations

import pytest

from pagedinfer.engine import progress as progress_module
from pagedinfer.engine.progress import ProgressBar


def test_rates_are_drawn_before_any_request_finishes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = iter([10.0, 10.5, 10.55, 11.0])
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: next(clock))
    bar = ProgressBar(total=2, enabled=True, terminal=True)
    bar.update(0, True, 300, 0.1)  # a prefill step: drawn
    assert "prefill=3000tok/s" in capsys.readouterr().err
    bar.update(0, False, 2, 0.001)  # a decode step 0.5 s later: drawn, nothing finished
    assert "decode=2000tok/s" in capsys.readouterr().err
    bar.update(0, False, 2, 0.002)  # 50 ms later: not redrawn (at most 10 times a second)
    assert capsys.readouterr().err == ""
    bar.update(1, False, 2, 0.002)  # a request finished: drawn with the latest rate
    err = capsys.readouterr().err
    assert "1/2" in err and "decode=1000tok/s" in err
    bar.close()


def test_speculative_decoding_adds_this_calls_acceptance(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With speculation the postfix shows the drafts accepted since the bar began (not the
    engine's lifetime): rate accepted / drafts, length 1 + accepted / verify rows."""
    from pagedinfer.domain.scheduler import SchedulerStats

    clock = iter([10.0, 11.0, 12.0])
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: next(clock))
    # An earlier call left 10 rows, 30 drafts, 3 accepted: not this bar's business.
    counts = [(10, 30, 3)]

    def stats() -> SchedulerStats:
        rows, drafts, accepted = counts[-1]
        return SchedulerStats(0, 0, 0, 0, 0, 0, rows, drafts, accepted)

    bar = ProgressBar(total=2, enabled=True, spec_decode=stats, terminal=True)
    bar.update(0, True, 300, 0.1)  # prefill only: no draft verified yet, nothing shown
    assert "accept" not in capsys.readouterr().err
    counts.append((14, 42, 9))  # 4 rows, 12 drafts, 6 accepted
    bar.update(1, False, 10, 0.01)
    err = capsys.readouterr().err
    assert "accept=50%" in err and "accept_len=2.50" in err
    bar.close()
    capsys.readouterr()
    # Without speculation (or without a bar) nothing is read.
    plain = ProgressBar(total=1, enabled=True, terminal=True)
    plain.update(1, False, 2, 0.001)
    assert "accept" not in capsys.readouterr().err
    plain.close()
    ProgressBar(total=1, enabled=False, spec_decode=lambda: pytest.fail("read")).close()


def test_no_bar_where_nobody_watches(capsys: pytest.CaptureFixture[str]) -> None:
    """Not a terminal (a log file, CI): no bar, so no line per redraw (issue 46)."""
    bar = ProgressBar(total=2, enabled=True, terminal=False)
    bar.update(2, True, 300, 0.1)
    bar.close()
    assert capsys.readouterr().err == ""
    bar = ProgressBar(total=2, enabled=True)  # capsys: stderr is no terminal
    bar.update(2, True, 300, 0.1)
    bar.close()
    assert capsys.readouterr().err == ""
