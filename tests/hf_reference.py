"""transformers as the reference: a float32 model on the CPU and its greedy continuations.

Shared by the unit, tensor-parallel and GPU tests (importable as ``hf_reference`` because the
root ``conftest.py`` puts this folder on ``sys.path``). Models and continuations are memoized
for the whole test session.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import torch


@lru_cache(maxsize=8)
def hf_model(path: str) -> Any:
    """The checkpoint at ``path`` as a float32 transformers model on the CPU, in eval mode."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


@lru_cache(maxsize=4096)
def _greedy(path: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    input_ids = torch.tensor([prompt], dtype=torch.long)
    with torch.inference_mode():
        out = hf_model(path).generate(
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
