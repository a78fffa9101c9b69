"""The engine's LoRA options (``enable_lora``, ``max_loras``, ``max_lora_rank``,
``max_cpu_loras``, vLLM's names and defaults): their command-line flags and their checks."""

from __future__ import annotations

from pagedinfer.engine.cli_flag import CliFlag
from pagedinfer.errors import ConfigurationError

__all__ = [
    "LORA_FLAG_HELP",
    "LORA_OPTION_NAMES",
    "check_lora_options",
    "cpu_lora_slots",
    "lora_flag",
]

LORA_OPTION_NAMES = (
    "enable_lora",
    "max_loras",
    "max_lora_rank",
    "max_cpu_loras",
    "pipeline_parallel_size",
)
"""The ``EngineConfig`` fields :func:`check_lora_options` reads."""

LORA_FLAG_HELP: dict[str, str] = {
    "enable_lora": "serve LoRA adapters (PEFT layout) over the base model (docs/lora.md)",
    "max_loras": "LoRA adapters one step may mix (device slots)",
    "max_lora_rank": "the largest LoRA rank served",
    "max_cpu_loras": "LoRA adapters kept in host memory (default: max_loras)",
}


def lora_flag(name: str) -> CliFlag:
    """The command-line flag of LoRA option ``name`` (``--enable-lora``, ``--max-loras``, ...)."""
    if name == "enable_lora":
        return CliFlag(LORA_FLAG_HELP[name], switch=True)
    return CliFlag(
        LORA_FLAG_HELP[name], metavar="N", parse=int if name == "max_cpu_loras" else None
    )


def check_lora_options(
    *,
    enable_lora: object,
    max_loras: object,
    max_lora_rank: object,
    max_cpu_loras: object,
    pipeline_parallel_size: int,
) -> None:
    """Raise :class:`ConfigurationError` naming the option that is invalid."""
    if not isinstance(enable_lora, bool):
        raise ConfigurationError(f"enable_lora={enable_lora!r} must be True or False.")
    for name, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigurationError(f"{name}={value!r} is invalid: expected an integer >= 1.")
    if max_cpu_loras is not None:
        if not isinstance(max_cpu_loras, int) or isinstance(max_cpu_loras, bool):
            raise ConfigurationError(
                f"max_cpu_loras={max_cpu_loras!r} is invalid: expected an integer or None."
            )
        assert isinstance(max_loras, int)
        if max_cpu_loras < max_loras:
            raise ConfigurationError(
                f"max_cpu_loras={max_cpu_loras} is below max_loras={max_loras}: the host keeps "
                "at least the adapters on the device. Raise max_cpu_loras (or leave it None)."
            )
    if enable_lora and pipeline_parallel_size > 1:
        raise ConfigurationError(
            "enable_lora runs with pipeline_parallel_size=1 only (splitting adapters across "
            "stages is not implemented); tensor parallelism is supported."
        )


def cpu_lora_slots(max_loras: int, max_cpu_loras: int | None) -> int:
    """Host copies kept: ``max_cpu_loras``, by default ``max_loras`` (vLLM's default)."""
    return max_loras if max_cpu_loras is None else max_cpu_loras
