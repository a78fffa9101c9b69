"""Per-request logits processing: allowed ids, logit_bias, min_tokens, penalties and min_p.

:class:`LogitsProcessors` keeps what each request needs in *row tables* on the device, one
row per request that uses any of these features (requests that use none cost nothing):

- ``scalars [rows, 4]``: presence, frequency and repetition penalty, min_p;
- ``bias [rows, vocab]``: ``logit_bias`` plus ``-inf`` outside ``allowed_token_ids``
  (allocated when the first request needs it);
- ``prompt_mask [rows, vocab]`` and ``output_counts [rows, vocab]`` for the penalties
  (allocated when the first request needs them); the counts grow by one scatter-add per step
  (:meth:`LogitsProcessors.record`), never rebuilt from token lists.

Tables start small and double when full; a finished request's row is reused. Per step the
host builds one :class:`ProcessingStep` (which logits rows use which table rows, plus the
EOS / stop tokens that ``min_tokens`` still holds back); everything else is batched tensor
work over those rows, no per-row loop over the vocabulary. The order is vLLM v1's: bias and
masks, then penalties (:meth:`LogitsProcessors.apply`), then, on temperature-scaled logits,
min_p (:meth:`LogitsProcessors.apply_min_p`) before top-k / top-p.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from pagedinfer.adapters.host_transfers import HostUploads
from pagedinfer.adapters.sampling.penalties import apply_penalties
from pagedinfer.adapters.sampling.table import InstalledRequest
from pagedinfer.domain.sampling import SamplingParams

__all__ = ["LogitsProcessors", "ProcessingStep"]

_PRESENCE, _FREQUENCY, _REPETITION, _MIN_P = range(4)


@dataclass(frozen=True, slots=True)
class ProcessingStep:
    """Which logits rows of one step are processed, and with which table rows.

    ``batch_rows`` is ``None`` when every row of the logits is processed, in order.
    ``held_back`` holds (index into the processed rows, token id) pairs masked to ``-inf``
    because the request has fewer than ``min_tokens`` tokens.
    """

    batch_rows: torch.Tensor | None  # [m] int64 rows of the step's logits
    table_rows: torch.Tensor  # [m] int64 rows of the tables
    held_back: tuple[torch.Tensor, torch.Tensor] | None
    any_bias: bool
    any_penalties: bool
    any_min_p: bool
    # (index into the processed rows, token id): tokens the penalties count as generated
    # before that row on top of its request's history (a verify row's earlier drafts).
    extra_history: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(frozen=True, slots=True)
class _Row:
    """What the host needs to know about one table row to plan a step."""

    row: int
    bias: bool
    penalties: bool
    min_p: bool
    min_tokens: int
    held_back_ids: tuple[int, ...]  # EOS (unless ignore_eos) and stop_token_ids
    num_prompt_tokens: int


class LogitsProcessors:
    """Device state and batched ops for the per-request logits processing of one sampler.

    Requests are keyed by an integer (the executor's slot for the request). Call :meth:`add`
    (or :meth:`install`, the sampling table's callback) when a request arrives, :meth:`remove`
    when it leaves, :meth:`plan` once per step with the keys of the sampled rows, then
    :meth:`apply`, :meth:`apply_min_p` and :meth:`record`.
    """

    def __init__(
        self,
        vocab_size: int,
        device: torch.device,
        eos_token_ids: Iterable[int] = (),
        *,
        initial_rows: int = 8,
    ) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))
        self._capacity = initial_rows
        self._free_rows = list(range(initial_rows - 1, -1, -1))  # pop() hands out row 0 first
        self._rows: dict[int, _Row] = {}
        self._scalars = torch.zeros(initial_rows, 4, dtype=torch.float32, device=device)
        # Host lists reach the device through pinned memory, never by a blocking copy: plan()
        # and install() run in a step's launch (which may be planned ahead, async scheduling).
        self._uploads = HostUploads(device)
        self._bias: torch.Tensor | None = None
        self._prompt_mask: torch.Tensor | None = None
        self._output_counts: torch.Tensor | None = None

    def __len__(self) -> int:
        """The number of requests that use some processing now."""
        return len(self._rows)

    @property
    def capacity(self) -> int:
        return self._capacity

    # ---------------------------------------------------------------- requests
    def install(self, request: InstalledRequest) -> None:
        """The sampling table's install callback: a request new to the executor."""
        self.remove(request.slot)
        self.add(
            request.slot,
            request.params,
            request.prompt_token_ids,
            num_prompt_tokens=request.num_prompt_tokens,
        )

    def add(
        self,
        key: int,
        params: SamplingParams,
        prompt_token_ids: Sequence[int] = (),
        output_token_ids: Sequence[int] = (),
        *,
        num_prompt_tokens: int | None = None,
    ) -> bool:
        """Register a request; False (and nothing stored) when it needs no processing.

        ``prompt_token_ids`` (needed for the repetition penalty) and ``output_token_ids``
        seed the penalties' history. ``num_prompt_tokens`` (default: the prompt's length)
        turns a sample's position into the number of tokens generated before it.
        """
        assert key not in self._rows, key
        if not params.uses_logits_processing:
            return False
        max_id = params.max_token_id()
        assert max_id is None or max_id < self.vocab_size, (max_id, self.vocab_size)
        held: tuple[int, ...] = ()
        if params.min_tokens > 0:
            eos = () if params.ignore_eos else self.eos_token_ids
            held = tuple(sorted({*params.stop_token_ids, *eos}))
        info = _Row(
            row=-1,
            bias=bool(params.logit_bias) or params.allowed_token_ids is not None,
            penalties=params.uses_penalties,
            min_p=params.min_p > 0.0,
            min_tokens=params.min_tokens if held else 0,
            held_back_ids=held,
            num_prompt_tokens=len(prompt_token_ids)
            if num_prompt_tokens is None
            else num_prompt_tokens,
        )
        if not (info.bias or info.penalties or info.min_p or info.min_tokens):
            return False  # e.g. min_tokens with no EOS and no stop token to hold back
        row = self._allocate_row()
        info = replace(info, row=row)
        self._scalars[row].copy_(
            self._uploads.upload(
                [
                    params.presence_penalty,
                    params.frequency_penalty,
                    params.repetition_penalty,
                    params.min_p,
                ],
                torch.float32,
            )
        )
        if info.bias:
            self._write_bias(row, params)
        elif self._bias is not None:
            self._bias[row].zero_()
        if info.penalties:
            self._write_history(row, prompt_token_ids, output_token_ids)
        elif self._prompt_mask is not None and self._output_counts is not None:
            self._prompt_mask[row].zero_()
            self._output_counts[row].zero_()
        self._rows[key] = info
        return True

    def remove(self, key: int) -> None:
        """Forget a request (unknown keys are ignored); its row is reused later."""
        info = self._rows.pop(key, None)
        if info is not None:
            self._free_rows.append(info.row)

    # -------------------------------------------------------------------- steps
    def plan(
        self,
        keys: Sequence[int],
        sample_position: Callable[[int], int],
        extra_history: Mapping[int, Sequence[int]] | None = None,
    ) -> ProcessingStep | None:
        """The processing of one step whose logits row ``i`` belongs to request ``keys[i]``.

        ``sample_position(i)`` is the position of row ``i``'s token (asked only for rows
        whose ``min_tokens`` may still hold tokens back: the tokens generated before it are
        ``position + 1 - num_prompt_tokens``). ``extra_history[i]`` are tokens generated
        before row ``i``'s that its request's recorded history does not hold yet (a verify
        row's drafts: speculative decoding). ``None`` when no row needs processing: the
        sampler then runs exactly as without this class.
        """
        if not self._rows:
            return None
        rows = self._rows
        batch_rows: list[int] = []
        table_rows: list[int] = []
        held_at: list[int] = []
        held_ids: list[int] = []
        extra_at: list[int] = []
        extra_ids: list[int] = []
        any_bias = any_penalties = any_min_p = False
        for index, key in enumerate(keys):
            info = rows.get(key)
            if info is None:
                continue
            if (
                info.min_tokens
                and sample_position(index) + 1 - info.num_prompt_tokens < info.min_tokens
            ):
                position = len(batch_rows)
                held_at.extend([position] * len(info.held_back_ids))
                held_ids.extend(info.held_back_ids)
            if info.penalties and extra_history is not None and index in extra_history:
                earlier = extra_history[index]
                extra_at.extend([len(batch_rows)] * len(earlier))
                extra_ids.extend(earlier)
            batch_rows.append(index)
            table_rows.append(info.row)
            any_bias = any_bias or info.bias
            any_penalties = any_penalties or info.penalties
            any_min_p = any_min_p or info.min_p
        if not batch_rows:
            return None
        every_row = len(batch_rows) == len(keys)  # then batch_rows == range(len(keys))
        upload = self._uploads.upload
        indices = upload(table_rows if every_row else table_rows + batch_rows, torch.int64)
        indices = indices.view(1 if every_row else 2, len(table_rows))
        held = None
        if held_at:
            pairs = upload(held_at + held_ids, torch.int64).view(2, len(held_at))
            held = (pairs[0], pairs[1])
        extra = None
        if extra_at:
            pairs = upload(extra_at + extra_ids, torch.int64).view(2, len(extra_at))
            extra = (pairs[0], pairs[1])
        return ProcessingStep(
            batch_rows=None if every_row else indices[1],
            table_rows=indices[0],
            held_back=held,
            any_bias=any_bias,
            any_penalties=any_penalties,
            any_min_p=any_min_p,
            extra_history=extra,
        )

    def apply(self, logits: torch.Tensor, step: ProcessingStep) -> None:
        """Bias, masks and penalties, in place on float32 ``logits [n, vocab]``."""
        rows = logits if step.batch_rows is None else logits.index_select(0, step.batch_rows)
        if step.any_bias:
            assert self._bias is not None
            rows.add_(self._bias.index_select(0, step.table_rows))
        if step.held_back is not None:
            rows.index_put_(step.held_back, rows.new_full((), -math.inf))
        if step.any_penalties:
            assert self._prompt_mask is not None and self._output_counts is not None
            scalars = self._scalars.index_select(0, step.table_rows)
            counts = self._output_counts.index_select(0, step.table_rows)  # a copy
            if step.extra_history is not None:
                ones = torch.ones(
                    step.extra_history[0].shape, dtype=counts.dtype, device=counts.device
                )
                counts.index_put_(step.extra_history, ones, accumulate=True)
            apply_penalties(
                rows,
                prompt_mask=self._prompt_mask.index_select(0, step.table_rows),
                output_counts=counts,
                presence_penalties=scalars[:, _PRESENCE],
                frequency_penalties=scalars[:, _FREQUENCY],
                repetition_penalties=scalars[:, _REPETITION],
            )
        if step.batch_rows is not None:
            logits.index_copy_(0, step.batch_rows, rows)

    def apply_min_p(self, logits: torch.Tensor, step: ProcessingStep) -> None:
        """Drop tokens below ``min_p`` × the top token's probability, in place.

        ``logits`` are temperature-scaled. In log space ``p_i < min_p * p_max`` is
        ``l_i < l_max + log(min_p)``, so no softmax is needed; ``min_p = 0`` masks nothing
        and the top token always survives.
        """
        if not step.any_min_p:
            return
        rows = logits if step.batch_rows is None else logits.index_select(0, step.batch_rows)
        log_min_p = self._scalars.index_select(0, step.table_rows)[:, _MIN_P].log()
        threshold = rows.amax(dim=-1, keepdim=True) + log_min_p.unsqueeze(1)
        rows.masked_fill_(rows < threshold, -math.inf)
        if step.batch_rows is not None:
            logits.index_copy_(0, step.batch_rows, rows)

    def record(
        self,
        step: ProcessingStep,
        sampled: torch.Tensor,
        kept: torch.Tensor | None = None,
        *,
        undo: bool = False,
    ) -> None:
        """Count this step's sampled tokens ``[n]`` in the penalties' history; with ``kept``
        (``[n]`` bool, speculative decoding) only those it marks. ``undo`` takes a recorded
        step's tokens out again (a step whose tokens were never recorded by the scheduler:
        it runs again)."""
        if not step.any_penalties:
            return
        assert self._output_counts is not None
        tokens = sampled if step.batch_rows is None else sampled.index_select(0, step.batch_rows)
        dtype = self._output_counts.dtype
        if kept is None:
            ones = torch.ones(tokens.shape, dtype=dtype, device=tokens.device)
        else:
            ones = (kept if step.batch_rows is None else kept.index_select(0, step.batch_rows)).to(
                dtype
            )
        if undo:
            ones = -ones
        self._output_counts.index_put_((step.table_rows, tokens), ones, accumulate=True)

    # --------------------------------------------------------------- internals
    def _allocate_row(self) -> int:
        if not self._free_rows:
            self._grow()
        return self._free_rows.pop()

    def _grow(self) -> None:
        old = self._capacity
        new = old * 2

        def grown(table: torch.Tensor) -> torch.Tensor:
            extra = torch.zeros(
                (new - old, *table.shape[1:]), dtype=table.dtype, device=self.device
            )
            return torch.cat([table, extra])

        self._scalars = grown(self._scalars)
        if self._bias is not None:
            self._bias = grown(self._bias)
        if self._prompt_mask is not None and self._output_counts is not None:
            self._prompt_mask = grown(self._prompt_mask)
            self._output_counts = grown(self._output_counts)
        self._capacity = new
        self._free_rows.extend(range(new - 1, old - 1, -1))

    def _table(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(self._capacity, self.vocab_size, dtype=dtype, device=self.device)

    def _write_bias(self, row: int, params: SamplingParams) -> None:
        if self._bias is None:
            self._bias = self._table(torch.float32)
        bias = self._bias[row]
        upload = self._uploads.upload
        if params.allowed_token_ids is not None:
            allowed = upload(list(params.allowed_token_ids), torch.int64)
            bias.fill_(-math.inf).index_fill_(0, allowed, 0.0)
        else:
            bias.zero_()
        if params.logit_bias:
            ids = upload(list(params.logit_bias), torch.int64)
            bias.index_add_(0, ids, upload(list(params.logit_bias.values()), torch.float32))

    def _write_history(
        self, row: int, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]
    ) -> None:
        if self._prompt_mask is None or self._output_counts is None:
            self._prompt_mask = self._table(torch.bool)
            self._output_counts = self._table(torch.float32)
        mask = self._prompt_mask[row]
        mask.zero_()
        if prompt_token_ids:
            mask.index_fill_(0, self._uploads.upload(list(prompt_token_ids), torch.int64), True)
        counts = self._output_counts[row]
        counts.zero_()
        if output_token_ids:
            tokens = self._uploads.upload(list(output_token_ids), torch.int64)
            counts.index_add_(0, tokens, torch.ones(tokens.shape, device=self.device))
