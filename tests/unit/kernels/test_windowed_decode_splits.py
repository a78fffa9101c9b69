"""Split-KV decode of sliding-window layers: partitions sized by the window, not the table.

A windowed row reads only its last ``window`` keys, so its split count is bounded by the
window's keys (and trimmed to partitions that hold keys), while a full layer's count is the
one it always was. Decode through the backend with those counts (an SM count of a real GPU
forced, so the interpreter splits too) matches a dense float64 reference for contexts
shorter than, equal to and much longer than the window, with sinks and a softcap, pages left
of the window poisoned with NaN, without growing the workspace reserved for graphs; and
with an FP8 cache and sinks against the torch backend.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from paged_batches import dense_reference, drop_pages_left_of_window, make_batch, tolerance

from pagedinfer.adapters.attention import triton as triton_backend
from pagedinfer.adapters.attention.torch_ref import TorchAttentionBackend
from pagedinfer.adapters.attention.triton import TritonAttentionBackend
from pagedinfer.adapters.kernels.decode_attention import (
    MAX_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    PROGRAMS_PER_SM,
    choose_num_splits,
    decode_block_n,
)

NUM_SMS = 132


def splits_before_windows(num_seqs: int, num_kv_heads: int, capacity: int, num_sms: int) -> int:
    """The full-attention rule, frozen: a full layer's count must not move."""
    programs = max(1, num_seqs * num_kv_heads)
    if programs >= num_sms:
        return 1
    wanted = -(-PROGRAMS_PER_SM * num_sms // programs)
    return max(1, min(wanted, max(1, capacity // MIN_TOKENS_PER_SPLIT), MAX_SPLITS))


def partitions_with_keys(num_keys: int, num_splits: int, block_n: int) -> int:
    """Partitions of the decode kernel that get keys when a row reads ``num_keys`` keys."""
    per_split = -(-num_keys // num_splits)
    split_len = -(-per_split // block_n) * block_n
    return sum(1 for p in range(num_splits) if p * split_len < num_keys)


class TestSplitCounts:
    @pytest.mark.parametrize("num_seqs", [1, 2, 5, 16, 64, 200])
    def test_full_layers_keep_their_split_count(self, num_seqs: int) -> None:
        for kv_heads in (1, 2, 8):
            for capacity in (16, 512, 4096, 131072):
                for head_dim in (64, 128, 256):
                    assert choose_num_splits(
                        num_seqs, kv_heads, capacity, NUM_SMS, head_dim=head_dim
                    ) == splits_before_windows(num_seqs, kv_heads, capacity, NUM_SMS)

    @pytest.mark.parametrize("window", [1, 100, 128, 511, 512, 1000, 1024, 4096, 5000])
    def test_windowed_layers_split_only_the_keys_their_window_reads(self, window: int) -> None:
        block_size = 16
        for num_seqs in (1, 3, 8, 200):
            for kv_heads in (1, 8):
                for capacity in (512, 8192, 131072):
                    for head_dim in (64, 256):
                        splits = choose_num_splits(
                            num_seqs, kv_heads, capacity, NUM_SMS,
                            window=window, head_dim=head_dim,
                        )  # fmt: skip
                        full = choose_num_splits(num_seqs, kv_heads, capacity, NUM_SMS)
                        keys = min(window, capacity)
                        pages = -(-(keys + block_size - 1) // block_size)
                        assert 1 <= splits <= min(full, max(1, keys // MIN_TOKENS_PER_SPLIT))
                        assert splits <= pages
                        # A row reading its whole window gives every partition work.
                        block_n = decode_block_n(head_dim)
                        assert partitions_with_keys(keys, splits, block_n) == splits

    def test_model_windows(self) -> None:
        # One sequence, 8 kv heads, an 8192-token table: a full layer takes 16 partitions.
        assert choose_num_splits(1, 8, 8192, NUM_SMS) == 16
        assert choose_num_splits(1, 8, 8192, NUM_SMS, window=128) == 1  # GPT-OSS
        assert choose_num_splits(1, 8, 8192, NUM_SMS, window=512) == 2  # Gemma 3 (1B)
        assert choose_num_splits(1, 8, 8192, NUM_SMS, window=1024) == 4  # Gemma 3
        assert choose_num_splits(1, 8, 8192, NUM_SMS, window=4096) == 16  # Mistral
        # Trimmed to partitions that hold keys: 15 x 320 keys would leave two empty.
        assert choose_num_splits(1, 1, 1 << 20, NUM_SMS, window=4000) == 13


@pytest.mark.parametrize(
    ("window", "sinks", "softcap", "dtype"),
    [
        (1024, False, None, torch.float32),
        (1000, True, 2.0, torch.float32),
        (600, True, None, torch.float16),
    ],
)
def test_windowed_decode_with_window_sized_splits_matches_the_dense_reference(
    window: int,
    sinks: bool,
    softcap: float | None,
    dtype: torch.dtype,
    device: torch.device,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    contexts = [300, window, 3000]  # shorter than, equal to and much longer than the window
    batch = make_batch(
        [1, 1, 1], contexts, block_size=16, num_heads=2, num_kv_heads=1, head_dim=16,
        dtype=dtype, is_prefill=False, device=device,
    )  # fmt: skip
    drop_pages_left_of_window(batch, window)
    if softcap is not None:
        batch.query.mul_(3.0)  # scores of a few units: the cap changes them a lot
    sink_logits = torch.tensor([0.5, -1.0]) if sinks else None

    monkeypatch.setattr(triton_backend, "_num_sms", lambda _device: NUM_SMS)
    chosen: list[int] = []
    real = triton_backend.paged_decode_attention

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        chosen.append(kwargs["num_splits"])
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "paged_decode_attention", recording)
    backend = TritonAttentionBackend(16)
    backend.reserve(4, num_heads=2, head_dim=16, device=device)
    reserved = backend._workspace
    out = backend.forward(
        batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta,
        batch.scale, window=window, softcap=softcap,
        sinks=None if sink_logits is None else sink_logits.to(device),
    )  # fmt: skip

    capacity = int(batch.meta.block_tables.shape[1]) * 16
    assert chosen == [choose_num_splits(3, 1, capacity, NUM_SMS, window=window, head_dim=16)]
    assert 1 < chosen[0] < choose_num_splits(3, 1, capacity, NUM_SMS)
    assert backend._workspace is reserved
    expected = dense_reference(batch, window=window, sinks=sink_logits, softcap=softcap)
    torch.testing.assert_close(out.double().cpu(), expected, **tolerance(dtype))


def test_windowed_decode_with_window_sized_splits_reads_an_fp8_cache(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    window = 600
    batch = make_batch(
        [1, 1], [window, 2000], block_size=16, num_heads=2, num_kv_heads=1, head_dim=16,
        is_prefill=False, device=device,
    )  # fmt: skip
    drop_pages_left_of_window(batch, window)
    k_cache = batch.k_cache.nan_to_num(0.0).to(torch.float8_e4m3fn)
    v_cache = batch.v_cache.nan_to_num(0.0).to(torch.float8_e4m3fn)
    scales = torch.tensor([0.5, 2.0, 0.5, 2.0], device=device)
    sinks = torch.tensor([0.5, -1.0], device=device)
    monkeypatch.setattr(triton_backend, "_num_sms", lambda _device: NUM_SMS)
    capacity = int(batch.meta.block_tables.shape[1]) * 16
    assert choose_num_splits(2, 1, capacity, NUM_SMS, window=window, head_dim=16) == 2
    outs = []
    for backend in (TritonAttentionBackend(16), TorchAttentionBackend(16)):
        out = backend.forward(
            batch.query, batch.key, batch.value, k_cache.clone(), v_cache.clone(), batch.meta,
            batch.scale, kv_scales=scales, window=window, sinks=sinks,
        )  # fmt: skip
        outs.append(out)
    torch.testing.assert_close(outs[0].cpu(), outs[1].cpu(), atol=2e-3, rtol=2e-3)
