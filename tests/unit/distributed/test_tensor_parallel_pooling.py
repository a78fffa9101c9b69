"""``LLM(runner="pooling", tensor_parallel_size=2)``: rank 0 pools the final hidden states
(replicated after the row-parallel all-reduces) and its embeddings equal transformers'
within 1e-4, mean pooling over chunked prompts included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_reference import hf_model
from pagedinfer import LLM

from .tp_helpers import shared_prefix_prompts

pytestmark = [pytest.mark.tensor_parallel, pytest.mark.slow]


def test_tp2_mean_embeddings_equal_transformers(tiny_checkpoint: Path) -> None:
    prompts = shared_prefix_prompts(seed=3, count=4)
    settings = {"device": "cpu", "kv_block_size": 16, "max_model_len": 128, "num_kv_blocks": 32}
    config = {"pooling_type": "MEAN", "normalize": False}
    with LLM(
        model=tiny_checkpoint,
        runner="pooling",
        pooler_config=config,
        tensor_parallel_size=2,
        max_num_batched_tokens=48,  # the longer prompts run in chunks
        **settings,
    ) as llm:
        outputs = llm.embed(prompts, use_tqdm=False)
    model = hf_model(str(tiny_checkpoint))
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.inference_mode():
            hidden = model.model(torch.tensor([prompt])).last_hidden_state[0]
        got = torch.tensor(output.outputs.embedding)
        torch.testing.assert_close(got, hidden.mean(0), atol=1e-4, rtol=1e-4)
