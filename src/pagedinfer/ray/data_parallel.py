"""``generate``: data-parallel generation on Ray Data, one ``EnginePredictor`` per replica."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard, overload

from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.errors import (
    ConfigurationError,
    InvalidRequestError,
    MissingDependencyError,
    install_hint,
)
from pagedinfer.ray.columns import MESSAGES_COLUMN, PROMPT_COLUMN
from pagedinfer.ray.predictor import EnginePredictor, as_sampling_params

try:
    import ray
    import ray.data
except ImportError as error:
    raise MissingDependencyError(
        f"pagedinfer.ray.generate needs Ray Data, which could not be imported ({error}): "
        f"install it with {install_hint('ray')}."
    ) from error

__all__ = ["DEFAULT_BATCH_SIZE", "Generation", "generate"]

# Rows per map_batches call. One call runs to completion inside the engine, so larger
# batches keep more sequences in flight (and shrink each batch's drain at the end).
DEFAULT_BATCH_SIZE = 256

# Carries each prompt's position through the cluster; results are sorted by it.
_ROW_COLUMN = "_pagedinfer_row"

PromptInput = str | Sequence[int] | Sequence[Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class Generation:
    """One prompt's result; the fields are the columns ``EnginePredictor`` adds."""

    generated_text: str
    generated_token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int


