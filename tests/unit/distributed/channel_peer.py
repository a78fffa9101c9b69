"""A channel reader that runs in its own (spawned, torch-free) process for the channel tests."""

from __future__ import annotations

import os
from multiprocessing.connection import Connection
from typing import Any

from pagedinfer.adapters.distributed.channel import ChannelReader, ReaderEndpoint


def echo_until_none(endpoint: ReaderEndpoint, results: Connection) -> None:
    """Receive messages until ``None`` arrives, then send them all back through ``results``.

    (Sending each one back at once could block on a full pipe while the test is still
    writing, and then this reader would never consume the next message.)
    """
    reader = ChannelReader(endpoint)
    try:
        results.send(os.getpid())
        received: list[Any] = []
        while True:
            message: Any = reader.receive(timeout=60.0)
            received.append(message)
            if message is None:
                results.send(received)
                return
    finally:
        reader.close()
        results.close()
