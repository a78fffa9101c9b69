"""The Triton (and, when installed, flash) attention backends on a real GPU at model sizes.

Head dim 128, GQA 2 (16 query heads over 8 kv heads), 64 sequences with contexts up to a few
thousand tokens, pages of 16 and 256 tokens, bf16 and fp16, split-KV on and off; the oracle
is the torch backend run in float32 on the same pages. Also: decode captured in a CUDA graph
and replayed after its inputs are rewritten in place. Run with ``make test-gpu``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import pytest
import torch

from pagedinfer.adapters.attention.base import AttentionMetadata
from pagedinfer.adapters.attention.torch_ref import TorchAttentionBackend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128
SCALE = HEAD_DIM**-0.5
TOLERANCE = {
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
}


@dataclass
class Step:
    meta: AttentionMetadata
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor


def make_step(
    query_lens: list[int],
    context_lens: list[int],
    *,
    block_size: int,
    dtype: torch.dtype,
    table_width: int | None = None,
    seed: int = 0,
) -> Step:
    """A step over shuffled pages whose unused slots are NaN; every page a sequence owns
    holds random K/V (its "cached prefix"), and this step's K/V are stored by the backend."""
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(seed)
    num_seqs = len(context_lens)
    blocks = [-(-ctx // block_size) for ctx in context_lens]
    width = table_width or max(blocks)
    num_blocks = sum(blocks) + 4
    pool = torch.randperm(num_blocks, device=device, generator=generator)
    tables = torch.zeros(num_seqs, width, dtype=torch.int32, device=device)
    slots = []
    start = 0
    for index, (q_len, ctx) in enumerate(zip(query_lens, context_lens, strict=True)):
        tables[index, : blocks[index]] = pool[start : start + blocks[index]].int()
        start += blocks[index]
        positions = torch.arange(ctx - q_len, ctx, device=device)
        slots.append(
            tables[index, positions // block_size].long() * block_size + positions % block_size
        )

    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, device=device, generator=generator).to(dtype)

    k_cache, v_cache = randn(*shape), randn(*shape)
    # Poison the slots no sequence owns: reading them would turn outputs into NaN.
    owned = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)
    for index, ctx in enumerate(context_lens):
        positions = torch.arange(ctx, device=device)
        owned[
            tables[index, positions // block_size].long() * block_size + positions % block_size
        ] = True
    k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[~owned] = float("nan")
    v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[~owned] = float("nan")

    num_tokens = sum(query_lens)
    cu_q = [0]
    cu_k = [0]
    for q_len, ctx in zip(query_lens, context_lens, strict=True):
        cu_q.append(cu_q[-1] + q_len)
        cu_k.append(cu_k[-1] + ctx)
    meta = AttentionMetadata(
        is_prefill=max(query_lens) > 1 or num_tokens != num_seqs,
        block_size=block_size,
        slot_mapping=torch.cat(slots),
        cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=device),
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        block_tables=tables,
        max_seqlen_q=max(query_lens),
        max_seqlen_k=max(context_lens),
        has_cached_prefix=cu_k[-1] > cu_q[-1],
        query_lens_host=list(query_lens),
        context_lens_host=list(context_lens),
    )
    return Step(
        meta=meta,
        query=randn(num_tokens, NUM_HEADS, HEAD_DIM),
        key=randn(num_tokens, NUM_KV_HEADS, HEAD_DIM),
        value=randn(num_tokens, NUM_KV_HEADS, HEAD_DIM),
        k_cache=k_cache,
        v_cache=v_cache,
    )


def oracle(step: Step) -> torch.Tensor:
    """The torch backend in float32 on NaN-free copies of the pages."""
    k_cache = step.k_cache.float().nan_to_num(0.0)
    v_cache = step.v_cache.float().nan_to_num(0.0)
    return TorchAttentionBackend(step.meta.block_size).forward(
        step.query.float(),
        step.key.float(),
        step.value.float(),
        k_cache,
        v_cache,
        step.meta,
        SCALE,
    )


def contexts(num_seqs: int, longest: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest + 1, (num_seqs,), generator=generator).tolist()
    lengths[0] = longest
    return [int(length) for length in lengths]


DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("num_splits", [1, 8, None], ids=["no-split", "8-splits", "auto"])
def test_triton_decode_at_model_size(
    block_size: int, dtype: torch.dtype, num_splits: int | None
) -> None:
    from pagedinfer.adapters.attention.triton import TritonAttentionBackend

    context_lens = contexts(64, 3000, seed=block_size)
    step = make_step([1] * 64, context_lens, block_size=block_size, dtype=dtype)
    expected = oracle(step)
    backend = TritonAttentionBackend(block_size, num_splits=num_splits)

    out = backend.forward(
        step.query, step.key, step.value, step.k_cache, step.v_cache, step.meta, SCALE
    )

    torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("block_size", [16, 256])
def test_triton_decode_small_batch_long_context_splits(block_size: int, dtype: torch.dtype) -> None:
    from pagedinfer.adapters.attention.triton import TritonAttentionBackend

    step = make_step([1] * 3, [4000, 37, 1500], block_size=block_size, dtype=dtype)
    expected = oracle(step)
    outputs = []
    for num_splits in (1, None):  # None picks many partitions for 3 sequences on an H100
        backend = TritonAttentionBackend(block_size, num_splits=num_splits)
        outputs.append(
            backend.forward(
                step.query, step.key, step.value, step.k_cache, step.v_cache, step.meta, SCALE
            )
        )
    for out in outputs:
        torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("cached", [False, True], ids=["fresh", "prefix-cached"])
def test_triton_prefill_at_model_size(block_size: int, dtype: torch.dtype, cached: bool) -> None:
    from pagedinfer.adapters.attention.triton import TritonAttentionBackend

    generator = torch.Generator().manual_seed(1)
    query_lens = [int(n) for n in torch.randint(1, 300, (64,), generator=generator)]
    query_lens[0] = 700
    if cached:
        context_lens = [
            q + int(p)
            for q, p in zip(
                query_lens, torch.randint(0, 2500, (64,), generator=generator), strict=True
            )
        ]
    else:
        context_lens = list(query_lens)
    step = make_step(query_lens, context_lens, block_size=block_size, dtype=dtype)
    expected = oracle(step)
    backend = TritonAttentionBackend(block_size)

    out = backend.forward(
        step.query, step.key, step.value, step.k_cache, step.v_cache, step.meta, SCALE
    )

    torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("num_splits", [1, None], ids=["no-split", "auto"])
def test_triton_decode_replays_in_a_cuda_graph(num_splits: int | None) -> None:
    from pagedinfer.adapters.attention.triton import TritonAttentionBackend

    dtype, block_size, batch, width = torch.bfloat16, 16, 8, 256  # table covers 4096 tokens
    first = make_step(
        [1] * batch,
        contexts(batch, 2000, seed=3),
        block_size=block_size,
        dtype=dtype,
        table_width=width,
    )
    second = make_step(
        [1] * batch,
        contexts(batch, 3500, seed=4),
        block_size=block_size,
        dtype=dtype,
        table_width=width,
        seed=1,
    )
    # One set of static buffers (the graph's inputs), sized for the larger cache.
    num_blocks = max(first.k_cache.shape[0], second.k_cache.shape[0])
    k_cache = torch.full(
        (num_blocks, *first.k_cache.shape[1:]), float("nan"), dtype=dtype, device="cuda"
    )
    v_cache = torch.full_like(k_cache, float("nan"))
    meta = first.meta
    static = [first.query.clone(), first.key.clone(), first.value.clone()]
    backend = TritonAttentionBackend(block_size, num_splits=num_splits)
    backend.reserve(batch, NUM_HEADS, HEAD_DIM, num_kv_heads=NUM_KV_HEADS)

    def load(step: Step) -> None:
        k_cache[: step.k_cache.shape[0]].copy_(step.k_cache)
        v_cache[: step.v_cache.shape[0]].copy_(step.v_cache)
        for buffer, source in zip(static, (step.query, step.key, step.value), strict=True):
            buffer.copy_(source)
        meta.context_lens.copy_(step.meta.context_lens)
        meta.block_tables.copy_(step.meta.block_tables)
        meta.slot_mapping.copy_(step.meta.slot_mapping)

    graph_meta = AttentionMetadata(
        is_prefill=False,
        block_size=block_size,
        slot_mapping=meta.slot_mapping,
        cu_seqlens_q=meta.cu_seqlens_q,
        cu_seqlens_k=meta.cu_seqlens_k,
        context_lens=meta.context_lens,
        block_tables=meta.block_tables,
        max_seqlen_q=1,
        max_seqlen_k=0,
        has_cached_prefix=True,
    )
    load(first)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up compiles the kernels outside the capture
        backend.forward(*static, k_cache, v_cache, graph_meta, SCALE)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(*static, k_cache, v_cache, graph_meta, SCALE)

    for step in (first, second):
        load(step)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), oracle(step), **TOLERANCE[dtype])


