"""``vllm serve`` flags without a pagedinfer equivalent, so that a vLLM command line runs
unchanged (``pagedinfer serve``).

Each flag is one of ``LLM``'s vLLM arguments (:data:`pagedinfer.engine.llm.VLLM_ARGUMENTS`:
the same values accepted, the same reason given) or a server-only one. A flag that changes
nothing here is accepted and named, with its reason, in one line at start-up; a value that
would select something pagedinfer does not have (``--quantization fp8`` for an unquantized
checkpoint, ``--no-enable-chunked-prefill``, ``--revision``) is refused with the reason.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pagedinfer.engine.llm import VLLM_ARGUMENTS, check_quantization
from pagedinfer.errors import ConfigurationError

__all__ = ["VLLM_FLAGS", "VllmFlag", "add_vllm_flags", "vllm_flag_notes"]


@dataclass(frozen=True, slots=True)
class VllmFlag:
    """One ``vllm serve`` flag: ``switch`` (``--x``, or ``--x`` / ``--no-x``) or a value
    (``parse``, ``metavar``); ``why`` says why it changes nothing here."""

    why: str
    switch: bool = False
    negatable: bool = False  # --no-x too (vLLM's BooleanOptionalAction)
    parse: Callable[[str], object] = str
    metavar: str = "X"
    accepts: Callable[[object], bool] = lambda value: True


def _llm(name: str, **flag: object) -> VllmFlag:
    """A flag that is one of ``LLM``'s vLLM arguments: its reason and accepted values."""
    argument = VLLM_ARGUMENTS[name]
    return VllmFlag(why=argument.why, accepts=argument.accepts, **flag)  # type: ignore[arg-type]


_NO_REQUEST_LOG = "pagedinfer logs no per-request lines (--log-level debug shows more)"

VLLM_FLAGS: dict[str, VllmFlag] = {
    "trust_remote_code": _llm("trust_remote_code", switch=True),
    "enable_chunked_prefill": _llm("enable_chunked_prefill", switch=True, negatable=True),
    "quantization": _llm("quantization", metavar="METHOD"),
    "swap_space": _llm("swap_space", parse=float, metavar="GIB"),
    "disable_log_stats": _llm("disable_log_stats", switch=True),
    "disable_log_requests": VllmFlag(_NO_REQUEST_LOG, switch=True),
    "enable_log_requests": VllmFlag(_NO_REQUEST_LOG, switch=True),
    "max_log_len": VllmFlag(_NO_REQUEST_LOG, parse=int, metavar="N"),
    "disable_uvicorn_access_log": VllmFlag("uvicorn's access log follows --log-level", switch=True),
    "disable_frontend_multiprocessing": VllmFlag(
        "the server and the engine run in one process", switch=True
    ),
    "disable_fastapi_docs": VllmFlag("the server has no /docs route", switch=True),
    "max_seq_len_to_capture": _llm("max_seq_len_to_capture", parse=int, metavar="N"),
    "disable_custom_all_reduce": _llm("disable_custom_all_reduce", switch=True),
    "disable_async_output_proc": _llm("disable_async_output_proc", switch=True),
    "tokenizer_mode": _llm("tokenizer_mode", metavar="MODE"),
    "load_format": _llm("load_format", metavar="FORMAT"),
    "cpu_offload_gb": _llm("cpu_offload_gb", parse=float, metavar="GIB"),
    "hf_token": _llm("hf_token", metavar="TOKEN"),
    "revision": _llm("revision", metavar="REV"),
    "download_dir": _llm("download_dir", metavar="DIR"),
}
"""The ``vllm serve`` flags ``pagedinfer serve`` accepts without an engine option (by name
with underscores; the flag is ``--`` and the name with dashes)."""


def vllm_flag_notes(values: Mapping[str, object], model_path: str) -> str | None:
    """The start-up line naming the flags given (``values``: name to parsed value, ``None``
    for a flag not given) that change nothing here, with why; ``None`` if none was given.
    Raises :class:`ConfigurationError` for a value pagedinfer cannot honour."""
    given: list[str] = []
    for name, value in values.items():
        if value is None:
            continue
        flag = VLLM_FLAGS[name]
        dashed = f"--{name.replace('_', '-')}"
        shown = dashed if flag.switch and value is True else f"{dashed} {value}"
        if flag.switch and value is False:
            shown = f"--no-{name.replace('_', '-')}"
        if not flag.accepts(value):
            raise ConfigurationError(f"{shown} is not supported: {flag.why}.")
        if name == "quantization":
            assert isinstance(value, str)
            check_quantization(model_path, value, spelling=f"--quantization {value}")
            given.append(f"{shown} (the checkpoint's own quantization, recognised anyway)")
            continue
        given.append(f"{shown} ({flag.why})")
    if not given:
        return None
    return "accepted for vLLM's command lines, changing nothing here: " + "; ".join(given)


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Add :data:`VLLM_FLAGS` to ``parser`` (``pagedinfer serve``), in their own ``--help``
    group; each parses to ``vllm_<name>``, ``None`` when not given."""
    group = parser.add_argument_group(
        "accepted for vLLM's command lines (change nothing here; named at start-up)"
    )
    for name, flag in VLLM_FLAGS.items():
        dashed, dest = f"--{name.replace('_', '-')}", f"vllm_{name}"
        if flag.switch and flag.negatable:  # --x / --no-x
            action = argparse.BooleanOptionalAction
            group.add_argument(dashed, dest=dest, action=action, default=None, help=flag.why)
        elif flag.switch:
            group.add_argument(dashed, dest=dest, action="store_const", const=True, help=flag.why)
        else:
            group.add_argument(
                dashed, dest=dest, type=flag.parse, metavar=flag.metavar, help=flag.why
            )
