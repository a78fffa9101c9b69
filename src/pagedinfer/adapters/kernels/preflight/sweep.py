"""Drive every launch wrapper over the engine's model shapes and record what it launches.

No device: the wrappers get meta tensors (shapes, dtypes, strides, no memory) inside
:func:`~pagedinfer.adapters.kernels.launch.recording_launches`, so each records the
(kernel, signature, constexprs, warps, stages) it would launch on the target, chosen by its
own code (tile sizes, split-K counts, FP8 formats). The sweep only says which calls the
engine makes: per model, dtype (bfloat16 / float16 / float32), KV cache (model dtype,
float8 e4m3 / e5m2), cache block size (16 / 256) and row count (decode and prefill).

FP8-weight GEMMs are swept only on targets the engine runs them on
(:data:`~pagedinfer.adapters.quantization.fp8.FP8_KERNEL_MIN_CAPABILITY`); the skinny GEMM
only where the engine picks it (:func:`~pagedinfer.adapters.kernels.skinny_gemm.skinny_gemm_wins`).
GPT-OSS's experts (:data:`GPT_OSS_EXPERTS`) are swept apart, in bfloat16 only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch

from pagedinfer.adapters.kernels.launch import RecordedLaunch, recording_launches
from pagedinfer.adapters.kernels.target import KernelTarget

__all__ = ["GPT_OSS_EXPERTS", "MODELS", "GptOssExpertsShape", "ModelShape", "SweptLaunch", "sweep"]

Call = Callable[[], object]
_META = torch.device("meta")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
KV_DTYPES = (None, torch.float8_e4m3fn, torch.float8_e5m2)  # None: the model's dtype
BLOCK_SIZES = (16, 256)
DECODE_ROWS = (1, 16, 32, 64, 256)
PREFILL_ROWS = 4096
PREFILL_QUERY_LENS = (32, 2048)  # short chunks and long prompts choose different tiles
MAX_MODEL_LEN = 8192
INT4_GROUP = 128
FP8_WEIGHT_BLOCKS = ((128, 128), None)  # DeepSeek-style blocks, per-channel scales
# Attention layer kinds (window, sinks): full causal, a sliding window (Mistral, Gemma 3),
# a sliding window with sinks (GPT-OSS). Every model shape is swept with each, in
# VARIANT_DTYPE only: a window or sinks add the same code to every dtype's kernel, and the
# sweep's time grows with every variant (each dtype, KV format and tile compiles apart).
LAYER_KINDS = ((None, False), (128, False), (128, True))
# The dtype that variants which do not depend on the dtype (windows, sinks, LoRA) are swept in.
VARIANT_DTYPE = torch.bfloat16
# Capped attention logits (Gemma 2's attn_logit_softcapping) on full and sliding layers: in
# VARIANT_DTYPE, the model's KV dtype and one block size only, to keep the variants few.
SOFTCAP = 50.0
SOFTCAP_KINDS = ((None, False, SOFTCAP), (128, False, SOFTCAP))
# GPT-OSS's full layers (sinks, no window): the only kind that launches the split-KV
# reduction with sinks (a window of 128 reads too few keys to split decode). Swept like the
# softcap kinds: the reduction reads float32 partials whatever the KV format, and the FP8
# decode kernel with sinks is the sliding kind's.
FULL_SINKS_KINDS = ((None, True, None),)


def _layer_kinds(dtype: torch.dtype) -> tuple[tuple[int | None, bool], ...]:
    return LAYER_KINDS if dtype == VARIANT_DTYPE else LAYER_KINDS[:1]


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The sizes of a model that its kernels' launches depend on."""

    name: str
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP (0: every layer is MoE)
    vocab: int
    qk_norm: bool
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0


MODELS = (
    ModelShape("Qwen3-0.6B", 1024, 16, 8, 128, 3072, 151936, qk_norm=True),
    ModelShape("Qwen3-8B", 4096, 32, 8, 128, 12288, 151936, qk_norm=True),
    ModelShape("Llama-3-8B", 4096, 32, 8, 128, 14336, 128256, qk_norm=False),
    ModelShape(
        "Qwen3-30B-A3B",
        2048,
        32,
        4,
        128,
        0,
        151936,
        True,
        num_experts=128,
        top_k=8,
        moe_intermediate=768,
    ),
    ModelShape("Llama-3.2-1B (head dim 64)", 2048, 32, 8, 64, 8192, 128256, qk_norm=False),
    ModelShape("Gemma-7B (head dim 256)", 3072, 16, 16, 256, 24576, 256000, qk_norm=False),
)


