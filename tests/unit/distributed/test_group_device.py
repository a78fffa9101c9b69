"""A CUDA rank selects its GPU before it creates its NCCL group (shown on the CPU with fakes).

NCCL binds a communicator to the process's current device; a worker that created its group
before ``torch.cuda.set_device`` could put every rank's communicator on ``cuda:0``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed

from pagedinfer.adapters.distributed.group import ProcessGroupCollectives


def test_cuda_rank_sets_its_device_before_creating_the_nccl_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[tuple[str, Any]] = []

    class FakeNCCL:
        class Options:
            _timeout: timedelta

        def __init__(self, store: object, rank: int, world_size: int, options: object) -> None:
            events.append(("group", rank))

    monkeypatch.setattr(torch.distributed, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: events.append(("device", device)))

    ProcessGroupCollectives(
        object(),  # type: ignore[arg-type]
        rank=1,
        world_size=2,
        device=torch.device("cuda", 3),
        timeout=timedelta(seconds=5),
    )

    assert events == [("device", torch.device("cuda", 3)), ("group", 1)]
