"""Shared pieces of the tensor-parallel engine tests: prompts and process checks."""

from __future__ import annotations

import multiprocessing.synchronize
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest

from pagedinfer.adapters.distributed import channel as channel_module

SHM = Path("/dev/shm")


def shared_prefix_prompts(seed: int, count: int, vocab: int = 512) -> list[list[int]]:
    """``count`` prompts of 40..82 tokens that share a 32-token (two-block) prefix."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(32)]
    return [
        prefix + [rng.randrange(vocab) for _ in range(rng.randint(8, 50))] for _ in range(count)
    ]


@contextmanager
def tracked_shm_names() -> Iterator[set[str]]:
    """The /dev/shm names this process creates inside the block: channel segments and
    multiprocessing's named semaphores.

    Tests check that *these* are gone after shutdown, not that /dev/shm as a whole is back to
    where it was: other processes on the machine (parallel test runs, other engines) create
    and remove their own entries meanwhile.
    """
    names: set[str] = set()
    create_segment = channel_module._create_segment
    semlock_init = multiprocessing.synchronize.SemLock.__init__

    def record_segment(capacity: int) -> Any:
        segment = create_segment(capacity)
        names.add(segment.name.lstrip("/"))
        return segment

    def record_semaphore(self: Any, *args: Any, **kwargs: Any) -> None:
        semlock_init(self, *args, **kwargs)
        name = getattr(self._semlock, "name", None)
        if name:  # unnamed (already unlinked) semaphores leave nothing in /dev/shm
            names.add("sem." + name.lstrip("/"))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(channel_module, "_create_segment", record_segment)
        patch.setattr(multiprocessing.synchronize.SemLock, "__init__", record_semaphore)
        yield names


def existing_shm(names: set[str]) -> set[str]:
    """Which of ``names`` still exist in /dev/shm."""
    return {name for name in names if (SHM / name).exists()}


def child_pids() -> set[int]:
    """This process's descendants, leaving out multiprocessing's resource tracker (one per
    process, started by the first shared-memory segment, it outlives every engine)."""
    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if any("resource_tracker" in part for part in child.cmdline()):
                continue
        except psutil.Error:  # exited meanwhile
            continue
        pids.add(child.pid)
    return pids


def is_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
