"""Shared pieces of the tensor-parallel engine tests: prompts and process checks."""

from __future__ import annotations

import random
from pathlib import Path

import psutil

SHM = Path("/dev/shm")


def shared_prefix_prompts(seed: int, count: int, vocab: int = 512) -> list[list[int]]:
    """``count`` prompts of 40..82 tokens that share a 32-token (two-block) prefix."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(32)]
    return [
        prefix + [rng.randrange(vocab) for _ in range(rng.randint(8, 50))] for _ in range(count)
    ]


def shm_entries() -> set[str]:
    """Names in /dev/shm: shared-memory segments and multiprocessing's named semaphores."""
    return {entry.name for entry in SHM.iterdir()} if SHM.is_dir() else set()


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
