"""Random PEFT LoRA adapters for a tiny checkpoint, and transformers' reference: the same
adapter merged into the base model (PEFT's ``merge_and_unload``), greedy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def make_adapter(
    base: Path,
    target: Path,
    targets: tuple[str, ...],
    *,
    rank: int,
    alpha: int,
    seed: int,
    use_rslora: bool = False,
) -> Path:
    """A PEFT adapter of ``base`` with non-zero random weights (``init_lora_weights=False``,
    B scaled up so that it changes greedy tokens), saved at ``target``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        init_lora_weights=False,
        use_rslora=use_rslora,
        lora_dropout=0.0,
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.mul_(4.0)
    peft_model.save_pretrained(target)
    return target


def merged_greedy(
    base: Path, adapter: Path | None, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """transformers' greedy continuations with ``adapter`` merged (None: the base model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.eval()
    outputs = []
    # One thread, as the engines under test use ("auto" on 2 cores): a tiny model's generate
    # is ten times slower with two threads on shared cores. Restored after.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            outputs = [_greedy(model, prompt, max_new_tokens) for prompt in prompts]
    finally:
        torch.set_num_threads(threads)
    return outputs


def _greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    tokens: list[int] = out[0, len(prompt) :].tolist()
    return tokens
