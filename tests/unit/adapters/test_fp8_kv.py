"""The FP8 KV cache's pieces: names, bytes, scales, the torch store and reads, the backends'
choice, and the checkpoint hook (``PagedAttention.set_kv_scales``)."""

from __future__ import annotations

import math

import pytest
import torch

from pagedinfer.adapters import attention as attention_module
from pagedinfer.adapters.attention import resolve_backend_name
from pagedinfer.adapters.attention.base import AttentionMetadata
from pagedinfer.adapters.attention.torch_ref import TorchAttentionBackend, store_kv_torch
from pagedinfer.adapters.kv_cache import (
    KV_CACHE_DTYPES,
    calibrated_scale,
    dequantize_fp8,
    fp8_max,
    kv_block_bytes,
    quantize_fp8,
    resolve_kv_cache_dtype,
    scale_row,
)
from pagedinfer.adapters.layers.attention import PagedAttention
from pagedinfer.adapters.step_inputs import plan_metadata
from pagedinfer.domain import ScheduledChunk, Sequence, build_batch_plan
from pagedinfer.engine.config import EngineConfig
from pagedinfer.errors import ConfigurationError, UnsupportedModelError

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_vllms_names_resolve_to_the_float8_dtypes() -> None:
    assert KV_CACHE_DTYPES == ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16) is E4M3  # "fp8" is e4m3, as in vLLM
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.float32) is E4M3
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.float16) is E5M2
    for wrong in ("fp16", "int8", "FP8"):
        with pytest.raises(ConfigurationError, match=rf"kv_cache_dtype={wrong!r} is unknown.*fp8"):
            resolve_kv_cache_dtype(wrong, torch.float32)
        with pytest.raises(ConfigurationError, match="kv_cache_dtype"):
            EngineConfig(model_path="x", kv_cache_dtype=wrong)


def test_an_fp8_block_takes_half_the_bytes_of_a_16_bit_one() -> None:
    def size(dtype: torch.dtype) -> int:
        return kv_block_bytes(
            num_layers=28, block_size=256, num_kv_heads=8, head_dim=128, dtype=dtype
        )

    assert size(E4M3) == size(E5M2) == size(torch.bfloat16) // 2 == size(torch.float32) // 4


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("amax", [1e-3, 0.02, 1.0, 3.7, 50.0, 448.0, 1e4])
def test_a_calibrated_scale_is_a_power_of_two_with_2_to_4x_headroom(
    dtype: torch.dtype, amax: float
) -> None:
    scale = calibrated_scale(amax, dtype)
    assert math.log2(scale) == int(math.log2(scale))
    assert fp8_max(dtype) / 4 < amax / scale <= fp8_max(dtype) / 2


def test_a_layer_with_nothing_to_calibrate_gets_scale_one() -> None:
    for amax in (0.0, float("inf"), float("nan")):
        assert calibrated_scale(amax, E4M3) == 1.0


