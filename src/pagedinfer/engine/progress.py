"""The ``generate`` progress bar: finished requests, with live prefill and decode tok/s."""

from __future__ import annotations

from typing import Any

__all__ = ["ProgressBar"]


class ProgressBar:
    """A tqdm bar over requests whose postfix shows the latest prefill and decode rates."""

    def __init__(self, total: int, *, enabled: bool) -> None:
        self._bar: Any = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc="Generating", unit="req", dynamic_ncols=True)
        self._prefill_rate = 0.0
        self._decode_rate = 0.0

    def report_step(self, is_prefill: bool, num_tokens: int, seconds: float) -> None:
        if self._bar is None or seconds <= 0 or num_tokens == 0:
            return
        if is_prefill:
            self._prefill_rate = num_tokens / seconds
        else:
            self._decode_rate = num_tokens / seconds
        self._bar.set_postfix(
            prefill=f"{self._prefill_rate:.0f}tok/s",
            decode=f"{self._decode_rate:.0f}tok/s",
            refresh=False,
        )

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