@overload
def generate(
    prompts_or_dataset: Sequence[PromptInput],
    model: str | os.PathLike[str],
    sampling_params: SamplingParams | Mapping[str, Any] | None = None,
    *,
    num_replicas: int,
    engine_kwargs: Mapping[str, Any] | None = None,
    batch_size: int | None = None,
    num_gpus_per_replica: float | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[Generation]: ...


@overload
def generate(
    prompts_or_dataset: ray.data.Dataset,
    model: str | os.PathLike[str],
    sampling_params: SamplingParams | Mapping[str, Any] | None = None,
    *,
    num_replicas: int,
    engine_kwargs: Mapping[str, Any] | None = None,
    batch_size: int | None = None,
    num_gpus_per_replica: float | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> ray.data.Dataset: ...


def generate(
    prompts_or_dataset: Sequence[PromptInput] | ray.data.Dataset,
    model: str | os.PathLike[str],
    sampling_params: SamplingParams | Mapping[str, Any] | None = None,
    *,
    num_replicas: int,
    engine_kwargs: Mapping[str, Any] | None = None,
    batch_size: int | None = None,
    num_gpus_per_replica: float | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[Generation] | ray.data.Dataset:
    """Generate on ``num_replicas`` engines of a Ray cluster, one per actor.

    ``prompts_or_dataset`` is a list of prompts (each text, a list of token ids or a list of
    chat messages) or a ``ray.data.Dataset`` with a ``prompt`` or ``messages`` column.
    A list returns one :class:`Generation` per prompt, in input order; a Dataset returns the
    Dataset with the output columns added (lazy: write it, e.g. ``.write_parquet(DIR)``; rows
    come in Ray Data's execution order, so carry an id column if order matters).

    ``model`` is a checkpoint directory that every node can read. ``engine_kwargs`` are
    ``Engine``'s keyword arguments. Each replica reserves ``num_gpus_per_replica`` GPUs;
    the default is the engine's ``tensor_parallel_size`` when the cluster has GPUs and the
    engine's device is not the CPU, else 0 (and 0 with ``distributed_executor_backend="ray"``:
    the engine's ranks are Ray actors in placement groups of their own, on any nodes).
    ``batch_size`` rows go to an engine at a time (default: the prompts split evenly over the
    replicas, at most ``DEFAULT_BATCH_SIZE``).
    Uses the Ray cluster this process is connected to, or starts a local one (``ray.init``).
    """
    if not isinstance(num_replicas, int) or isinstance(num_replicas, bool) or num_replicas < 1:
        raise ConfigurationError(
            f"num_replicas={num_replicas!r} is invalid: expected an integer >= 1."
        )
    if batch_size is not None and (
        not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1
    ):
        raise ConfigurationError(
            f"batch_size={batch_size!r} is invalid: expected None or an integer >= 1."
        )
    params = as_sampling_params(sampling_params)  # a bad value fails here, not in an actor
    kwargs = dict(engine_kwargs or {})
    constructor = {
        "model": os.fspath(model),
        "sampling_params": params,
        "engine_kwargs": kwargs,
        "chat_template_kwargs": dict(chat_template_kwargs or {}),
    }
    if isinstance(prompts_or_dataset, ray.data.Dataset):
        return _map(
            prompts_or_dataset,
            constructor,
            num_replicas=num_replicas,
            batch_size=batch_size or DEFAULT_BATCH_SIZE,
            num_gpus=num_gpus_per_replica,
        )
    rows = _prompt_rows(prompts_or_dataset)
    if not rows:
        return []
    even_split = math.ceil(len(rows) / num_replicas)
    mapped = _map(
        ray.data.from_items(rows),
        constructor,
        num_replicas=num_replicas,
        batch_size=batch_size or min(even_split, DEFAULT_BATCH_SIZE),
        num_gpus=num_gpus_per_replica,
    )
    results = sorted(mapped.take_all(), key=lambda row: int(row[_ROW_COLUMN]))
    # Ray retries a batch whose actor died; a lost or doubled row would be a bug there.
    assert [int(row[_ROW_COLUMN]) for row in results] == list(range(len(rows)))
    return [_generation(row) for row in results]


def _map(
    dataset: ray.data.Dataset,
    constructor: dict[str, Any],
    *,
    num_replicas: int,
    batch_size: int,
    num_gpus: float | None,
) -> ray.data.Dataset:
    if num_gpus is None:
        num_gpus = _default_gpus_per_replica(constructor["engine_kwargs"])
    return dataset.map_batches(
        EnginePredictor,
        fn_constructor_kwargs=constructor,
        compute=ray.data.ActorPoolStrategy(size=num_replicas),
        batch_size=batch_size,
        num_gpus=num_gpus,
    )


def _default_gpus_per_replica(engine_kwargs: Mapping[str, Any]) -> float:
    """The engine's ``tensor_parallel_size`` on a GPU cluster; 0 for CPU engines and for
    engines on the Ray executor (their rank actors reserve their own GPUs)."""
    device = str(engine_kwargs.get("device", "auto"))
    if device.startswith("cpu") or engine_kwargs.get("distributed_executor_backend") == "ray":
        return 0
    if device == "auto":
        if not ray.is_initialized():
            ray.init()
        resources: dict[str, float] = ray.cluster_resources()  # type: ignore[no-untyped-call]
        if not resources.get("GPU", 0):
            return 0
    tensor_parallel_size = engine_kwargs.get("tensor_parallel_size", 1)
    return float(tensor_parallel_size) if isinstance(tensor_parallel_size, int) else 1.0


def _prompt_rows(prompts: Sequence[PromptInput]) -> list[dict[str, Any]]:
    """One dataset row per prompt: its position, and its text/token ids or its messages."""
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        raise InvalidRequestError(
            "prompts must be a list (of texts, token-id lists or chat-message lists) or a "
            f"ray.data.Dataset, not {type(prompts).__name__}; wrap a single prompt in a list."
        )
    rows: list[dict[str, Any]] = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            rows.append({_ROW_COLUMN: index, PROMPT_COLUMN: prompt})
        elif _is_messages(prompt):
            rows.append({_ROW_COLUMN: index, MESSAGES_COLUMN: [dict(m) for m in prompt]})
        elif isinstance(prompt, Sequence):
            rows.append({_ROW_COLUMN: index, PROMPT_COLUMN: list(prompt)})
        else:
            raise InvalidRequestError(
                f"prompt {index} is a {type(prompt).__name__}: a prompt is text, a list of "
                "token ids or a list of chat messages."
            )
    kinds = {PROMPT_COLUMN if PROMPT_COLUMN in row else MESSAGES_COLUMN for row in rows}
    text = {isinstance(row.get(PROMPT_COLUMN), str) for row in rows if PROMPT_COLUMN in row}
    if len(kinds) > 1 or len(text) > 1:
        raise InvalidRequestError(
            "the prompts mix texts, token-id lists and chat messages: a dataset column holds "
            "one kind, so call generate once per kind."
        )
    return rows


def _is_messages(prompt: object) -> TypeGuard[Sequence[Mapping[str, Any]]]:
    return (
        isinstance(prompt, Sequence)
        and bool(prompt)
        and all(isinstance(item, Mapping) for item in prompt)
    )


def _generation(row: Mapping[str, Any]) -> Generation:
    token_ids = row["generated_token_ids"]
    finish_reason = row["finish_reason"]
    return Generation(
        generated_text=str(row["generated_text"]),
        generated_token_ids=[int(token) for token in token_ids],
        finish_reason=None if finish_reason is None else str(finish_reason),
        num_prompt_tokens=int(row["num_prompt_tokens"]),
        num_cached_tokens=int(row["num_cached_tokens"]),
    )
