"""Kernel launches per decoder layer in a decode step on the Triton path: at most 12.

One decode step of a tiny Qwen3 runs under the interpreter while ``launch_counter`` counts the
torch ops that launch a kernel (dtype casts included, views and allocations not) and the
Triton launches, per layer. On a GPU each of them is one launch (or one graph node): the
number bounds the launch overhead of eager decode and the size of the captured graphs.
Before the fused kernels a layer took 60 launches in bfloat16 and 48 in float32.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from launch_counter import count_launches
from pagedinfer.adapters.model_runner import ModelRunner
from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.domain import SamplingParams, Scheduler, SchedulerConfig, Sequence

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="counts launches on the CPU under TRITON_INTERPRET=1",
)

MAX_LAUNCHES_PER_LAYER = 12
# add + RMSNorm, QKV GEMM, q/k norm + RoPE + KV store, decode attention, output GEMM,
# add + RMSNorm, gate/up GEMM, SiLU-and-mul, down GEMM.
EXPECTED_LAYER = {
    "triton:_add_rms_norm_kernel": 2,
    "linear": 4,
    "triton:_qk_norm_rope_kernel": 1,
    "triton:_decode_kernel": 1,
    "triton:_silu_and_mul_kernel": 1,
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_decode_step_launches_per_layer(
    make_checkpoint: Callable[..., Path], dtype: torch.dtype
) -> None:
    checkpoint = make_checkpoint("tiny")
    runner = ModelRunner(
        RunnerConfig(
            model_path=str(checkpoint),
            device=torch.device("cpu"),
            dtype=dtype,
            block_size=16,
            attention_backend="triton",
            max_num_seqs=4,
            max_num_batched_tokens=64,
            max_model_len=64,
            num_kv_blocks=16,
        )
    )
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=16, block_size=16, max_num_seqs=4, max_model_len=64)
    )
    params = SamplingParams(temperature=0.7, max_tokens=4, ignore_eos=True)
    for index in range(2):
        scheduler.add(Sequence(index, [1 + index] * 10, params))
    prefill = scheduler.schedule()
    assert prefill is not None and prefill.is_prefill
    scheduler.postprocess(prefill, runner.execute(prefill).sampled_token_ids)
    decode = scheduler.schedule()
    assert decode is not None and not decode.is_prefill

    with count_launches(runner.model.model.layers) as count:  # type: ignore[union-attr]
        runner.execute(decode)

    totals = count.layer_totals()
    assert len(totals) == 2
    for layer in count.per_layer:
        assert sum(layer.values()) <= MAX_LAUNCHES_PER_LAYER, count.describe()
        assert dict(layer) == EXPECTED_LAYER, count.describe()
    # Embedding, final norm, LM head and sampling; 17 since the sampler checks the chosen
    # token's logit is finite (gather, isfinite, where; issue 36: a NaN row is a failed request,
    # never a silent token) and the runner clamps a failed row's placeholder (clamp).
    assert count.outside_total <= 17, count.describe()
