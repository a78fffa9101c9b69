"""The ``generate`` progress bar: finished requests, with live prefill and decode tok/s, and
with speculative decoding the acceptance of this call's drafts."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from pagedinfer.domain.scheduler import SchedulerStats

__all__ = ["ProgressBar"]

# The bar redraws at most this often (seconds): a step can take well under a millisecond.
_REFRESH_SECONDS = 0.1


class ProgressBar:
    """A tqdm bar over requests whose postfix shows the latest prefill and decode rates.

    The rates change after every step, so the bar redraws on a timer as well as when a
    request finishes (tqdm alone redraws only when the count moves).

    ``spec_decode`` (speculative decoding: the scheduler's ``stats``, read when the bar
    redraws) adds ``accept=`` (drafts accepted / drafts verified) and ``accept_len=`` (mean
    acceptance length: tokens per verify row, 1 + accepted / rows), counted from the bar's
    creation, once this call has verified a draft.

    The bar is drawn only where someone watches it: ``terminal`` (``None``: whether stderr
    is a terminal). In a log file or a CI job each redraw would be one more line.
    """

    def __init__(
        self,
        total: int,
        *,
        enabled: bool,
        spec_decode: Callable[[], SchedulerStats] | None = None,
        terminal: bool | None = None,
    ) -> None:
        if terminal is None:
            terminal = _stderr_is_terminal()
        enabled = enabled and terminal
        self._bar: Any = None
        self._spec_decode = spec_decode if enabled else None
        self._spec_start = (0, 0, 0)
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc="Generating", unit="req", dynamic_ncols=True)
            if spec_decode is not None:
                self._spec_start = _spec_counts(spec_decode())
        self._prefill_rate = 0.0
        self._decode_rate = 0.0
        self._last_refresh = 0.0

    def update(self, num_finished: int, is_prefill: bool, num_tokens: int, seconds: float) -> None:
        """After a step: ``num_finished`` requests are done; the step ran ``num_tokens``."""
        bar = self._bar
        if bar is None:
            return
        if seconds > 0 and num_tokens > 0:
            if is_prefill:
                self._prefill_rate = num_tokens / seconds
            else:
                self._decode_rate = num_tokens / seconds
        now = time.monotonic()
        moved = num_finished != bar.n
        if not moved and now - self._last_refresh < _REFRESH_SECONDS:
            return
        self._last_refresh = now
        postfix = {
            "prefill": f"{self._prefill_rate:.0f}tok/s",
            "decode": f"{self._decode_rate:.0f}tok/s",
        }
        if self._spec_decode is not None:
            counts = _spec_counts(self._spec_decode())
            rows, drafts, accepted = (c - s for c, s in zip(counts, self._spec_start, strict=True))
            if drafts > 0:
                postfix["accept"] = f"{accepted / drafts:.0%}"
                postfix["accept_len"] = f"{1 + accepted / rows:.2f}"
        bar.set_postfix(postfix, refresh=False)
        bar.n = num_finished
        bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _spec_counts(stats: SchedulerStats) -> tuple[int, int, int]:
    """(verify rows with drafts, drafts verified, drafts accepted) since the start."""
    return stats.num_spec_verify_rows, stats.num_draft_tokens, stats.num_accepted_tokens


def _stderr_is_terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (OSError, ValueError):  # a closed or detached stream
        return False
