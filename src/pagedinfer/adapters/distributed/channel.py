"""A one-writer, many-reader message channel over POSIX shared memory and events.

Rank 0 writes each control message once into a shared-memory segment and signals every
worker; each worker copies the message out and acknowledges. The writer waits for all
acknowledgements of a message only before it overwrites the segment with the next one, so
sending never waits for a worker to *finish* a step, only for it to have *read* the last one.

The events are counting semaphores, one "ready" (writer -> reader) and one "consumed"
(reader -> writer) per reader, posted once per message. Not ``multiprocessing.Event``: its
``set()`` waits for every process sleeping in ``wait()`` to wake up, so a reader killed while
waiting would hang the writer forever. Posting a semaphore never blocks, and a dead peer
cannot wedge one.

Segment layout (little-endian)::

    offset 0   u64  sequence number (1, 2, 3, ...; readers check they missed none)
    offset 8   u32  kind: 0 = message, 1 = switch to a new segment
    offset 12  u32  reserved (0)
    offset 16  u64  payload length in bytes
    offset 24  ...  payload: a pickled Python object

A message that does not fit is never truncated: the writer creates a larger segment under a
new name, sends a small *switch* message (the new name) through the old one, waits until
every reader has moved over, unlinks the old segment and sends the message through the new
one. Readers handle switches inside :meth:`ChannelReader.receive`; their callers only ever
see whole messages. Growth stops at :data:`MAX_CAPACITY` with a :class:`ChannelError`.

Segment names are ``pagedinfer-<random uuid>``: engines on one host never collide. Only the
writer unlinks; segments are created with mode 0600, so only processes of the same user can
read or write them (payloads are pickles: do not share the segment across trust boundaries).

Waiting is always bounded: every wait polls its event with a short timeout and calls a
``check`` callback in between (the writer checks its workers are alive, a reader checks its
parent is), so a dead peer raises in the caller instead of hanging it. This module does not
import torch.
"""

from __future__ import annotations

import contextlib
import pickle
import struct
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from multiprocessing.synchronize import Semaphore
from typing import Any

__all__ = [
    "HEADER_BYTES",
    "MAX_CAPACITY",
    "MIN_CAPACITY",
    "ChannelError",
    "ChannelReader",
    "ChannelWriter",
    "ReaderEndpoint",
]

_HEADER = struct.Struct("<QIIQ")
HEADER_BYTES = _HEADER.size
MIN_CAPACITY = 256
"""Smallest segment: the header plus a switch message (a segment name) always fit."""
MAX_CAPACITY = 1 << 30
"""Largest segment the writer grows to (1 GiB; a step's plan is kilobytes to megabytes)."""
POLL_SECONDS = 0.05
"""How often a waiting side checks on its peers."""

_MESSAGE = 0
_SWITCH = 1
_NAME_PREFIX = "pagedinfer-"

Check = Callable[[], None]
"""Called while waiting; raises to abandon the wait (e.g. when a peer process died)."""


class ChannelError(RuntimeError):
    """The channel cannot carry a message (too large) or its peers broke the protocol."""


def _no_check() -> None:
    return None


@dataclass(frozen=True)
class ReaderEndpoint:
    """What one reader needs to attach: picklable into a ``spawn``-ed process at start."""

    segment_name: str
    ready: Semaphore  # writer -> reader: a message is in the segment (posted per message)
    consumed: Semaphore  # reader -> writer: I have copied it out (the segment may be reused)


