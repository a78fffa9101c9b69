"""The engine's table of unfinished requests: by request id, and their completions by
sequence id.

Admission adds a request (:meth:`RequestTable.add`); output processing forgets it once its
final output was handed over (:meth:`RequestTable.forget`). The table also keeps the counts
the step loops ask for each step: how many requests need every step's news
(``num_following``; while there are none a step's bookkeeping looks only at what finished),
which requests have structured outputs (no step is planned ahead of their tokens), and how
many requests finished so far.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedinfer.domain.plan import BatchPlan
from pagedinfer.engine.requests import CompletionState, RequestState

__all__ = ["RequestTable"]


class RequestTable:
    """Unfinished requests and their completions. Not thread-safe (the engine's lock)."""

    __slots__ = ("completions", "num_finished", "num_following", "requests", "structured")

    def __init__(self) -> None:
        self.requests: dict[int, RequestState] = {}  # unfinished requests by id
        self.completions: dict[int, CompletionState] = {}  # their sequences, by sequence id
        # Unfinished requests that need every step's news (RequestState.follows_steps).
        self.num_following = 0
        self.structured: set[int] = set()  # unfinished requests with structured outputs
        self.num_finished = 0

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, request: RequestState, *, structured: bool) -> None:
        """Register a request whose completions are all in ``request.completions``."""
        assert request.request_id not in self.requests, request
        for completion in request.completions:
            self.completions[completion.seq.seq_id] = completion
        self.requests[request.request_id] = request
        if structured:
            self.structured.add(request.request_id)
        if request.follows_steps:
            self.num_following += 1

    def forget(self, request: RequestState) -> bool:
        """Drop a finalized request (counted as finished); False if it was not here."""
        if self.requests.pop(request.request_id, None) is None:
            return False
        for completion in request.completions:
            del self.completions[completion.seq.seq_id]
        self.num_finished += 1
        self.structured.discard(request.request_id)
        if request.follows_steps:
            self.num_following -= 1
        return True

    def unfinished_in(self, plans: Iterable[BatchPlan]) -> list[RequestState]:
        """The requests with a row or a sample in ``plans`` and no final output yet, in the
        order of their first row."""
        found: dict[int, RequestState] = {}
        completions = self.completions
        for plan in plans:
            for seq_id in (*plan.seq_ids, *plan.sampled_seq_ids):
                completion = completions.get(seq_id)
                if completion is not None and completion.request.final is None:
                    found.setdefault(completion.request.request_id, completion.request)
        return list(found.values())
