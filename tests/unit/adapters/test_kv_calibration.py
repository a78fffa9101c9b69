"""FP8 KV scales (``adapters/kv_calibration.py``): the checkpoint's where given, else calibrated."""

from __future__ import annotations

import torch

from pagedinfer.adapters.attention.torch_ref import TorchAttentionBackend
from pagedinfer.adapters.distributed.parallel import SINGLE_PROCESS
from pagedinfer.adapters.kv_cache import calibrated_scale
from pagedinfer.adapters.kv_calibration import cache_amax, calibration_plan, fp8_kv_scales
from pagedinfer.adapters.layers.attention import PagedAttention

FP8 = torch.float8_e4m3fn


def _layer(k_scale: float | None = None, v_scale: float | None = None) -> PagedAttention:
    layer = PagedAttention(2, 1, 4, scale=1.0, backend=TorchAttentionBackend(16))
    layer.set_kv_scales(k_scale, v_scale)
    return layer


def _scales(
    layers: list[PagedAttention], amax: list[list[float]] | None
) -> tuple[torch.Tensor, tuple[str, ...], int]:
    calls = []

    def calibrate() -> list[list[float]]:
        calls.append(1)
        assert amax is not None
        return amax

    scales, sources = fp8_kv_scales(
        layers, kv_cache_dtype=FP8, device=torch.device("cpu"), calibrate=calibrate, log=False
    )
    return scales, sources, len(calls)


def test_checkpoint_scales_need_no_calibration_pass() -> None:
    scales, sources, calls = _scales([_layer(0.5, 2.0), _layer(1.0, 4.0)], None)
    assert calls == 0
    assert sources == ("checkpoint", "checkpoint")
    assert scales.tolist() == [[0.5, 2.0, 2.0, 0.5], [1.0, 4.0, 1.0, 0.25]]


def test_missing_scales_are_calibrated_from_the_largest_values() -> None:
    amax = [[100.0, 3.0], [7.0, 0.0]]  # [k, v][layer]
    scales, sources, calls = _scales([_layer(k_scale=0.5), _layer()], amax)
    assert calls == 1
    assert sources == ("checkpoint/calibrated", "calibrated")
    assert scales[0, :2].tolist() == [0.5, calibrated_scale(7.0, FP8)]
    assert scales[1, :2].tolist() == [calibrated_scale(3.0, FP8), 1.0]  # amax 0: scale 1
    torch.testing.assert_close(scales[:, 2:], 1 / scales[:, :2])


def test_cache_amax_is_per_layer_for_keys_and_values() -> None:
    cache = torch.zeros(2, 3, 2, 4, 1, 2)  # [k/v, layers, blocks, block_size, heads, dim]
    cache[0, 1, 1, 2, 0, 1] = -9.0
    cache[1, 2, 0, 0, 0, 0] = 5.0
    assert cache_amax(cache, SINGLE_PROCESS) == [[0.0, 9.0, 0.0], [0.0, 0.0, 5.0]]


def test_the_calibration_prompt_is_fixed_and_fills_its_blocks() -> None:
    plan = calibration_plan(40, block_size=16, vocab_size=100)
    again = calibration_plan(40, block_size=16, vocab_size=100)
    assert plan.input_ids == again.input_ids  # the same tokens on every run and rank
    assert all(0 <= token < 100 for token in plan.input_ids)
    assert plan.is_prefill and plan.num_tokens == 40 and plan.num_samples == 0
    assert plan.slot_mapping.tolist() == list(range(40))
    assert plan.block_tables.tolist() == [0, 1, 2] and plan.block_table_width == 3
