"""The completions of a request with ``SamplingParams.n > 1``, made the way ``Engine`` makes them.

A request with ``n`` completions is ``n`` sequences: the first prefills the prompt, the others
(its *forks*) are queued with it, ``scheduler.add(first, forks=make_forks(first))``, and draw
their first token from the first one's last prompt row (see :class:`Scheduler`). Completion
``i`` (0-based; the first is 0) is seeded :func:`completion_seed` ``(seed, i)``, vLLM's rule,
so that it equals a request of its own with ``SamplingParams(seed=seed + i)``.
"""

from __future__ import annotations

import dataclasses

from pagedinfer.domain.sampling import MAX_SEED
from pagedinfer.domain.sequence import Sequence

__all__ = ["completion_seed", "make_forks"]


def completion_seed(seed: int | None, index: int) -> int | None:
    """The seed of completion ``index`` of a request seeded ``seed`` (``n > 1``): ``seed +
    index``, wrapping within ``0 ... MAX_SEED`` (vLLM's rule); ``None`` stays ``None``."""
    return None if seed is None else (seed + index) & MAX_SEED


def make_forks(seq: Sequence, *, first_id: int | None = None) -> list[Sequence]:
    """The other ``seq.params.n - 1`` completions of ``seq``'s request, for
    :meth:`Scheduler.add` ``(seq, forks=...)``: fresh sequences with ``seq``'s prompt,
    ``extra_key`` and LoRA adapter, ids ``first_id, first_id + 1, ...`` (default:
    ``seq.seq_id + 1`` on, as the engine numbers them; the ids must be unused), and
    ``seq.params`` with the seed of their completion index (:func:`completion_seed`;
    unseeded requests stay unseeded).
    ``[]`` when ``n == 1``. ``seq`` must be fresh (nothing generated yet)."""
    params = seq.params
    start = seq.seq_id + 1 if first_id is None else first_id
    prompt = seq.prompt_token_ids
    forks = []
    for index in range(1, params.n):
        child = params
        if params.seed is not None:
            child = dataclasses.replace(params, seed=completion_seed(params.seed, index))
        fork = Sequence(start + index - 1, prompt, child, extra_key=seq.extra_key)
        fork.lora = seq.lora  # extra_key has the adapter in it already
        forks.append(fork)
    return forks
