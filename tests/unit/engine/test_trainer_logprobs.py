"""``logprobs_mode`` through the engine, against a trainer's recomputation: transformers'
forward over prompt + output in float32 (issue 40)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hf_reference import hf_model
from pagedinfer import Engine, SamplingParams

VOCAB = 512  # the tiny checkpoint's
TEMPERATURE, TOP_K, NUM_TOP = 0.7, 20, 3
PARAMS = SamplingParams(
    temperature=TEMPERATURE, top_k=TOP_K, max_tokens=8, seed=3, logprobs=NUM_TOP, ignore_eos=True
)


def _hf_logits(checkpoint: Path, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(str(checkpoint))(torch.tensor([tokens])).logits[0].float()


def _reported(mode: str, logits: torch.Tensor) -> torch.Tensor:
    """What ``mode`` reports for one row of the model's logits under ``PARAMS``."""
    if mode.startswith("processed"):
        scaled = logits / TEMPERATURE
        logits = scaled.masked_fill(scaled < scaled.topk(TOP_K).values[-1], float("-inf"))
    return torch.log_softmax(logits, -1) if mode.endswith("logprobs") else logits


def test_sampled_logprobs_equal_the_trainers_forward(
    make_checkpoint: Callable[..., Path],
) -> None:
    checkpoint = make_checkpoint("tiny")
    rng = random.Random(40)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (9, 23)]
    tokens: dict[str, list[list[int]]] = {}
    for mode in ("raw_logprobs", "processed_logprobs", "raw_logits"):
        with Engine(
            checkpoint,
            device="cpu",
            dtype="float32",
            kv_block_size=16,
            max_model_len=64,
            logprobs_mode=mode,
        ) as engine:
            outputs = engine.generate(prompts, PARAMS, use_tqdm=False)
        tokens[mode] = []
        for prompt, output in zip(prompts, outputs, strict=True):
            (completion,) = output.outputs
            tokens[mode].append(completion.token_ids)
            logits = _hf_logits(checkpoint, prompt + completion.token_ids)
            assert completion.logprobs is not None and len(completion.logprobs) == 8
            for i, (token, entry) in enumerate(
                zip(completion.token_ids, completion.logprobs, strict=True)
            ):
                row = logits[len(prompt) - 1 + i]
                expected = _reported(mode, row)
                assert token in entry and len(entry) in (NUM_TOP, NUM_TOP + 1)
                for token_id, logprob in entry.items():
                    assert logprob.logprob == pytest.approx(float(expected[token_id]), abs=2e-4)
                if mode == "processed_logprobs":  # the temperature moved it off the raw value
                    raw = float(torch.log_softmax(row, -1)[token])
                    assert abs(entry[token].logprob - raw) > 1e-3
    # Seeded: the mode changes what is reported, never what is sampled.
    assert tokens["raw_logprobs"] == tokens["processed_logprobs"] == tokens["raw_logits"]
