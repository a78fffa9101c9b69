"""The split-KV decode kernel against a dense float64 reference and the torch backend."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from paged_batches import PagedBatch, dense_reference, make_batch, tolerance

from pagedinfer.adapters.kernels.decode_attention import (
    MAX_SPLITS,
    choose_num_splits,
    paged_decode_attention,
)
from pagedinfer.adapters.kernels.store_kv import store_kv_cache


@dataclass(frozen=True)
class Case:
    context_lens: list[int]
    block_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32


CASES = {
    "block16-mha": Case([1, 17, 40], 16, 4, 4, 32),
    # One long sequence next to very short ones: most of their partitions are empty.
    "block16-gqa4-fp16-ragged": Case([300, 3, 64], 16, 8, 2, 16, torch.float16),
    "block48-gqa8-dim40": Case([150, 1, 49], 48, 8, 1, 40),
    "block32-gqa2-dim64-fp16": Case([33, 100], 32, 4, 2, 64, torch.float16),
    "block256-gqa8-fp16": Case([600, 5, 257], 256, 16, 2, 32, torch.float16),
    "block128-gqa16": Case([129, 1], 128, 16, 1, 32),
    "block16-gqa2-dim128-fp16": Case([90, 20], 16, 4, 2, 128, torch.float16),
}


def build(case: Case, device: torch.device, *, table_width: int | None = None) -> PagedBatch:
    return make_batch(
        [1] * len(case.context_lens),
        case.context_lens,
        block_size=case.block_size,
        num_heads=case.num_heads,
        num_kv_heads=case.num_kv_heads,
        head_dim=case.head_dim,
        dtype=case.dtype,
        is_prefill=False,
        table_width=table_width,
        device=device,
    )


def run_kernel(batch: PagedBatch, num_splits: int, block_n: int | None = None) -> torch.Tensor:
    meta = batch.meta
    store_kv_cache(batch.key, batch.value, batch.k_cache, batch.v_cache, meta.slot_mapping)
    return paged_decode_attention(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        context_lens=meta.context_lens,
        block_tables=meta.block_tables,
        scale=batch.scale,
        num_splits=num_splits,
        block_n=block_n,
    )


@pytest.mark.parametrize("num_splits", [1, 3, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_decode_matches_dense_reference_and_torch_backend(
    name: str, num_splits: int, device: torch.device
) -> None:
    case = CASES[name]
    batch = build(case, device, table_width=40)  # wider than needed, like a captured graph
    expected = dense_reference(batch)
    oracle = batch.torch_backend_output()

    out = run_kernel(batch, num_splits)

    assert out.dtype == case.dtype and out.shape == batch.query.shape
    torch.testing.assert_close(out.double().cpu(), expected, **tolerance(case.dtype))
    torch.testing.assert_close(out, oracle, **tolerance(case.dtype))


@pytest.mark.parametrize("name", ["block16-gqa4-fp16-ragged", "block48-gqa8-dim40"])
def test_split_kv_on_and_off_agree(name: str, device: torch.device) -> None:
    case = CASES[name]
    unsplit = run_kernel(build(case, device), num_splits=1, block_n=16)
    for num_splits in (2, 5, MAX_SPLITS):
        split = run_kernel(build(case, device), num_splits=num_splits, block_n=16)
        # Only the summation order differs.
        torch.testing.assert_close(
            split, unsplit, atol=1e-3 if case.dtype == torch.float16 else 1e-6, rtol=1e-3
        )


def test_padding_rows_get_zeros_and_store_nothing(device: torch.device) -> None:
    # A captured batch padded to a bucket: a row with context 0, slot -1 and a filler table.
    case = CASES["block16-mha"]
    batch = build(case, device)
    meta = batch.meta
    meta.context_lens[1] = 0
    meta.slot_mapping[1] = -1
    meta.block_tables[1] = 0
    k_before = batch.k_cache.clone()

    for num_splits in (1, 4):
        out = run_kernel(batch, num_splits)

        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert torch.isfinite(out).all()
        written = ~torch.isnan(batch.k_cache) & torch.isnan(k_before)
        assert written.sum() == 2 * case.num_kv_heads * case.head_dim  # rows 0 and 2 only


def test_replay_after_rewriting_inputs_in_place(device: torch.device) -> None:
    # CUDA-graph replay in miniature: the same tensors, rewritten in place between launches
    # with one shape-derived configuration, must compute whatever batch they now describe.
    case = CASES["block16-gqa4-fp16-ragged"]
    batch = build(case, device, table_width=64)
    meta = batch.meta
    num_splits = choose_num_splits(3, case.num_kv_heads, 64 * case.block_size, num_sms=132)
    assert num_splits > 1
    store_kv_cache(batch.key, batch.value, batch.k_cache, batch.v_cache, meta.slot_mapping)

    def launch() -> torch.Tensor:
        return paged_decode_attention(
            batch.query,
            batch.k_cache,
            batch.v_cache,
            context_lens=meta.context_lens,
            block_tables=meta.block_tables,
            scale=batch.scale,
            num_splits=num_splits,
        )

    expected = dense_reference(batch)
    launch()
    # Reverse the batch order in place: rows, contexts and tables move together.
    order = torch.tensor([2, 1, 0], device=device)
    meta.context_lens.copy_(meta.context_lens[order].clone())
    meta.block_tables.copy_(meta.block_tables[order].clone())
    batch.query.copy_(batch.query[order].clone())
    out = launch()

    torch.testing.assert_close(out.double().cpu(), expected[order.cpu()], **tolerance(case.dtype))


class TestChooseNumSplits:
    def test_one_partition_when_the_batch_fills_the_gpu(self) -> None:
        assert choose_num_splits(64, 8, 4096, num_sms=132) == 1
        assert choose_num_splits(132, 1, 32768, num_sms=132) == 1

    def test_small_batches_with_long_tables_are_split_up_to_the_cap(self) -> None:
        assert choose_num_splits(1, 8, 4096, num_sms=132) == 16
        assert choose_num_splits(4, 8, 4096, num_sms=132) == 9
        assert choose_num_splits(1, 1, 1 << 20, num_sms=132) == MAX_SPLITS

    def test_short_tables_are_not_split_finer_than_the_minimum_partition(self) -> None:
        assert choose_num_splits(1, 8, 512, num_sms=132) == 2
        assert choose_num_splits(1, 8, 100, num_sms=132) == 1

    @pytest.mark.parametrize("num_seqs", [1, 2, 3, 7, 16, 17, 100, 512])
    def test_always_between_one_and_the_cap(self, num_seqs: int) -> None:
        for kv_heads in (1, 2, 8):
            for capacity in (16, 4096, 131072):
                splits = choose_num_splits(num_seqs, kv_heads, capacity, num_sms=132)
                assert 1 <= splits <= MAX_SPLITS


def _jit_option(kernel: object, name: str) -> list[str]:
    """A ``triton.jit`` option of a kernel, interpreted or compiled."""
    kwargs = getattr(kernel, "kwargs", None)  # InterpretedFunction keeps the jit kwargs
    value = kwargs.get(name) if isinstance(kwargs, dict) else getattr(kernel, name, None)
    names = getattr(kernel, "arg_names", [])
    return [names[v] if isinstance(v, int) else v for v in (value or [])]


def test_per_step_values_are_not_specialization_keys() -> None:
    """Triton compiles a variant per value class of int arguments (1, multiples of 16) and
    per pointer alignment: the split count and the table width change from step to step and
    must not be among them, or decode would compile mid-run."""
    from pagedinfer.adapters.kernels import decode_attention, prefill_attention

    assert {"num_splits", "stride_table_seq"} <= set(
        _jit_option(decode_attention._decode_kernel, "do_not_specialize")
    )
    assert "num_splits" in _jit_option(decode_attention._reduce_splits_kernel, "do_not_specialize")
    assert "stride_table_seq" in _jit_option(prefill_attention._prefill_kernel, "do_not_specialize")


@pytest.mark.parametrize("num_seqs", [1, 3, 7, 64])
@pytest.mark.parametrize("num_splits", [2, 3, 16])
def test_partials_start_aligned_whatever_the_batch(num_seqs: int, num_splits: int) -> None:
    from pagedinfer.adapters.kernels.decode_attention import SplitPartials, split_workspace_numel

    buffer = torch.empty(split_workspace_numel(num_seqs, 5, num_splits, 40))
    partials = SplitPartials.from_buffer(buffer, num_seqs, 5, num_splits, 40)
    base = buffer.data_ptr()
    for array in (partials.acc, partials.max, partials.sum):
        assert (array.data_ptr() - base) % 64 == 0
    assert partials.sum.data_ptr() + partials.sum.numel() * 4 <= base + buffer.numel() * 4
