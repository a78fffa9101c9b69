"""One request as the scheduler sees it: its tokens, its progress and its KV blocks."""

from __future__ import annotations

import enum
from collections.abc import Sequence as SequenceABC

from pagedinfer.domain.lora import LoRARequest, adapter_extra_key
from pagedinfer.domain.sampling import SamplingParams

__all__ = ["FinishReason", "Sequence", "SequenceStatus"]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # aborted by the caller
    # The request's own input failed it while running: its structured-output constraint hit
    # a limit or reached a dead end, or its logits held no finite allowed value (NaN).
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


class Sequence:
    """A request's token history and cache bookkeeping.

    ``token_ids`` holds the prompt followed by the completion. ``num_computed_tokens`` counts
    the leading tokens whose K/V are in the cache; the scheduler computes the rest, in chunks
    if the prompt is long, and a decode step computes exactly the last token.
    ``num_cached_tokens`` counts the prompt tokens served by the prefix cache when the request
    was first admitted; a preempted request recomputes (or re-finds) its own tokens later, which
    does not change it. ``num_preemptions`` counts how often the request was preempted.
    ``block_table[i]`` is the physical block holding logical block ``i``; with several KV
    groups (hybrid attention) that is group 0's table, and ``group_block_tables`` holds the
    others' (same length; a sliding group's entries out of its window are the null block).
    ``block_hashes`` caches the chained hashes of the full blocks of ``token_ids``; they depend
    only on the tokens, so they survive preemption.

    ``decoding`` is True while the scheduler runs the sequence one token per step (every token
    but the last is computed): ``num_computed_tokens`` is then ``len(token_ids) - 1``, derived
    instead of being counted every step. :meth:`start_decoding` and :meth:`stop_decoding`
    enter and leave that mode (leaving it stores the derived count); ``num_computed_tokens``
    is assigned only outside it. ``slot`` is the request's row in the executor's sampling table
    (see :mod:`pagedinfer.domain.plan`), ``-1`` while it has none. ``spec_token_ids`` are
    speculative decoding's drafts for the tokens after ``token_ids`` (not part of them).

    From :meth:`Scheduler.add` until it finishes, a sequence belongs to the scheduler: read
    any field, assign none (``status``, ``finish_reason``, ``token_ids``, ``block_table``,
    ``slot``, the counts); use :meth:`Scheduler.finish` / :meth:`Scheduler.abort` to end it.
    Building one by hand (tests, :func:`~pagedinfer.domain.plan.build_batch_plan`) may set
    them.
    """

    __slots__ = (
        "_num_computed_tokens",
        "block_hashes",
        "block_table",
        "decoding",
        "extra_key",
        "finish_reason",
        "group_block_tables",
        "lora",
        "num_cached_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "num_registered_blocks",
        "params",
        "seq_id",
        "slot",
        "spec_token_ids",
        "status",
        "token_ids",
    )

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: SequenceABC[int],
        params: SamplingParams | None = None,
        *,
        extra_key: int | None = None,
        lora: LoRARequest | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params if params is not None else SamplingParams()
        # The LoRA adapter it runs with (None: the base model); it keys its prefix cache.
        self.lora = lora
        self.extra_key = adapter_extra_key(extra_key, lora)
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_cached_tokens = 0
        self._num_computed_tokens = 0
        self.decoding = False
        self.slot = -1
        self.num_preemptions = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        # The tables of KV groups 1, 2, ... (hybrid attention, pagedinfer.domain.kv_groups);
        # block_table is group 0's. Empty with one group (every model without a window).
        self.group_block_tables: list[list[int]] = []
        # How many leading entries of block_table the prefix cache already knows about.
        self.num_registered_blocks = 0
        # Speculative decoding: the proposer's guesses of the next tokens (drafts), verified
        # by the next step that computes this sequence's last token; never in token_ids.
        self.spec_token_ids: list[int] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, status={self.status.value}, tokens={len(self.token_ids)}"
            f", computed={self.num_computed_tokens}, blocks={self.block_table})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_computed_tokens(self) -> int:
        if self.decoding:
            return len(self.token_ids) - 1
        return self._num_computed_tokens

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        assert not self.decoding, "a decoding sequence's count follows its tokens"
        self._num_computed_tokens = value

    def start_decoding(self) -> None:
        """From now on one token per step: every token but the last counts as computed."""
        self.decoding = True

    def stop_decoding(self) -> None:
        """Back to an explicit count of computed tokens (the one decoding implied)."""
        if self.decoding:
            self._num_computed_tokens = len(self.token_ids) - 1
            self.decoding = False

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def block_token_ids(self, index: int, block_size: int) -> list[int]:
        start = index * block_size
        return self.token_ids[start : start + block_size]
