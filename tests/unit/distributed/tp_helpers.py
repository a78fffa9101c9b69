"""Shared pieces of the tensor-parallel engine tests: prompts, references, process checks."""

from __future__ import annotations

import random
from functools import lru_cache
from pathlib import Path

import psutil
import torch
from transformers import AutoModelForCausalLM

SHM = Path("/dev/shm")


def shared_prefix_prompts(seed: int, count: int, vocab: int = 512) -> list[list[int]]:
    """``count`` prompts of 40..82 tokens that share a 32-token (two-block) prefix."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(32)]
    return [
        prefix + [rng.randrange(vocab) for _ in range(rng.randint(8, 50))] for _ in range(count)
    ]


@lru_cache(maxsize=4)
def _hf_model(path: str) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


@lru_cache(maxsize=1024)
def _hf_greedy(path: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    input_ids = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        out = _hf_model(path).generate(  # type: ignore[operator]
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return tuple(int(t) for t in out[0, len(prompt) :])


def hf_greedy(path: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one unpadded prompt (memoized)."""
    return list(_hf_greedy(str(path), tuple(prompt), max_new_tokens))


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
