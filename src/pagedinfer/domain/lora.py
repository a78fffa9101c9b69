"""``LoRARequest``: which LoRA adapter a request runs with (vLLM's ``LoRARequest``).

An adapter is named by a positive integer id (``lora_int_id``), unique per adapter for the
engine's lifetime: the id is what the scheduler counts (at most ``max_loras`` distinct
adapters per step, :mod:`pagedinfer.domain.scheduler.adapter_limit`), what the prefix cache
keys on (:func:`adapter_extra_key`: a base-model prefix is never reused for an adapter, nor one
adapter's for another) and what the executor's device slots hold. ``lora_path`` is a
directory in PEFT's layout (``adapter_config.json`` + ``adapter_model.safetensors``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedinfer.errors import InvalidRequestError

__all__ = ["LoRARequest", "Lora", "adapter_extra_key"]

_UINT64_MASK = (1 << 64) - 1
# Mixes a cache salt with an adapter id (the golden-ratio constant of splitmix64).
_MIX = 0x9E3779B97F4A7C15


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A LoRA adapter for a request: ``LoRARequest("sql", 1, "/adapters/sql")``.

    ``lora_name`` names it (the server's ``model`` field), ``lora_int_id`` (>= 1) identifies
    it, ``lora_path`` is its directory in PEFT's layout. Two requests with the same id must
    name the same adapter (the engine refuses a different name or path under a known id).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidRequestError(
                f"LoRARequest.lora_name={self.lora_name!r} is invalid: expected a non-empty "
                "string (the adapter's name)."
            )
        if (
            not isinstance(self.lora_int_id, int)
            or isinstance(self.lora_int_id, bool)
            or self.lora_int_id < 1
        ):
            raise InvalidRequestError(
                f"LoRARequest.lora_int_id={self.lora_int_id!r} is invalid: expected an integer "
                ">= 1 (0 is the base model), unique per adapter."
            )
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise InvalidRequestError(
                f"LoRARequest.lora_path={self.lora_path!r} is invalid: expected the adapter's "
                "directory (PEFT's adapter_config.json + adapter_model.safetensors)."
            )

    # vLLM's aliases.
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


Lora = LoRARequest | None
"""A request's adapter (None: the base model)."""


def adapter_extra_key(extra_key: int | None, lora: LoRARequest | None) -> int | None:
    """The prefix-cache key of a request with ``extra_key`` (a salt, or None) and ``lora``:
    the adapter id enters the hash chain, so no block is shared across adapters or with
    the base model."""
    if lora is None:
        return extra_key
    if extra_key is None:
        return lora.lora_int_id
    return ((extra_key * _MIX) ^ lora.lora_int_id) & _UINT64_MASK
