"""The triton and flash backends: block-size refusal, and the triton backend against the torch
oracle over real scheduler plans (prefix-cache hits, chunked prefill, decode)."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from paged_batches import dense_reference, make_batch, tolerance

from pagedinfer.adapters.attention.flash import FlashAttentionBackend
from pagedinfer.adapters.attention.torch_ref import TorchAttentionBackend
from pagedinfer.adapters.attention.triton import TritonAttentionBackend
from pagedinfer.adapters.step_inputs import plan_metadata
from pagedinfer.domain import SamplingParams, Scheduler, SchedulerConfig, Sequence
from pagedinfer.errors import ConfigurationError


class TestBlockSizeRules:
    @pytest.mark.parametrize("block_size", [0, 8, 24, 100])
    def test_triton_refuses_block_sizes_that_are_not_multiples_of_16(self, block_size: int) -> None:
        with pytest.raises(ConfigurationError, match=rf"kv_block_size={block_size}\b.*16"):
            TritonAttentionBackend(block_size)

    @pytest.mark.parametrize("block_size", [16, 48, 256])
    def test_triton_accepts_multiples_of_16(self, block_size: int) -> None:
        backend = TritonAttentionBackend(block_size)
        assert backend.name == "triton" and backend.supports_cuda_graphs

    @pytest.mark.parametrize("num_splits", [0, 17])
    def test_triton_refuses_a_fixed_split_count_out_of_range(self, num_splits: int) -> None:
        with pytest.raises(ConfigurationError, match=f"num_splits={num_splits}"):
            TritonAttentionBackend(16, num_splits=num_splits)

    @pytest.mark.parametrize("block_size", [16, 128, 384])
    def test_flash_refuses_block_sizes_that_are_not_multiples_of_256(self, block_size: int) -> None:
        # Checked before flash-attn is imported, so this runs without it.
        with pytest.raises(ConfigurationError, match=rf"kv_block_size={block_size}\b.*256"):
            FlashAttentionBackend(block_size)

    def test_flash_without_the_package_says_how_to_install_it(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setitem(sys.modules, "flash_attn", None)  # makes the import fail
        with pytest.raises(
            ConfigurationError, match=r"pip install '\.\[flash\]' in the pagedinfer checkout"
        ):
            FlashAttentionBackend(256)


def test_decode_reads_no_host_values(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    # The CUDA-graph contract: no *_host lists, stale host maxima, and any device-to-host
    # read (item / tolist / truth value) fails the test.
    batch = make_batch(
        [1, 1, 1],
        [70, 2, 33],
        block_size=16,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        is_prefill=False,
        table_width=32,
        device=device,
    )
    meta = dataclasses.replace(
        batch.meta, max_seqlen_q=0, max_seqlen_k=0, query_lens_host=None, context_lens_host=None
    )
    backend = TritonAttentionBackend(16)
    backend.reserve(8, num_heads=4, head_dim=32, device=device)

    def forbidden(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the decode path read a device value on the host")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    out = backend.forward(
        batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, meta, batch.scale
    )
    monkeypatch.undo()

    torch.testing.assert_close(out.double().cpu(), dense_reference(batch), **tolerance(out.dtype))


def test_reserved_workspace_is_reused_not_reallocated(device: torch.device) -> None:
    backend = TritonAttentionBackend(16, num_splits=4)
    backend.reserve(4, num_heads=4, head_dim=32, device=device)
    reserved = backend._workspace
    assert reserved is not None
    for num_seqs in (1, 3, 4):
        batch = make_batch(
            [1] * num_seqs,
            [40 + 9 * i for i in range(num_seqs)],
            block_size=16,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
            is_prefill=False,
            device=device,
        )
        out = backend.forward(
            batch.query,
            batch.key,
            batch.value,
            batch.k_cache,
            batch.v_cache,
            batch.meta,
            batch.scale,
        )

        assert backend._workspace is reserved
        torch.testing.assert_close(
            out.double().cpu(), dense_reference(batch), **tolerance(out.dtype)
        )


@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_triton_backend_follows_the_torch_oracle_through_scheduler_plans(
    num_splits: int | None, device: torch.device
) -> None:
    """Drive the real scheduler: a long prompt chunked over several steps, a second prompt
    that hits the first one's cached blocks, then decode steps; every step's plan goes
    through ``plan_metadata`` (the runner's packer) into both backends, on separate caches."""
    block_size, num_heads, num_kv_heads, head_dim = 16, 4, 2, 32
    config = SchedulerConfig(
        num_blocks=24, block_size=block_size, max_num_batched_tokens=48, max_model_len=128
    )
    scheduler = Scheduler(config)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    shared = list(range(1, 41))
    scheduler.add(Sequence(0, [*shared, *range(100, 130)], params))  # 70 tokens: chunked
    later = [Sequence(1, [*shared, 7, 8, 9], params), Sequence(2, list(range(60, 75)), params)]

    shape = (config.num_blocks, block_size, num_kv_heads, head_dim)
    triton_caches = (torch.zeros(shape, device=device), torch.zeros(shape, device=device))
    torch_caches = (torch.zeros(shape, device=device), torch.zeros(shape, device=device))
    triton_backend = TritonAttentionBackend(block_size, num_splits=num_splits)
    torch_backend = TorchAttentionBackend(block_size)
    generator = torch.Generator().manual_seed(0)
    kinds = []
    for step in range(12):
        plan = scheduler.schedule()
        if plan is None:
            break
        kinds.append(
            "decode" if not plan.is_prefill else "prefix" if plan.has_cached_prefix else "fresh"
        )
        meta = plan_metadata(plan, device)
        query, key, value = (
            torch.randn(plan.num_tokens, heads, head_dim, generator=generator).to(device)
            for heads in (num_heads, num_kv_heads, num_kv_heads)
        )
        ours = triton_backend.forward(query, key, value, *triton_caches, meta, 0.17)
        expected = torch_backend.forward(query, key, value, *torch_caches, meta, 0.17)

        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4, msg=f"step {step}")
        assert torch.equal(triton_caches[0], torch_caches[0])
        assert torch.equal(triton_caches[1], torch_caches[1])
        scheduler.postprocess(plan, [step] * plan.num_samples)
        if step == 0:
            for seq in later:
                scheduler.add(seq)
    assert {"fresh", "prefix", "decode"} <= set(kinds), kinds
    assert later[0].num_cached_tokens > 0  # the second prompt really hit the prefix cache


def test_a_grown_workspace_keeps_every_earlier_one_alive(device: torch.device) -> None:
    """A captured graph writes to the workspace address it was captured with, on every replay:
    growing the workspace later (an eager batch that needs more partitions) must not free the
    old one, or the allocator could hand its memory to something else the graph then
    overwrites."""
    import weakref

    backend = TritonAttentionBackend(16, num_splits=4)
    backend.reserve(2, num_heads=4, head_dim=32, device=device)
    first = backend._workspace
    assert first is not None
    alive = weakref.ref(first)
    del first
    grown = backend._workspace_of(10 * alive().numel(), device)  # type: ignore[union-attr]
    assert grown is backend._workspace and grown.numel() >= 10 * 4 * 2 * 4
    assert alive() is not None, "the reserved workspace was dropped"
    assert backend._workspace_of(1, device) is grown  # never shrinks
