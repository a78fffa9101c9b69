"""InterruptDeferral on its own: real SIGINTs to this process (pytest runs tests in the main
thread, where Python delivers signals)."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from pagedinfer.engine.interrupts import InterruptDeferral


def _sigint() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def test_held_back_until_a_safe_point_and_raised_at_once_while_suspended() -> None:
    deferral = InterruptDeferral()
    try:
        _sigint()  # held back: nothing raises here
        with pytest.raises(KeyboardInterrupt):
            deferral.suspend()  # the safe point
        with pytest.raises(KeyboardInterrupt):
            _sigint()  # suspended: through at once, like Python's default handler
        deferral.resume()
        _sigint()
        with pytest.raises(KeyboardInterrupt):
            deferral.end()
    finally:
        deferral.end(raise_pending=False)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_end_drops_a_held_ctrl_c_when_another_exception_is_on_its_way() -> None:
    deferral = InterruptDeferral()
    _sigint()
    deferral.end(raise_pending=False)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_inactive_off_the_main_thread_and_under_a_program_handler() -> None:
    made: list[InterruptDeferral] = []
    worker = threading.Thread(target=lambda: made.append(InterruptDeferral()))
    worker.start()
    worker.join()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    def own(signum: int, frame: object) -> None:
        pass

    previous = signal.signal(signal.SIGINT, own)
    try:
        deferral = InterruptDeferral()
        deferral.suspend()
        deferral.resume()
        deferral.end()
        assert signal.getsignal(signal.SIGINT) is own  # left alone
    finally:
        signal.signal(signal.SIGINT, previous)