class ChannelWriter:
    """Rank 0's end. ``send`` pickles a message into the segment and signals every reader."""

    def __init__(
        self,
        ready: Sequence[Semaphore],
        consumed: Sequence[Semaphore],
        *,
        capacity: int = 1 << 20,
    ) -> None:
        """``ready[i]`` and ``consumed[i]`` are reader i's semaphores, both created at 0."""
        if len(ready) != len(consumed):
            raise ValueError("one ready and one consumed semaphore per reader")
        self._ready = list(ready)
        self._consumed = list(consumed)
        self._unacknowledged: set[int] = set()  # readers yet to consume the last message
        self._sequence = 0
        self._segment: SharedMemory | None = _create_segment(_clamp_capacity(capacity))

    @property
    def segment_name(self) -> str:
        """The current segment's name (it changes when the channel grows)."""
        return self._live_segment().name

    @property
    def capacity(self) -> int:
        """Bytes of the current segment, header included."""
        return self._live_segment().size

    def endpoint(self, reader: int) -> ReaderEndpoint:
        return ReaderEndpoint(self.segment_name, self._ready[reader], self._consumed[reader])

    def send(self, message: Any, *, check: Check = _no_check, timeout: float | None = None) -> int:
        """Deliver ``message`` to every reader; return its payload size in bytes.

        Waits (calling ``check`` while it does) until every reader has consumed the previous
        message; ``timeout`` bounds that wait (``TimeoutError``). Grows the channel when the
        message does not fit.
        """
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        deadline = None if timeout is None else time.monotonic() + timeout
        if HEADER_BYTES + len(payload) > self.capacity:
            self._grow(HEADER_BYTES + len(payload), check, deadline)
        self._post(_MESSAGE, payload, check, deadline)
        return len(payload)

    def wait_consumed(self, *, check: Check = _no_check, timeout: float | None = None) -> None:
        """Block until every reader has consumed the last message."""
        self._wait_consumed(check, None if timeout is None else time.monotonic() + timeout)

    def close(self) -> None:
        """Close and unlink the segment. Safe to call twice."""
        segment, self._segment = self._segment, None
        # Named semaphores are unlinked when their last reference goes: drop ours now.
        self._ready, self._consumed, self._unacknowledged = [], [], set()
        if segment is not None:
            _close(segment)
            _unlink(segment)

    # ------------------------------------------------------------------ internals
    def _grow(self, needed: int, check: Check, deadline: float | None) -> None:
        if needed > MAX_CAPACITY:
            raise ChannelError(
                f"a control message of {needed - HEADER_BYTES} bytes exceeds the channel's "
                f"maximum of {MAX_CAPACITY - HEADER_BYTES} bytes: schedule smaller steps "
                "(lower max_num_batched_tokens or max_num_seqs)."
            )
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        new = _create_segment(min(capacity, MAX_CAPACITY))
        old = self._live_segment()
        try:
            self._post(_SWITCH, new.name.encode(), check, deadline)
            self._wait_consumed(check, deadline)  # every reader is attached to `new` now
        except BaseException:
            _close(new)
            _unlink(new)
            raise
        self._segment = new
        _close(old)
        _unlink(old)

    def _post(self, kind: int, payload: bytes, check: Check, deadline: float | None) -> None:
        self._wait_consumed(check, deadline)
        segment = self._live_segment()
        assert HEADER_BYTES + len(payload) <= segment.size, (len(payload), segment.size)
        self._sequence += 1
        buffer = _buffer(segment)
        _HEADER.pack_into(buffer, 0, self._sequence, kind, 0, len(payload))
        buffer[HEADER_BYTES : HEADER_BYTES + len(payload)] = payload
        del buffer  # no view may outlive the mapping (close() would raise BufferError)
        self._unacknowledged = set(range(len(self._ready)))
        for ready in self._ready:
            ready.release()

    def _wait_consumed(self, check: Check, deadline: float | None) -> None:
        # One reader at a time, remembering who has acknowledged: a wait abandoned halfway
        # (timeout, dead peer) never consumes an acknowledgement twice.
        for reader in sorted(self._unacknowledged):
            _wait(self._consumed[reader], check, deadline)
            self._unacknowledged.discard(reader)

    def _live_segment(self) -> SharedMemory:
        if self._segment is None:
            raise ChannelError("the channel was used after close()")
        return self._segment


class ChannelReader:
    """A worker's end: attach to the writer's segment and receive its messages in order."""

    def __init__(self, endpoint: ReaderEndpoint) -> None:
        self._ready = endpoint.ready
        self._consumed = endpoint.consumed
        self._segment: SharedMemory | None = SharedMemory(name=endpoint.segment_name)
        self._sequence = 0

    def receive(self, *, check: Check = _no_check, timeout: float | None = None) -> Any:
        """The next message (switches to a grown segment are followed transparently)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            _wait(self._ready, check, deadline)
            segment = self._live_segment()
            buffer = _buffer(segment)
            sequence, kind, _, length = _HEADER.unpack_from(buffer, 0)
            if sequence != self._sequence + 1:
                raise ChannelError(
                    f"channel out of step: expected message {self._sequence + 1}, got {sequence}"
                )
            self._sequence = sequence
            payload = bytes(buffer[HEADER_BYTES : HEADER_BYTES + length])
            del buffer
            if kind == _SWITCH:
                self._segment = SharedMemory(name=payload.decode())
                _close(segment)
                self._consumed.release()
                continue
            self._consumed.release()
            return pickle.loads(payload)

    def close(self) -> None:
        """Detach from the segment (the writer unlinks it). Safe to call twice."""
        segment, self._segment = self._segment, None
        if segment is not None:
            _close(segment)

    def _live_segment(self) -> SharedMemory:
        if self._segment is None:
            raise ChannelError("the channel was used after close()")
        return self._segment


def _wait(semaphore: Semaphore, check: Check, deadline: float | None) -> None:
    """Take one post of ``semaphore``, calling ``check`` every :data:`POLL_SECONDS`."""
    while True:
        if deadline is None:
            wait = POLL_SECONDS
        else:
            wait = min(POLL_SECONDS, deadline - time.monotonic())
            if wait <= 0:
                raise TimeoutError("timed out waiting on the tensor-parallel control channel")
        if semaphore.acquire(timeout=wait):
            return
        check()


def _buffer(segment: SharedMemory) -> memoryview:
    buffer = segment.buf
    assert buffer is not None, "segment is closed"
    return buffer


def _clamp_capacity(capacity: int) -> int:
    if capacity < MIN_CAPACITY:
        return MIN_CAPACITY
    return min(capacity, MAX_CAPACITY)


def _create_segment(capacity: int) -> SharedMemory:
    return SharedMemory(name=f"{_NAME_PREFIX}{uuid.uuid4().hex[:16]}", create=True, size=capacity)


def _close(segment: SharedMemory) -> None:
    # BufferError: a view into the buffer is still alive; the mapping goes at exit.
    with contextlib.suppress(BufferError):
        segment.close()


def _unlink(segment: SharedMemory) -> None:
    with contextlib.suppress(FileNotFoundError):  # already gone
        segment.unlink()
