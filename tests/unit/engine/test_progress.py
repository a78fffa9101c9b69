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
    bar = ProgressBar(total=2, enabled=True)
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
