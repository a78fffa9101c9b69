"""Greedy reference outputs from Hugging Face transformers, memoized per test session."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


@lru_cache(maxsize=8)
def _load(path: str) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


@lru_cache(maxsize=4096)
def _greedy(path: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    model = _load(path)
    input_ids = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(  # type: ignore[operator]
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return tuple(int(t) for t in out[0, len(prompt) :])


def hf_greedy(path: Path | str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``prompt`` (unpadded, one prompt at a time)."""
    return list(_greedy(str(path), tuple(prompt), max_new_tokens))
