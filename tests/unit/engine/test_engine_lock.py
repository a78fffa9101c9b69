"""The engine's lock (engine/engine_lock.py): held, released while the model runs, waited on."""

from __future__ import annotations

import threading

from pagedinfer.engine.engine_lock import EngineLock


def test_released_lets_another_thread_in_and_takes_the_lock_back() -> None:
    guard = EngineLock()
    entered = threading.Event()

    def other() -> None:
        with guard.held():
            entered.set()

    with guard.held():
        thread = threading.Thread(target=other)
        thread.start()
        assert not entered.wait(0.05)  # held: the other thread waits
        with guard.released():
            assert entered.wait(5)
            thread.join(5)
        assert guard.lock.locked()
    assert not guard.lock.locked()


def test_wait_for_change_wakes_on_notify() -> None:
    guard = EngineLock()
    changed: list[bool] = []

    def notify() -> None:
        with guard.held():
            changed.append(True)
            guard.notify_all()

    with guard.held():
        thread = threading.Thread(target=notify)
        thread.start()
        while not changed:
            guard.wait_for_change()
        assert guard.lock.locked()
    thread.join(5)
    assert changed == [True]


def test_an_error_inside_releases_the_lock() -> None:
    guard = EngineLock()
    try:
        with guard.held():
            raise ValueError("inside")
    except ValueError:
        pass
    assert not guard.lock.locked()
