"""The shared-memory control channel: order, growth past its size, failing loudly, peers.

Readers run in spawned processes that do not import torch (see ``channel_peer.py``), so each
costs a fraction of a second.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext, SpawnProcess
from pathlib import Path
from typing import Any

import pytest

from pagedinfer.adapters.distributed import channel as channel_module
from pagedinfer.adapters.distributed.channel import (
    HEADER_BYTES,
    ChannelError,
    ChannelReader,
    ChannelWriter,
)

from .channel_peer import echo_until_none

SHM = Path("/dev/shm")
needs_dev_shm = pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm on this system")


class Readers:
    """A writer and ``count`` reader processes that echo what they receive."""

    def __init__(self, context: SpawnContext, count: int, capacity: int) -> None:
        self.writer = ChannelWriter(
            [context.Semaphore(0) for _ in range(count)],
            [context.Semaphore(0) for _ in range(count)],
            capacity=capacity,
        )
        self.processes: list[SpawnProcess] = []
        self.results: list[Connection] = []
        for index in range(count):
            receive, send = context.Pipe(duplex=False)
            process = context.Process(
                target=echo_until_none, args=(self.writer.endpoint(index), send), daemon=True
            )
            process.start()
            send.close()
            self.processes.append(process)
            self.results.append(receive)
        self.pids: list[int] = [self._next(index) for index in range(count)]

    def check(self) -> None:
        for process in self.processes:
            if not process.is_alive():
                raise RuntimeError(f"reader {process.pid} died")

    def received(self, index: int) -> list[Any]:
        """Everything reader ``index`` got, up to and including the final ``None``."""
        messages: list[Any] = self._next(index)
        return messages

    def close(self) -> None:
        for process in self.processes:
            process.join(1)  # readers that got their final None are gone already
            if process.is_alive():
                process.kill()
                process.join()
        self.writer.close()

    def _next(self, index: int) -> Any:
        assert self.results[index].poll(30), "the reader process did not answer"
        return self.results[index].recv()


@pytest.fixture
def context() -> SpawnContext:
    return multiprocessing.get_context("spawn")


@pytest.fixture
def two_readers(context: SpawnContext) -> Iterator[Readers]:
    readers = Readers(context, 2, capacity=1 << 16)
    yield readers
    readers.close()


@pytest.fixture
def tiny_readers(context: SpawnContext) -> Iterator[Readers]:
    readers = Readers(context, 2, capacity=channel_module.MIN_CAPACITY)
    yield readers
    readers.close()


def test_every_reader_gets_every_message_in_order(two_readers: Readers) -> None:
    messages: list[Any] = [
        ("execute", list(range(n)), {"n": n, "text": "x" * n}) for n in range(0, 400, 7)
    ]
    for message in messages:
        two_readers.writer.send(message, check=two_readers.check)
    two_readers.writer.send(None, check=two_readers.check)
    for index in range(2):
        assert two_readers.received(index) == [*messages, None]


@needs_dev_shm
def test_a_message_larger_than_the_channel_grows_it_and_arrives_whole(
    tiny_readers: Readers,
) -> None:
    writer = tiny_readers.writer
    first_name, first_capacity = writer.segment_name, writer.capacity
    assert first_capacity == channel_module.MIN_CAPACITY
    small = ("step", [1, 2, 3])
    large = ("step", list(range(100_000)))  # ~ 300 kB pickled: far above 256 bytes
    medium = ("step", bytes(range(256)) * 20)
    sizes = [writer.send(message, check=tiny_readers.check) for message in (small, large, medium)]
    writer.send(None, check=tiny_readers.check)
    for index in range(2):
        assert tiny_readers.received(index) == [small, large, medium, None]
    assert sizes[1] + HEADER_BYTES > first_capacity
    assert writer.capacity >= sizes[1] + HEADER_BYTES
    # The grown segment replaced the old one, which is unlinked, not leaked.
    assert writer.segment_name != first_name
    assert not (SHM / first_name).exists()
    assert (SHM / writer.segment_name).exists()


def test_a_message_over_the_maximum_fails_loudly_and_the_channel_stays_usable(
    tiny_readers: Readers, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(channel_module, "MAX_CAPACITY", 4096)
    writer = tiny_readers.writer
    with pytest.raises(ChannelError, match=r"exceeds the channel's maximum of \d+ bytes"):
        writer.send(b"x" * 10_000, check=tiny_readers.check)
    writer.send("still works", check=tiny_readers.check)
    writer.send(None, check=tiny_readers.check)
    for index in range(2):
        assert tiny_readers.received(index) == ["still works", None]


def test_a_dead_reader_makes_the_next_send_raise_instead_of_waiting(
    two_readers: Readers,
) -> None:
    os.kill(two_readers.pids[1], signal.SIGKILL)
    two_readers.processes[1].join(10)
    writer = two_readers.writer
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="died"):
        # The first send still posts (the segment was free); the second must wait for the
        # dead reader to consume it, and the liveness check ends that wait.
        writer.send("one", check=two_readers.check)
        writer.send("two", check=two_readers.check)
    assert time.monotonic() - started < 5


def test_waiting_for_a_reader_that_never_reads_times_out(context: SpawnContext) -> None:
    writer = ChannelWriter([context.Semaphore(0)], [context.Semaphore(0)], capacity=1024)
    try:
        writer.send("nobody reads this")
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="tensor-parallel control channel"):
            writer.send("nor this", timeout=0.2)
        assert time.monotonic() - started < 2
    finally:
        writer.close()


@needs_dev_shm
def test_close_unlinks_the_segment_and_is_idempotent(context: SpawnContext) -> None:
    writer = ChannelWriter([context.Semaphore(0)], [context.Semaphore(0)], capacity=1024)
    name = writer.segment_name
    assert name.startswith("pagedinfer-")
    assert (SHM / name).exists()
    writer.close()
    assert not (SHM / name).exists()
    writer.close()
    with pytest.raises(ChannelError, match="after close"):
        writer.send("late")


def test_segment_names_are_unique(context: SpawnContext) -> None:
    writers = [ChannelWriter([], [], capacity=256) for _ in range(20)]
    try:
        assert len({writer.segment_name for writer in writers}) == 20
    finally:
        for writer in writers:
            writer.close()


def test_reader_in_this_process_follows_growth(context: SpawnContext) -> None:
    ready, consumed = context.Semaphore(0), context.Semaphore(0)
    writer = ChannelWriter([ready], [consumed], capacity=256)
    reader = ChannelReader(writer.endpoint(0))
    got: list[Any] = []

    def receive_one() -> None:
        got.append(reader.receive(timeout=10))

    try:
        for size in (10, 1000, 5, 50_000):
            payload = b"y" * size
            # Growth posts a switch message and waits for it to be read: let a reader thread
            # do that while this thread writes.
            thread = threading.Thread(target=receive_one)
            thread.start()
            writer.send(payload, timeout=10)
            thread.join(10)
            assert got.pop() == payload
    finally:
        reader.close()
        writer.close()
