"""``Engine(tensor_parallel_size=2, kv_cache_dtype="fp8")`` equals the single-process FP8
engine token for token: each rank quantizes its own KV heads with the layer's scales, which
calibration takes as the maximum over the ranks (so both ranks, and TP=1, use the same
scales). Chunked prefill, a warm prefix cache and preemption, as the other TP=2 tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from pagedinfer import Engine, SamplingParams

from .tp_helpers import shared_prefix_prompts

pytestmark = [pytest.mark.tensor_parallel, pytest.mark.slow]

# The chosen tokens' log-probabilities too: a rank quantizing with scales of its own (a
# valid cache, but not TP=1's) changes them by ~1e-2 without necessarily changing a token;
# the all-reduces of row-parallel layers change them by ~1e-6.
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
SETTINGS: dict[str, Any] = {
    "device": "cpu",
    "kv_block_size": 16,
    "max_model_len": 128,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 48,
    "num_kv_blocks": 12,
    "enable_prefix_caching": True,
    "kv_cache_dtype": "fp8",
}


def _uneven_heads(checkpoint: Path, target: Path) -> Path:
    """``checkpoint`` with KV head 1's values 2**12 times larger (``v_proj`` rows up, the
    ``o_proj`` columns that read them down: the same model). Rank 1's ``|V|`` is then 2**12
    times rank 0's: under the layer's one scale rank 0's values fall into e4m3's subnormals,
    so a rank that took its scale from its own heads alone would store other bytes than TP=1
    (with a ratio below ~2**6 the power-of-two scales would give the same values anyway)."""
    shutil.copytree(checkpoint, target)
    config = json.loads((target / "config.json").read_text())
    dim, groups = config["head_dim"], config["num_attention_heads"] // 2
    (file,) = sorted(target.glob("*.safetensors"))
    tensors = load_file(str(file))
    for name, tensor in tensors.items():
        if name.endswith("v_proj.weight"):
            tensor[dim : 2 * dim] *= 2**12
        elif name.endswith("o_proj.weight"):
            tensor[:, groups * dim :] /= 2**12
    save_file(tensors, str(file), metadata={"format": "pt"})
    return target


def test_tp2_equals_tp1_with_an_fp8_cache(tiny_checkpoint: Path, tmp_path: Path) -> None:
    checkpoint = _uneven_heads(tiny_checkpoint, tmp_path / "uneven")
    prompts = shared_prefix_prompts(seed=7, count=6)
    results, logprobs, lines = [], [], []
    for world in (1, 2):
        with Engine(checkpoint, tensor_parallel_size=world, **SETTINGS) as engine:
            outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
            again = engine.generate(prompts[:2], GREEDY, use_tqdm=False)
            preemptions = engine.stats().num_preemptions
            lines.append(engine.describe())
        assert preemptions > 0 and all(o.num_cached_tokens >= 32 for o in again)
        completions = [o.outputs[0] for o in [*outputs, *again]]
        results.append([c.token_ids for c in completions])
        logprobs.append(
            [
                entry[token].logprob
                for c in completions
                for token, entry in zip(c.token_ids, c.logprobs or [], strict=True)
            ]
        )
    assert results[0] == results[1]
    assert len(logprobs[0]) == len(logprobs[1]) == 8 * GREEDY.max_tokens
    worst = max(abs(a - b) for a, b in zip(*logprobs, strict=True))
    assert worst < 1e-3, worst
    assert all("(float8_e4m3fn)" in line for line in lines), lines