@dataclass(frozen=True, slots=True)
class GptOssExpertsShape:
    """GPT-OSS's experts (biased, clamped SwiGLU: ``fused_gpt_oss_moe``), swept on their own
    in bfloat16 only: its other kernels are the shared ones, already swept above."""

    name: str
    hidden: int
    num_experts: int
    top_k: int
    intermediate: int


GPT_OSS_EXPERTS = (GptOssExpertsShape("GPT-OSS-20B experts", 2880, 32, 4, 2880),)


@dataclass(frozen=True, slots=True)
class SweptLaunch:
    """A recorded launch and the sweep case that made it (model and dtype)."""

    case: str
    launch: RecordedLaunch


def sweep(
    target: KernelTarget,
    models: tuple[ModelShape, ...] = MODELS,
    gpt_oss_experts: tuple[GptOssExpertsShape, ...] = GPT_OSS_EXPERTS,
) -> list[SweptLaunch]:
    """Every launch the wrappers choose for ``models`` and ``gpt_oss_experts`` on ``target``
    (with repeats)."""
    swept: list[SweptLaunch] = []
    with recording_launches(target) as launches:

        def record(case: str, calls: Iterator[Call]) -> None:
            for call in calls:
                done = len(launches)
                call()
                swept.extend(SweptLaunch(case, launch) for launch in launches[done:])

        for model in models:
            for dtype in DTYPES:
                case = f"{model.name} {str(dtype).removeprefix('torch.')}"
                record(case, _model_calls(model, dtype, target))
        for experts in gpt_oss_experts:
            record(f"{experts.name} bfloat16", _gpt_oss_moe(experts, torch.bfloat16))
    return swept


def _empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=_META)


def _model_calls(model: ModelShape, dtype: torch.dtype, target: KernelTarget) -> Iterator[Call]:
    yield from _norm_and_activation(model, dtype)
    for kv_dtype in KV_DTYPES:
        for block_size in BLOCK_SIZES:
            yield from _attention(model, dtype, kv_dtype or dtype, block_size, target)
    yield from _gemms(model, dtype, target)
    if dtype == VARIANT_DTYPE:  # LoRA runs in the model's 16-bit dtype on CUDA
        yield from _lora(model, dtype)
    if model.num_experts:
        yield from _moe(model, dtype)
    yield from _sampling(model, dtype)


def _norm_and_activation(model: ModelShape, dtype: torch.dtype) -> Iterator[Call]:
    from pagedinfer.adapters.kernels.add_rms_norm import add_rms_norm, rms_norm
    from pagedinfer.adapters.kernels.silu_and_mul import silu_and_mul

    weight = _empty(model.hidden, dtype=dtype)
    for rows in (1, PREFILL_ROWS):
        x = _empty(rows, model.hidden, dtype=dtype)
        yield partial(rms_norm, x, weight, 1e-6)
        yield partial(add_rms_norm, x, x.clone(), weight, 1e-6)
        if model.intermediate:
            yield partial(silu_and_mul, _empty(rows, 2 * model.intermediate, dtype=dtype))


def _lora(model: ModelShape, dtype: torch.dtype) -> Iterator[Call]:
    """The batched LoRA pair (adapters/kernels/lora.py) on each adapted projection: ranks 16
    and 64 (the packed q/k/v and gate/up shrink stacks theirs), 4 slots."""
    from pagedinfer.adapters.kernels.lora import lora_expand_triton, lora_shrink_triton

    q_out = model.num_heads * model.head_dim
    kv_out = model.num_kv_heads * model.head_dim
    projections = [(model.hidden, 3, (q_out, kv_out)), (q_out, 1, (model.hidden,))]
    if model.intermediate:
        projections += [(model.hidden, 2, (model.intermediate,))]
        projections += [(model.intermediate, 1, (model.hidden,))]
    for rows in (*DECODE_ROWS, PREFILL_ROWS):
        slots = torch.empty(rows, dtype=torch.int64, device=_META)
        for rank in (16, 64):
            for in_features, parts, outs in projections:
                x = _empty(rows, in_features, dtype=dtype)
                a = _empty(4, parts * rank, in_features, dtype=dtype)
                yield partial(lora_shrink_triton, x, a, slots)
                s = _empty(rows, rank, dtype=dtype)
                for out_features in outs:
                    b = _empty(4, rank, out_features, dtype=dtype)
                    y = _empty(rows, out_features, dtype=dtype)
                    yield partial(lora_expand_triton, y, s, b, slots)


