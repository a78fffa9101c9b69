"""KV groups through the engine (CPU, torch backend): windowed layers get their own tables.

A two-layer Qwen2 whose second layer slides (window 12, ``layer_types``) runs with two KV
groups (a full one, a sliding one: one layer per block each); a Mistral whose every layer
slides runs with one sliding group. Greedy float32 tokens equal transformers' on prompts
several windows long sharing a prefix (prefix hits per group), with a step budget smaller
than a prompt (chunks) and, for the hybrid model, a pool small enough to preempt; the sliding
groups hold no more than their window's blocks per running sequence while they decode.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from hf_reference import hf_greedy
from pagedinfer import Engine, SamplingParams
from pagedinfer.domain.sequence import SequenceStatus

MAX_TOKENS = 16
VOCAB = 256


@pytest.fixture(scope="module")
def hybrid_checkpoint(
    make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """Qwen2: layer 0 full attention, layer 1 a 12-token window."""
    source = make_checkpoint("tiny", architecture="Qwen2ForCausalLM", vocab_size=VOCAB)
    path = tmp_path_factory.mktemp("hybrid") / "qwen2-hybrid"
    shutil.copytree(source, path)
    config = json.loads((path / "config.json").read_text())
    config.update(
        use_sliding_window=True,
        sliding_window=12,
        max_window_layers=1,
        layer_types=["full_attention", "sliding_attention"],
    )
    (path / "config.json").write_text(json.dumps(config))
    return path


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(50)]
    return [system + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))] for _ in range(4)]


def run(engine: Engine, checkpoint: Path, batch: list[list[int]]) -> None:
    """Generate ``batch`` step by step, checking each sliding group's blocks, then compare
    with transformers."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in batch]
    scheduler = engine.scheduler
    outputs: dict[str, list[int]] = {}
    while scheduler.has_unfinished():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = list(output.outputs[0].token_ids)
        decoding = [s for s in scheduler.running if s.status is SequenceStatus.RUNNING]
        for usage in scheduler.kv_group_usage():
            if usage.max_blocks_per_sequence is not None:
                # Partly prefilled sequences may hold a chunk more: bound the decoders'.
                bound = usage.max_blocks_per_sequence + 3  # + a 40-token chunk's blocks
                assert usage.num_blocks_held <= len(decoding) * bound
    for rid, prompt in zip(ids, batch, strict=True):
        assert outputs[rid] == hf_greedy(checkpoint, prompt, MAX_TOKENS), len(prompt)


def test_a_hybrid_model_runs_with_a_full_and_a_sliding_group(hybrid_checkpoint: Path) -> None:
    with Engine(
        hybrid_checkpoint,
        device="cpu",
        kv_block_size=16,
        max_model_len=128,
        num_kv_blocks=17,  # the least it accepts: the null block, 8 full, 8 sliding
        max_num_batched_tokens=40,
        attention_backend="torch",
    ) as engine:
        groups = engine.scheduler.config.kv_groups
        assert [(g.window, g.layers) for g in groups] == [(None, (0,)), (12, (1,))]
        batch = prompts(1)
        run(engine, hybrid_checkpoint, batch)
        run(engine, hybrid_checkpoint, batch[::-1])  # the prefix cache, per group
        stats = engine.stats()
        assert [(g.window, g.num_layers, g.num_blocks_held) for g in stats.kv_groups] == [
            (None, 1, 0),
            (12, 1, 0),
        ]
        assert stats.kv_groups[1].max_blocks_per_sequence == 2  # ceil(12 / 16) + 1
        assert stats.kv_cache_usage == 0.0  # idle: the null block held for life is not usage
        assert stats.prefix_cache_hit_rate > 0
        assert stats.num_preemptions > 0


def test_a_model_whose_every_layer_slides_has_one_sliding_group(
    make_checkpoint: Callable[..., Path],
) -> None:
    checkpoint = make_checkpoint(
        "tiny", architecture="MistralForCausalLM", sliding_window=12, vocab_size=VOCAB
    )
    with Engine(
        checkpoint,
        device="cpu",
        kv_block_size=16,
        max_model_len=128,
        num_kv_blocks=16,
        max_num_batched_tokens=40,
        attention_backend="torch",
    ) as engine:
        assert [g.window for g in engine.scheduler.config.kv_groups] == [12]
        run(engine, checkpoint, prompts(2)[:2])


def test_a_cache_sized_from_memory_holds_every_group(hybrid_checkpoint: Path) -> None:
    with Engine(
        hybrid_checkpoint, device="cpu", kv_block_size=16, max_model_len=128, max_num_seqs=4
    ) as engine:
        config = engine.scheduler.config
        assert len(config.kv_groups) == 2
        # At most every sequence's table in both groups, plus the null block.
        assert 17 <= config.num_blocks <= 4 * 8 * 2 + 1
