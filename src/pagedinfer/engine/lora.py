"""The engine's LoRA adapters: which it knows, and the checks a request's adapter passes.

A request names its adapter with a :class:`~pagedinfer.domain.lora.LoRARequest`. The first
time an adapter id is seen (:meth:`LoRARegistry.check`, or :meth:`LoRARegistry.add`), its
directory is checked against the model (``adapter_config.json`` and the safetensors header:
names, rank, shapes; :func:`~pagedinfer.adapters.lora.peft.check_adapter`), in the caller's
thread and before the engine's lock: a bad adapter is refused with
:class:`~pagedinfer.errors.InvalidLoRAAdapterError` and nothing is queued. The tensors are read
by the model runner when a step first needs them. An id names one adapter for the engine's
lifetime: the same id with another name or path is refused, even after it was removed (the
runner may still hold its tensors).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from pagedinfer.adapters.lora.peft import check_adapter
from pagedinfer.adapters.models.config import ModelConfig
from pagedinfer.domain.lora import LoRARequest
from pagedinfer.domain.scheduler import Scheduler
from pagedinfer.engine.config import EngineConfig
from pagedinfer.engine.engine_lock import EngineLock
from pagedinfer.errors import InvalidLoRAAdapterError, InvalidRequestError

__all__ = ["LoRAAdapterInUseError", "LoRAMethods", "LoRARegistry", "adapter_in_use"]


class LoRAAdapterInUseError(InvalidRequestError):
    """An adapter cannot be removed while unfinished requests run with it."""


class LoRARegistry:
    """The adapters an engine serves (``enabled``: ``enable_lora``), checked once each."""

    def __init__(self, *, enabled: bool, model_config: ModelConfig, max_lora_rank: int) -> None:
        self.enabled = enabled
        self._model_config = model_config
        self._max_lora_rank = max_lora_rank
        self._lock = threading.Lock()
        self._adapters: dict[int, LoRARequest] = {}  # registered, by id
        self._named: dict[int, tuple[str, str]] = {}  # every id ever seen: (name, path)

    @classmethod
    def for_engine(cls, config: EngineConfig, model_config: ModelConfig) -> LoRARegistry:
        """The registry of an engine with ``config`` (``enable_lora``, ``max_lora_rank``)."""
        return cls(
            enabled=config.enable_lora,
            model_config=model_config,
            max_lora_rank=config.max_lora_rank,
        )

    def check(self, lora: object) -> LoRARequest | None:
        """``lora`` if this engine can serve it (registering it on first sight), else an
        :class:`InvalidRequestError` (:class:`InvalidLoRAAdapterError` for the adapter's
        files). Takes no engine lock."""
        if lora is None:
            return None
        request = _as_request(lora)
        if not self.enabled:
            raise InvalidRequestError(
                f"the request asks for LoRA adapter {request.lora_name!r}, but this engine "
                "serves no adapters: start it with enable_lora=True (--enable-lora)."
            )
        with self._lock:
            known = self._adapters.get(request.lora_int_id)
            if known == request:
                return known
            self._check_identity(request)
        check_adapter(request.lora_path, self._model_config, self._max_lora_rank)
        with self._lock:
            self._check_identity(request)
            self._named[request.lora_int_id] = (request.lora_name, request.lora_path)
            self._adapters[request.lora_int_id] = request
        return request

    def per_prompt(self, lora: object, num_prompts: int) -> list[LoRARequest | None]:
        """One checked adapter (or None) per prompt: ``lora`` for all, or a list of one each."""
        if lora is None or not isinstance(lora, Sequence) or isinstance(lora, (str, bytes)):
            checked = self.check(lora)
            return [checked] * num_prompts
        if len(lora) != num_prompts:
            raise InvalidRequestError(
                f"got {len(lora)} lora_request values for {num_prompts} prompts: pass one "
                "for all or exactly one (a LoRARequest or None) per prompt."
            )
        return [self.check(each) for each in lora]

    def add(self, lora: object) -> bool:
        """Register (and check) an adapter; False if it was registered already."""
        request = _as_request(lora)
        with self._lock:
            if self._adapters.get(request.lora_int_id) == request:
                return False
        self.check(request)
        return True

    def remove(self, lora_id: int, in_use: Callable[[int], bool]) -> bool:
        """Forget adapter ``lora_id`` (False if unknown); refused with
        :class:`LoRAAdapterInUseError` while ``in_use(lora_id)``."""
        with self._lock:
            request = self._adapters.get(lora_id)
            if request is None:
                return False
            if in_use(lora_id):
                raise LoRAAdapterInUseError(
                    f"LoRA adapter {request.lora_name!r} (id {lora_id}) is in use by "
                    "unfinished requests: abort them or wait until they finish, then remove it."
                )
            del self._adapters[lora_id]
            return True

    def list(self) -> dict[int, LoRARequest]:
        """The registered adapters, by id."""
        with self._lock:
            return dict(self._adapters)

    def _check_identity(self, request: LoRARequest) -> None:
        named = self._named.get(request.lora_int_id)
        if named is not None and named != (request.lora_name, request.lora_path):
            raise InvalidLoRAAdapterError(
                f"lora_int_id {request.lora_int_id} already names adapter {named[0]!r} at "
                f"{named[1]!r}: an id names one adapter for the engine's lifetime. Give "
                f"{request.lora_name!r} another id."
            )


class LoRAMethods:
    """vLLM's adapter methods of ``Engine`` (and ``LLM``): register one ahead of its requests,
    remove one (refused while unfinished requests use it), list them (docs/lora.md)."""

    loras: LoRARegistry
    scheduler: Scheduler
    _guard: EngineLock

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check and register an adapter; False if it was registered already."""
        return self.loras.add(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Forget adapter ``lora_id`` (False if unknown); ``LoRAAdapterInUseError`` while
        unfinished requests use it."""
        with self._guard.held():
            return self.loras.remove(lora_id, lambda key: adapter_in_use(self.scheduler, key))

    def list_loras(self) -> set[int]:
        """The registered adapters' ids."""
        return set(self.loras.list())


def adapter_in_use(scheduler: Scheduler, lora_id: int) -> bool:
    """Whether an unfinished sequence of ``scheduler`` runs with adapter ``lora_id``."""
    seqs = scheduler.running + scheduler.waiting + scheduler.unstarted_forks()
    return any(seq.lora is not None and seq.lora.lora_int_id == lora_id for seq in seqs)


def _as_request(lora: object) -> LoRARequest:
    """A :class:`LoRARequest`, also from an object with vLLM's attributes (``lora_name``,
    ``lora_int_id``, ``lora_path``: vLLM's own ``LoRARequest``)."""
    if isinstance(lora, LoRARequest):
        return lora
    try:
        name, int_id, path = lora.lora_name, lora.lora_int_id, lora.lora_path  # type: ignore[attr-defined]
    except AttributeError:
        raise InvalidRequestError(
            f"lora_request must be a pagedinfer.LoRARequest (or None), not {type(lora).__name__}."
        ) from None
    return LoRARequest(name, int_id, path)