def _attention(
    model: ModelShape,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    block_size: int,
    target: KernelTarget,
) -> Iterator[Call]:
    from pagedinfer.adapters.kernels.decode_attention import (
        SplitPartials,
        choose_num_splits,
        paged_decode_attention,
        split_workspace_numel,
    )
    from pagedinfer.adapters.kernels.prefill_attention import paged_prefill_attention
    from pagedinfer.adapters.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_store
    from pagedinfer.adapters.kernels.store_kv import store_kv_cache

    heads, kv_heads, head_dim = model.num_heads, model.num_kv_heads, model.head_dim
    num_blocks = 1024
    k_cache = _empty(num_blocks, block_size, kv_heads, head_dim, dtype=cache_dtype)
    v_cache = _empty(num_blocks, block_size, kv_heads, head_dim, dtype=cache_dtype)
    scales = _empty(4, dtype=torch.float32)
    table_width = MAX_MODEL_LEN // block_size
    cos = _empty(MAX_MODEL_LEN, head_dim // 2, dtype=torch.float32)
    norm = _empty(head_dim, dtype=dtype) if model.qk_norm else None
    sizes = {"num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim}

    for rows in (1, PREFILL_ROWS):
        qkv = _empty(rows, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
        positions = _empty(rows, dtype=torch.int64)
        slots = _empty(rows, dtype=torch.int64)
        yield partial(
            qk_norm_rope_store, qkv, positions, cos, cos, k_cache, v_cache, slots,
            q_weight=norm, k_weight=norm, kv_scales=scales, **sizes,
        )  # fmt: skip
        if cache_dtype == dtype and block_size == BLOCK_SIZES[0]:  # no cache involved
            yield partial(
                qk_norm_rope, qkv, positions, cos, cos, q_weight=norm, k_weight=norm, **sizes
            )
        key = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(rows, kv_heads, -1)
        value = qkv[:, (heads + kv_heads) * head_dim :].view(rows, kv_heads, head_dim)
        yield partial(store_kv_cache, key, value, k_cache, v_cache, slots, kv_scales=scales)

    scale = head_dim**-0.5
    for num_seqs in DECODE_ROWS:
        for window, sinks, softcap in _kinds(dtype, cache_dtype, block_size):
            # A windowed layer's split count follows its window (often one: no reduction).
            splits = choose_num_splits(
                num_seqs, kv_heads, MAX_MODEL_LEN, target.num_sms, window=window, head_dim=head_dim
            )
            buffer = _empty(
                max(1, split_workspace_numel(num_seqs, heads, splits, head_dim)),
                dtype=torch.float32,
            )
            partials = (
                SplitPartials.from_buffer(buffer, num_seqs, heads, splits, head_dim)
                if splits > 1
                else None
            )
            yield partial(
                paged_decode_attention, _empty(num_seqs, heads, head_dim, dtype=dtype), k_cache,
                v_cache, context_lens=_empty(num_seqs, dtype=torch.int32),
                block_tables=_empty(num_seqs, table_width, dtype=torch.int32), scale=scale,
                num_splits=splits, partials=partials, kv_scales=scales, window=window,
                sinks=_empty(heads, dtype=torch.float32) if sinks else None, softcap=softcap,
            )  # fmt: skip

    num_seqs = 4
    for max_seqlen_q in PREFILL_QUERY_LENS:
        for window, sinks, softcap in _kinds(dtype, cache_dtype, block_size):
            yield partial(
                paged_prefill_attention, _empty(PREFILL_ROWS, heads, head_dim, dtype=dtype),
                k_cache, v_cache, cu_seqlens_q=_empty(num_seqs + 1, dtype=torch.int32),
                context_lens=_empty(num_seqs, dtype=torch.int32),
                block_tables=_empty(num_seqs, table_width, dtype=torch.int32),
                max_seqlen_q=max_seqlen_q, scale=scale, kv_scales=scales, window=window,
                sinks=_empty(heads, dtype=torch.float32) if sinks else None, softcap=softcap,
            )  # fmt: skip


def _kinds(
    dtype: torch.dtype, cache_dtype: torch.dtype, block_size: int
) -> tuple[tuple[int | None, bool, float | None], ...]:
    """The attention layer kinds ``(window, sinks, softcap)`` swept for this case."""
    kinds: tuple[tuple[int | None, bool, float | None], ...]
    kinds = tuple((window, sinks, None) for window, sinks in _layer_kinds(dtype))
    if dtype == VARIANT_DTYPE and cache_dtype == dtype and block_size == BLOCK_SIZES[0]:
        kinds += SOFTCAP_KINDS + FULL_SINKS_KINDS
    return kinds


def _projections(model: ModelShape) -> list[tuple[int, int]]:
    """``(N, K)`` of the model's linear layers."""
    attention = model.num_heads * model.head_dim
    shapes = [
        ((model.num_heads + 2 * model.num_kv_heads) * model.head_dim, model.hidden),
        (model.hidden, attention),
    ]
    if model.intermediate:
        shapes += [(2 * model.intermediate, model.hidden), (model.hidden, model.intermediate)]
    return shapes


def _gemms(model: ModelShape, dtype: torch.dtype, target: KernelTarget) -> Iterator[Call]:
    from pagedinfer.adapters.kernels.fp8_gemm import fp8_gemm
    from pagedinfer.adapters.kernels.int4_gemm import int4_gemm
    from pagedinfer.adapters.kernels.skinny_gemm import skinny_gemm, skinny_gemm_wins
    from pagedinfer.adapters.quantization.fp8 import FP8_KERNEL_MIN_CAPABILITY

    major, minor = FP8_KERNEL_MIN_CAPABILITY
    fp8_runs = target.capability >= major * 10 + minor  # the engine's rule
    for n, k in _projections(model):
        for rows in (*DECODE_ROWS, PREFILL_ROWS):
            x = _empty(rows, k, dtype=dtype)
            if dtype != torch.float32 and skinny_gemm_wins(rows, n, k, target.num_sms):
                yield partial(skinny_gemm, x, _empty(n, k, dtype=dtype))
            for block in FP8_WEIGHT_BLOCKS if fp8_runs else ():
                block_n, block_k = block if block is not None else (1, k)
                yield partial(
                    fp8_gemm, x, _empty(n, k, dtype=torch.float8_e4m3fn),
                    _empty(-(-n // block_n), -(-k // block_k), dtype=torch.float32),
                    block_n=block_n, block_k=block_k,
                )  # fmt: skip
            groups = k // INT4_GROUP
            yield partial(
                int4_gemm, x, _empty(k // 8, n, dtype=torch.int32),
                _empty(groups, n, dtype=torch.uint8), _empty(groups, n, dtype=torch.float32),
                _empty(k, dtype=torch.int32),
            )  # fmt: skip


def _moe(model: ModelShape, dtype: torch.dtype) -> Iterator[Call]:
    from pagedinfer.adapters.kernels.moe import fused_moe

    experts, inter = model.num_experts, model.moe_intermediate
    w13 = _empty(experts, 2 * inter, model.hidden, dtype=dtype)
    w2 = _empty(experts, model.hidden, inter, dtype=dtype)
    for tokens in (*DECODE_ROWS, PREFILL_ROWS):
        yield partial(
            fused_moe, _empty(tokens, model.hidden, dtype=dtype), w13, w2,
            _empty(tokens, model.top_k, dtype=dtype),
            _empty(tokens, model.top_k, dtype=torch.int64),
        )  # fmt: skip


def _gpt_oss_moe(shape: GptOssExpertsShape, dtype: torch.dtype) -> Iterator[Call]:
    """With and without the down bias (tensor-parallel ranks but the first add none)."""
    from pagedinfer.adapters.kernels.moe import fused_gpt_oss_moe

    e, h, i = shape.num_experts, shape.hidden, shape.intermediate
    gate_up, gate_up_bias = _empty(e, h, 2 * i, dtype=dtype), _empty(e, 2 * i, dtype=dtype)
    down, down_bias = _empty(e, i, h, dtype=dtype), _empty(e, h, dtype=dtype)
    for tokens in (*DECODE_ROWS, PREFILL_ROWS):
        for bias in (down_bias, None):
            yield partial(
                fused_gpt_oss_moe, _empty(tokens, h, dtype=dtype), gate_up, gate_up_bias, down,
                bias, _empty(tokens, shape.top_k, dtype=dtype),
                _empty(tokens, shape.top_k, dtype=torch.int64), alpha=1.702, limit=7.0,
            )  # fmt: skip


def _sampling(model: ModelShape, dtype: torch.dtype) -> Iterator[Call]:
    from pagedinfer.adapters.kernels.exponential_noise import exponential_noise_
    from pagedinfer.adapters.kernels.race_sample import race_sample

    rows = 256
    table = _empty(rows, 4, dtype=torch.float32)  # a column of the sampling table
    seeds = _empty(rows, dtype=torch.int64)
    for logits_dtype in dict.fromkeys((dtype, torch.float32)):
        yield partial(
            race_sample, _empty(rows, model.vocab, dtype=logits_dtype), table[:, 1], seeds,
            seeds, step_key=1, greedy_epsilon=1e-5,
        )  # fmt: skip
    noise = _empty(rows, model.vocab, dtype=torch.float32)
    yield partial(exponential_noise_, noise, seeds, seeds, _empty(rows, dtype=torch.bool))
