"""Where a runner's layers live in its KV cache with KV groups (``adapters/kv_groups.py``):
the whole model's groups on every rank and pipeline stage, each stage's own layers packed
into the slots of a block."""

from __future__ import annotations

import random

import pytest
import torch

from pagedinfer.adapters.attention.base import LayerAttentionKind
from pagedinfer.adapters.distributed.pipeline import pipeline_stages
from pagedinfer.adapters.kv_groups import RunnerKVLayout, runner_kv_layout
from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.domain.kv_groups import KVGroupLayout, KVGroupSpec, group_layers

CONFIG = RunnerConfig(
    model_path="unused",
    device=torch.device("cpu"),
    dtype=torch.float32,
    block_size=16,
    attention_backend="torch",
    max_model_len=128,
)
FULL = LayerAttentionKind(window=None)


def _kinds(windows: list[int | None]) -> list[LayerAttentionKind]:
    return [LayerAttentionKind(window=window) for window in windows]


def _layout(windows: list[int | None], held: range | None = None) -> RunnerKVLayout:
    held = range(len(windows)) if held is None else held
    layout = runner_kv_layout(_kinds(windows), held, CONFIG)
    assert layout is not None
    return layout


def test_one_kind_of_layer_is_the_plain_cache() -> None:
    assert runner_kv_layout([FULL] * 4, range(4), CONFIG) is None
    assert runner_kv_layout([FULL] * 4, range(2, 4), CONFIG) is None
    # A window as long as the context leaves nothing out: full attention.
    assert runner_kv_layout(_kinds([None, 128, None, 500]), range(4), CONFIG) is None
    every_layer_slides = _layout([8, 8, 8])
    assert every_layer_slides.groups == (KVGroupSpec(8, (0, 1, 2)),)


def test_the_whole_model_takes_the_domain_layout() -> None:
    windows: list[int | None] = [8, 8, None, 8, 8, None, 8]  # Gemma 3's pattern, cut short
    whole = KVGroupLayout.of(group_layers(windows))
    layout = _layout(windows)
    assert layout.groups == whole.groups
    assert layout.group_of_layer == whole.group_of_layer
    assert layout.slot_of_layer == whole.slot_of_layer
    assert layout.layers_per_block == whole.layers_per_group == 2


def test_a_stage_packs_its_layers_of_each_group_into_its_own_slots() -> None:
    # Groups: full [2, 5], sliding [0, 1], [3, 4]; two stages of three layers.
    windows: list[int | None] = [8, 8, None, 8, 8, None]
    first, second = _layout(windows, range(0, 3)), _layout(windows, range(3, 6))
    assert first.groups == second.groups == _layout(windows).groups
    assert first.group_of_layer == (1, 1, 0) and first.slot_of_layer == (0, 1, 0)
    assert second.group_of_layer == (2, 2, 0) and second.slot_of_layer == (0, 1, 0)
    assert first.layers_per_block == second.layers_per_block == 2
    # GPT-OSS's alternation over two stages: one layer of each group per stage.
    alternating: list[int | None] = [8, None, 8, None]
    for held in (range(0, 2), range(2, 4)):
        stage = _layout(alternating, held)
        assert stage.slot_of_layer == (0, 0) and stage.layers_per_block == 1
        assert sorted(stage.group_of_layer) == [0, 1]


@pytest.mark.parametrize("seed", range(40))
def test_every_split_places_each_layer_once_in_its_groups_slots(seed: int) -> None:
    rng = random.Random(seed)
    num_layers = rng.randint(2, 12)
    windows = [rng.choice([None, 8, 8, 32]) for _ in range(num_layers)]
    whole = runner_kv_layout(_kinds(windows), range(num_layers), CONFIG)
    for stage in pipeline_stages(num_layers, rng.randint(1, num_layers)):
        layout = runner_kv_layout(_kinds(windows), stage.layers, CONFIG)
        if whole is None:
            assert layout is None
            continue
        assert layout is not None and layout.groups == whole.groups
        places = list(zip(layout.group_of_layer, layout.slot_of_layer, strict=True))
        assert len(set(places)) == len(places), "two layers share a page"
        assert max(layout.slot_of_layer) + 1 == layout.layers_per_block
        for layer, (group, _) in zip(stage.layers, places, strict=True):
            assert group == whole.group_of_layer[layer]
            assert layer in whole.groups[group].layers
