"""How an engine option reads on the command line: the flag's text, help, parser and default.

Each :class:`~pagedinfer.engine.config.EngineConfig` field carries a :class:`CliFlag` in its
metadata (under :data:`CLI_FLAG`); ``pagedinfer generate``/``serve`` build their flags from it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pagedinfer.domain.speculative import SpeculativeConfig
from pagedinfer.errors import ConfigurationError

__all__ = [
    "CLI_FLAG",
    "GRAMMAR_LIMITS_GROUP",
    "SPECULATIVE_EXAMPLE",
    "CliFlag",
    "one_of",
    "parse_num_threads",
    "parse_speculative_config",
]

_LIBRARY_DEFAULT = object()  # CliFlag.cli_default: the option's own default


@dataclass(frozen=True, slots=True)
class CliFlag:
    """How an engine option reads on the command line (``pagedinfer generate``, ``serve``, ...).

    The flag is the field's name with dashes (``max_num_seqs``: ``--max-num-seqs``); its
    default is the field's, shown by ``--help``.
    """

    help: str
    group: str = "engine"  # the --help section: "engine" or "request limits"
    aliases: tuple[str, ...] = ()  # other spellings (vLLM's: --block-size, -tp)
    metavar: str | None = None
    # Text to value, raising ValueError with a message that says what is expected. None: the
    # default's type (int, float, str).
    parse: Callable[[str], object] | None = None
    choices: tuple[str, ...] | None = None
    # A flag without a value: --x (default False), or --x / --no-x (default True or None).
    switch: bool = False
    # The command line's own default where it differs from the library's (none does today:
    # the library's and the command line's defaults are the same).
    cli_default: object = _LIBRARY_DEFAULT
    # A composite option (a frozen dataclass of ints, such as GrammarLimits): one integer flag
    # per member, --<member_prefix>-<member>, with the member's help; the value is built from them.
    members: Mapping[str, str] | None = None
    member_prefix: str = ""

    def default(self, library_default: object) -> object:
        """The flag's default: ``cli_default``, or else the option's (``library_default``)."""
        return library_default if self.cli_default is _LIBRARY_DEFAULT else self.cli_default


GRAMMAR_LIMITS_GROUP = "grammar limits (structured outputs; docs/structured-outputs.md)"

CLI_FLAG = "cli"
"""The key of a field's metadata that holds its :class:`CliFlag`."""


def one_of(names: tuple[str, ...]) -> str:
    """``("a", "b", "c")``: ``"a, b or c"``."""
    return f"{', '.join(names[:-1])} or {names[-1]}"


def parse_num_threads(text: str) -> int | str:
    """``--num-threads``: an integer >= 1, or ``auto``."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected an integer or 'auto', got {text!r}") from None
    if value < 1:
        raise ValueError(f"expected an integer >= 1 or 'auto', got {text!r}")
    return value


SPECULATIVE_EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 3}'


def parse_speculative_config(text: str) -> dict[str, object]:
    """``--speculative-config``: vLLM's JSON object, checked (before the model loads) and
    kept as the dict."""
    try:
        value = json.loads(text)
    except ValueError as error:
        raise ValueError(
            f"expected a JSON object such as '{SPECULATIVE_EXAMPLE}', got {text!r} ({error})"
        ) from None
    try:
        SpeculativeConfig.from_value(value)
    except ConfigurationError as error:
        raise ValueError(" ".join(str(error).split())) from None
    result: dict[str, object] = value  # a dict: from_value refuses anything else
    return result
