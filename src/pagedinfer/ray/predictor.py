"""``EnginePredictor``: one Engine per Ray Data actor, run on every batch that actor receives."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.errors import InvalidSamplingParamsError
from pagedinfer.ray.columns import batch_prompts, output_columns, with_columns

if TYPE_CHECKING:
    from pagedinfer.engine.engine import Engine

__all__ = ["EnginePredictor", "as_sampling_params"]

_SAMPLING_FIELDS = tuple(field.name for field in dataclasses.fields(SamplingParams))


class EnginePredictor:
    """A callable class for ``ray.data.Dataset.map_batches``: one ``Engine`` per actor.

    ::

        ds.map_batches(
            EnginePredictor,
            fn_constructor_kwargs={"model": DIR, "sampling_params": {"max_tokens": 128},
                                   "engine_kwargs": {"tensor_parallel_size": 2}},
            compute=ray.data.ActorPoolStrategy(size=N),  # or concurrency=N
            batch_size=256,
            num_gpus=2,  # per actor: its tensor_parallel_size
        )

    Ray builds the class once per actor (the engine loads the model then) and calls it on
    every batch. A batch needs a ``prompt`` column (text or a list of token ids) or a
    ``messages`` column (chat messages, rendered by the tokenizer's chat template); every
    input column is kept and ``generated_text``, ``generated_token_ids``, ``finish_reason``,
    ``num_prompt_tokens`` and ``num_cached_tokens`` are added. ``sampling_params`` is a
    ``SamplingParams`` or a dict of its fields; ``engine_kwargs`` are ``Engine``'s keyword
    arguments; ``chat_template_kwargs`` reach the chat template.

    With ``tensor_parallel_size=N`` the actor must reserve N GPUs (``num_gpus=N``): Ray then
    makes exactly those visible to the actor, the engine's rank 0 runs in the actor and
    ranks 1..N-1 are processes it spawns on the same node, each on one of them.

    With ``engine_kwargs={"distributed_executor_backend": "ray", ...}`` the replica's engine
    is multi-node: every rank (``tensor_parallel_size x pipeline_parallel_size``) is a Ray
    actor placed by the engine's own placement groups (one per pipeline stage), and the
    replica actor reserves no GPU for them (``num_gpus=0``). The rank actors and their
    placement groups belong to the replica: if it dies, Ray ends them with it.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        engine_kwargs: Mapping[str, Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        # Imported here rather than at the top: a driver that only builds the dataset (and
        # pickles this class by reference) never loads torch; each actor loads it once.
        from pagedinfer.engine.engine import Engine

        self.sampling_params = as_sampling_params(sampling_params)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.engine: Engine = Engine(model, **dict(engine_kwargs or {}))

    def __call__(self, batch: Mapping[str, Any]) -> Any:
        """``batch`` with the output columns added, one generation per row, rows in order."""
        prompts = batch_prompts(batch, self.engine.tokenizer, self.chat_template_kwargs)
        outputs = self.engine.generate(prompts, self.sampling_params, use_tqdm=False)
        return with_columns(batch, output_columns(outputs))

    def close(self) -> None:
        """Release the engine (and its tensor-parallel workers). Ray ends actors without
        calling this; the workers notice their parent is gone and exit by themselves (rank
        actors of the Ray executor are ended by Ray with their owner)."""
        self.engine.close()


def as_sampling_params(value: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
    """``SamplingParams`` from itself, a dict of its fields, or None (the defaults); one
    completion per prompt (``n=1``)."""
    if value is None:
        params = SamplingParams()
    elif isinstance(value, SamplingParams):
        params = value
    elif isinstance(value, Mapping):
        unknown = sorted(str(name) for name in value if name not in _SAMPLING_FIELDS)
        if unknown:
            raise InvalidSamplingParamsError(
                f"unknown SamplingParams field(s) {unknown}: the fields are "
                f"{', '.join(_SAMPLING_FIELDS)}."
            )
        params = SamplingParams(**value)
    else:
        raise InvalidSamplingParamsError(
            f"sampling_params must be a SamplingParams, a dict of its fields or None, not "
            f"{type(value).__name__}."
        )
    if params.n != 1:
        # A row holds one completion; n of them would need list-valued columns.
        raise InvalidSamplingParamsError(
            f"SamplingParams.n={params.n}: pagedinfer.ray writes one completion per row. "
            "Repeat the rows instead (with different seeds for different samples)."
        )
    return params
