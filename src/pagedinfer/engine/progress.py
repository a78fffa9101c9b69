"""The ``generate`` progress bar: finished requests, with live prefill and decode tok/s."""

from __future__ import annotations

import time
from typing import Any

__all__ = ["ProgressBar"]

# The bar redraws at most this often (seconds): a step can take well under a millisecond.
_REFRESH_SECONDS = 0.1


class ProgressBar:
    """A tqdm bar over requests whose postfix shows the latest prefill and decode rates.

    The rates change after every step, so the bar redraws on a timer as well as when a
    request finishes (tqdm alone redraws only when the count moves).
    """

    def __init__(self, total: int, *, enabled: bool) -> None:
        self._bar: Any = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc="Generating", unit="req", dynamic_ncols=True)
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
        bar.set_postfix(
            prefill=f"{self._prefill_rate:.0f}tok/s",
            decode=f"{self._decode_rate:.0f}tok/s",
            refresh=False,
        )
        bar.n = num_finished
        bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