def test_a_scale_row_holds_the_scales_and_their_float32_reciprocals() -> None:
    row = torch.tensor(scale_row(0.3, 2.0**-7))
    assert row.tolist()[:2] == [pytest.approx(0.3), 2.0**-7]
    assert row[2].item() == torch.tensor(1 / 0.3, dtype=torch.float32).item()
    assert row[3].item() == 128.0


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_the_torch_store_quantizes_each_slot_and_skips_padding(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    key = torch.randn(5, 2, 8, generator=generator) * 10  # |K| / 0.125 < 448: no saturation
    value = torch.randn(5, 2, 8, generator=generator) * 0.01
    row = torch.tensor(scale_row(0.125, 2.0**-12))
    slots = torch.tensor([3, 9, -1, 0, 17])
    k_cache = torch.zeros(3, 8, 2, 8, dtype=dtype)
    v_cache = torch.zeros(3, 8, 2, 8, dtype=dtype)

    store_kv_torch(key, value, k_cache, v_cache, slots, kv_scales=row)

    flat_k, flat_v = k_cache.view(-1, 2, 8), v_cache.view(-1, 2, 8)
    for token, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        k_back = dequantize_fp8(flat_k[slot], row[0], torch.float32)
        v_back = dequantize_fp8(flat_v[slot], row[1], torch.float32)
        # Round to nearest: within half a step (2**-mantissa_bits relative, of a normal).
        relative = 2.0 ** -(4 if dtype == E4M3 else 3)
        torch.testing.assert_close(k_back, key[token], rtol=relative, atol=0.125 * 2**-9)
        torch.testing.assert_close(v_back, value[token], rtol=relative, atol=2.0**-12 * 2**-9)
    written = flat_k.to(torch.float32).abs().sum((1, 2)) > 0
    assert written.nonzero().flatten().tolist() == [0, 3, 9, 17]  # not the padding row's


def _prefill_meta(
    prompt_len: int, cached: int, block_size: int = 16, num_blocks: int = 8
) -> AttentionMetadata:
    """A prefill step computing tokens ``cached..prompt_len`` of one sequence."""
    seq = Sequence(0, list(range(prompt_len)))
    seq.block_table = list(range(-(-prompt_len // block_size)))
    seq.num_computed_tokens = cached
    plan = build_batch_plan(
        [ScheduledChunk(seq, prompt_len - cached)], is_prefill=True, block_size=block_size
    )
    return plan_metadata(plan, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_a_fresh_prefill_attends_to_the_kv_as_the_cache_holds_it(dtype: torch.dtype) -> None:
    """A prompt's attention is the same whether its first blocks come from the prefix cache
    or are computed in the step: both see the quantized K/V (the torch backend's fresh
    prefill would otherwise attend to the unquantized ones, its cached reads not)."""
    generator = torch.Generator().manual_seed(1)
    length, cached, heads, kv_heads, dim = 40, 32, 4, 2, 16
    query = torch.randn(length, heads, dim, generator=generator)
    key = torch.randn(length, kv_heads, dim, generator=generator) * 8
    value = torch.randn(length, kv_heads, dim, generator=generator)
    row = torch.tensor(scale_row(2.0**-4, 2.0**-6))
    backend = TorchAttentionBackend(16)
    shape = (8, 16, kv_heads, dim)

    def caches() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)

    fresh_k, fresh_v = caches()
    fresh = backend.forward(
        query, key, value, fresh_k, fresh_v, _prefill_meta(length, 0), 0.25, kv_scales=row
    )
    hit_k, hit_v = caches()  # the first 32 tokens stored by an earlier step
    first = _prefill_meta(cached, 0)
    backend.forward(
        query[:cached], key[:cached], value[:cached], hit_k, hit_v, first, 0.25, kv_scales=row
    )
    rest = slice(cached, length)
    hit = backend.forward(
        query[rest], key[rest], value[rest], hit_k, hit_v, _prefill_meta(length, cached), 0.25,
        kv_scales=row,
    )  # fmt: skip

    torch.testing.assert_close(hit, fresh[rest], rtol=1e-5, atol=1e-5)
    assert torch.equal(hit_k.view(torch.uint8), fresh_k.view(torch.uint8))
    # And it is quantized attention: not the float32 result (K errors of a few percent).
    exact = backend.forward(
        query, key, value, *(torch.zeros(shape), torch.zeros(shape)), _prefill_meta(length, 0),
        0.25,
    )  # fmt: skip
    assert (exact - fresh).abs().max() > 1e-3


def test_the_flash_backend_refuses_an_fp8_cache_naming_the_option() -> None:
    from pagedinfer.adapters.attention.flash import FlashAttentionBackend

    for name in ("fp8", "fp8_e5m2"):
        with pytest.raises(
            ConfigurationError, match=rf"kv_cache_dtype={name!r} is not supported.*'triton'"
        ):
            FlashAttentionBackend(256, kv_cache_dtype=name)
        with pytest.raises(ConfigurationError, match=rf"kv_cache_dtype={name!r}.*'flash'"):
            resolve_backend_name("flash", torch.device("cpu"), kv_cache_dtype=name)


def test_auto_picks_triton_over_flash_for_an_fp8_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention_module, "flash_attn_available", lambda: True)
    monkeypatch.setattr(attention_module, "_triton_usable_on", lambda device: True)
    cuda = torch.device("cuda", 0)
    assert resolve_backend_name("auto", cuda, block_size=256) == "flash"
    assert resolve_backend_name("auto", cuda, block_size=256, kv_cache_dtype="fp8") == "triton"
    assert resolve_backend_name("auto", torch.device("cpu"), kv_cache_dtype="fp8") == "torch"


def _layer() -> PagedAttention:
    return PagedAttention(4, 2, 16, scale=0.25, backend=TorchAttentionBackend(16))


def test_the_checkpoint_hook_records_per_layer_scales() -> None:
    layer = _layer()
    assert (layer.checkpoint_k_scale, layer.checkpoint_v_scale) == (None, None)
    layer.set_kv_scales(k_scale=torch.tensor(0.5))
    assert (layer.checkpoint_k_scale, layer.checkpoint_v_scale) == (0.5, None)
    layer.set_kv_scales(v_scale=torch.tensor([0.03125], dtype=torch.bfloat16))
    assert (layer.checkpoint_k_scale, layer.checkpoint_v_scale) == (0.5, 0.03125)


@pytest.mark.parametrize(
    ("scale", "message"),
    [
        (torch.ones(2), r"shape \[2\]: expected one scale per layer"),
        (0.0, "k_scale=0.0 is invalid: expected a finite number > 0"),
        (-1.0, "k_scale=-1.0 is invalid"),
        (float("nan"), "k_scale=nan is invalid"),
        (torch.tensor(float("inf")), "k_scale=inf is invalid"),
    ],
)
def test_the_checkpoint_hook_refuses_scales_that_are_not_one_positive_number(
    scale: float | torch.Tensor, message: str
) -> None:
    with pytest.raises(UnsupportedModelError, match=message):
        _layer().set_kv_scales(k_scale=scale)


def test_quantize_rounds_ties_to_even_and_saturates() -> None:
    one = torch.tensor(1.0)
    # e4m3 around 16: steps of 2; 17 is a tie between 16 (even mantissa) and 18.
    assert quantize_fp8(torch.tensor([17.0, 19.0, 500.0]), one, E4M3).float().tolist() == [
        16.0,
        20.0,
        448.0,
    ]
    assert quantize_fp8(torch.tensor([-1e9]), one, E5M2).float().item() == -57344.0
