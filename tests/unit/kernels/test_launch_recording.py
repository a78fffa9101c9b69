"""``recording_launches`` records what the launch wrappers choose, as Triton would compile it.

The wrappers get meta tensors (nothing could run on them) inside ``recording_launches``; the
records must carry the constexprs, argument types, warps and stages each wrapper chose for
the recording's target (its SM count and shared memory), which is what the GPU preflight
compiles.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedinfer.adapters.kernels.launch import RecordedLaunch, recording_launches
from pagedinfer.adapters.kernels.prefill_attention import paged_prefill_attention
from pagedinfer.adapters.kernels.qk_norm_rope import qk_norm_rope_store
from pagedinfer.adapters.kernels.skinny_gemm import skinny_gemm
from pagedinfer.adapters.kernels.target import KNOWN_TARGETS, kernel_target

META = torch.device("meta")


def meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=META)


def only(launches: list[RecordedLaunch]) -> RecordedLaunch:
    assert len(launches) == 1, launches
    return launches[0]


@pytest.mark.parametrize(("cache_dtype", "fmt"), [(torch.float8_e4m3fn, 1), (torch.float8_e5m2, 2)])
def test_records_the_fp8_store_configuration(cache_dtype: torch.dtype, fmt: int) -> None:
    heads, kv_heads, head_dim, tokens = 32, 8, 128, 3
    cache = meta(64, 16, kv_heads, head_dim, dtype=cache_dtype)
    with recording_launches(KNOWN_TARGETS[90]) as launches:
        qk_norm_rope_store(
            meta(tokens, (heads + 2 * kv_heads) * head_dim),
            meta(tokens, dtype=torch.int64),
            meta(4096, head_dim // 2, dtype=torch.float32),
            meta(4096, head_dim // 2, dtype=torch.float32),
            cache,
            cache.clone(),
            meta(tokens, dtype=torch.int64),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            q_weight=meta(head_dim),
            k_weight=meta(head_dim),
        )
    launch = only(launches)
    assert launch.name == "_qk_norm_rope_kernel"
    values = launch.constexpr_values()
    assert values["FP8_FORMAT"] == fmt and values["STORE_KV"] is True
    assert values["HAS_NORM"] is True and values["HEAD_DIM"] == head_dim
    signature = dict(launch.signature)
    assert signature["k_cache_ptr"] == "*u8"  # the cache's bytes
    assert signature["qkv_ptr"] == "*bf16"
    assert launch.num_warps == 4  # BLOCK_H * HALF_P2 >= 512


def prefill_tiles(capability: int) -> tuple[int, int, int]:
    heads, head_dim = 16, 256
    with recording_launches(KNOWN_TARGETS[capability]) as launches:
        paged_prefill_attention(
            meta(512, heads, head_dim, dtype=torch.float32),
            meta(64, 16, heads, head_dim, dtype=torch.float32),
            meta(64, 16, heads, head_dim, dtype=torch.float32),
            cu_seqlens_q=meta(3, dtype=torch.int32),
            context_lens=meta(2, dtype=torch.int32),
            block_tables=meta(2, 32, dtype=torch.int32),
            max_seqlen_q=256,
            scale=0.0625,
        )
    launch = only(launches)
    values = launch.constexpr_values()
    return values["BLOCK_M"], values["BLOCK_N"], launch.num_stages


def test_prefill_tiles_fit_the_targets_shared_memory() -> None:
    # float32, head dim 256: 64 x 32 tiles in two stages need 136 KiB; sm_89 has 99 KiB.
    assert prefill_tiles(90) == (64, 32, 2)
    assert prefill_tiles(80) == (64, 32, 2)
    assert prefill_tiles(89) == (32, 16, 2)


def test_split_k_follows_the_targets_sm_count() -> None:
    # One row against Qwen3-0.6B's o-projection: one row tile, 16 column tiles, so the K
    # range is split for many SMs and the partial sums are float32.
    with recording_launches(KNOWN_TARGETS[90]) as launches:
        skinny_gemm(meta(1, 2048), meta(1024, 2048))
    signature = dict(only(launches).signature)
    assert signature["c_ptr"] == "*fp32" and signature["M"] == "constexpr"
    assert kernel_target(META) is None  # the recording's target ends with it


def test_recording_targets_only_inside_the_block() -> None:
    with recording_launches(KNOWN_TARGETS[89]):
        assert kernel_target(torch.device("cpu")) == KNOWN_TARGETS[89]
    assert kernel_target(torch.device("cpu")) is None