needs_flash = pytest.mark.skipif(
    importlib.util.find_spec("flash_attn") is None, reason="flash-attn is not installed"
)


@needs_flash
@pytest.mark.parametrize("cached", [False, True], ids=["fresh", "prefix-cached"])
def test_flash_prefill_matches_the_oracle(cached: bool) -> None:
    from pagedinfer.adapters.attention.flash import FlashAttentionBackend

    query_lens = [300, 17, 256, 1]
    context_lens = [q + (700 if cached else 0) for q in query_lens]
    step = make_step(query_lens, context_lens, block_size=256, dtype=torch.bfloat16)
    expected = oracle(step)

    out = FlashAttentionBackend(256).forward(
        step.query, step.key, step.value, step.k_cache, step.v_cache, step.meta, SCALE
    )

    torch.testing.assert_close(out.float(), expected, **TOLERANCE[torch.bfloat16])


@needs_flash
def test_flash_decode_matches_the_oracle() -> None:
    from pagedinfer.adapters.attention.flash import FlashAttentionBackend

    step = make_step([1] * 64, contexts(64, 3000, seed=5), block_size=256, dtype=torch.bfloat16)
    expected = oracle(step)

    out = FlashAttentionBackend(256).forward(
        step.query, step.key, step.value, step.k_cache, step.v_cache, step.meta, SCALE
    )

    torch.testing.assert_close(out.float(), expected, **TOLERANCE[torch.bfloat16])
