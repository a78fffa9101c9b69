"""``Engine(tensor_parallel_size=2)`` on quantized checkpoints equals the single-process engine.

Two ranks over gloo, each loading its slice of the quantized tensors (FP8 block scales cut
with the weight's rows and columns; GPTQ act-order: packed words cut along the input, every
group's scales kept by both ranks of a row-parallel layer), dequantized on the CPU. One
engine per format: chunked prefill, a warm prefix cache and preemption, token for token
against ``tensor_parallel_size=1``. The layer-by-layer split of every format is in
``tests/unit/adapters/quantization/test_quantized_tensor_parallel.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pagedinfer import Engine, SamplingParams
from pagedinfer.adapters.models.quantized_checkpoint import QuantFormat, write_quantized_checkpoint

from .tp_helpers import shared_prefix_prompts

pytestmark = [pytest.mark.tensor_parallel, pytest.mark.slow]

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SETTINGS: dict[str, Any] = {
    "device": "cpu",
    "kv_block_size": 16,
    "max_model_len": 128,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 48,
    "num_kv_blocks": 12,
    "enable_prefix_caching": True,
}
# 4 query / 4 KV heads of 32: k and v hold 128 rows, 64 per rank (whole 64-blocks).
MODEL: dict[str, Any] = {
    "hidden_size": 192,
    "intermediate_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
}
FORMATS: dict[str, tuple[QuantFormat, dict[str, Any]]] = {
    "fp8-block64": ("fp8", {"block": (64, 64)}),
    "gptq-act-order": ("gptq", {"group_size": 64, "desc_act": True}),
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_tp2_equals_tp1(make_checkpoint: Callable[..., Path], tmp_path: Path, name: str) -> None:
    fmt, options = FORMATS[name]
    checkpoint = write_quantized_checkpoint(
        make_checkpoint("tiny", **MODEL), tmp_path / name, fmt, **options
    )
    prompts = shared_prefix_prompts(seed=5, count=6)
    results = []
    for world in (1, 2):
        with Engine(checkpoint, tensor_parallel_size=world, **SETTINGS) as engine:
            outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
            again = engine.generate(prompts[:2], GREEDY, use_tqdm=False)
            preemptions = engine.stats().num_preemptions
        assert preemptions > 0 and all(o.num_cached_tokens >= 32 for o in again)
        results.append([o.outputs[0].token_ids for o in [*outputs, *again]])
    assert results[0] == results[1]
