"""What ``pagedinfer serve`` lets in (API key, allowed hosts, body size, read timeouts, unknown
request fields) and how it renders chats (its chat template).

Pure Python (neither FastAPI nor uvicorn): the command line reads the defaults from here to
build its ``--help`` without the serve extra installed.
"""

from __future__ import annotations

import ipaddress
import math
import os
from dataclasses import dataclass

from pagedinfer.errors import ConfigurationError, PagedInferError
from pagedinfer.serving.hosts import host_allowed
from pagedinfer.serving.reasoning.registry import REASONING_PARSERS
from pagedinfer.serving.tools.parsers import TOOL_CALL_PARSERS

__all__ = [
    "API_KEY_ENV",
    "DEFAULT_BODY_TIMEOUT_S",
    "DEFAULT_HEADER_TIMEOUT_S",
    "DEFAULT_MAX_HEADER_BYTES",
    "DEFAULT_MAX_REQUEST_BYTES",
    "LOOPBACK_HOSTS",
    "AddressInUseError",
    "ServingOptions",
    "default_allowed_hosts",
    "host_allowed",
    "load_chat_template",
    "served_name",
]

# The environment variable that holds the API key (vLLM's is VLLM_API_KEY).
API_KEY_ENV = "PAGEDINFER_API_KEY"

# 1 MiB. The longest prompt a request needs is max_model_len tokens: 128k tokens of English
# text are ~0.5 MiB of JSON, as token ids ~0.9 MiB. Parsing a body runs on the event loop
# (json + pydantic, ~50 ms for 1 MiB of token ids), so this also bounds how long one
# request can hold up every other connection; raise it for batches of long prompts.
DEFAULT_MAX_REQUEST_BYTES = 1 << 20
# The request line and headers (together); uvicorn's h11 allows 16 KiB, nginx 32 KiB.
DEFAULT_MAX_HEADER_BYTES = 64 * 1024
# From a connection's first byte (or its opening) to the end of a request's headers.
DEFAULT_HEADER_TIMEOUT_S = 10.0
# From the end of the headers to the body's last byte (1 MiB at 140 kbit/s).
DEFAULT_BODY_TIMEOUT_S = 60.0

# The names a loopback-bound server answers to by default (the Host header's host part).
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


class AddressInUseError(PagedInferError, OSError):
    """The address ``pagedinfer serve`` should listen on is taken by another process."""


@dataclass(frozen=True, slots=True)
class ServingOptions:
    """The server's admission rules and chat rendering (``build_app``, ``run_server``;
    docs/serving.md, "Deploying").

    ``api_key``: every route but ``/health`` and ``/version`` (and ``/metrics`` when
    ``metrics_public``) requires ``Authorization: Bearer <api_key>``; ``None``: no key.
    ``allowed_hosts``: the host names the ``Host`` header may carry (``"*.example.com"``
    matches subdomains, ``"*"`` any); ``None``: ``build_app`` checks nothing, ``run_server`` picks
    :func:`default_allowed_hosts` of the bind address. ``max_request_bytes``: the most body
    bytes a request may send (413 beyond). ``header_timeout_s`` / ``body_timeout_s``: how
    long a request's headers / body may take to arrive (the connection is closed / 408).
    ``max_header_bytes``: the request line and headers together.
    ``chat_template``: the Jinja template chats are rendered with (``None``: the
    tokenizer's). ``trust_request_chat_template``: accept a ``chat_template`` sent in a
    request (a template is code the server runs; off, such a request is a 400).
    ``ignore_unknown_fields``: a request field the server does not know is logged and
    ignored (vLLM's behaviour) instead of answered with a 400 (OpenAI's).
    ``tool_call_parser``: how tool calls are read from answers with ``tool_choice="auto"``
    (a name of :data:`~pagedinfer.serving.tools.TOOL_CALL_PARSERS`: ``hermes``,
    ``llama3_json``, ``llama4_json``, ``mistral``); ``enable_auto_tool_choice`` allows
    ``tool_choice="auto"`` (the default when a request has tools) and needs the parser, as
    vLLM's ``--enable-auto-tool-choice`` does. ``reasoning_parser``: how a thinking model's
    answers are split into ``reasoning_content`` and ``content`` (a name of
    :data:`~pagedinfer.serving.reasoning.REASONING_PARSERS`: ``qwen3``, ``deepseek_r1``;
    ``None``: the reasoning stays in the content). ``enable_prompt_tokens_details``: ``usage``
    carries ``prompt_tokens_details.cached_tokens`` (the prompt tokens the prefix cache
    served), as vLLM's ``--enable-prompt-tokens-details``; off, it is left out.
    """

    api_key: str | None = None
    metrics_public: bool = False
    allowed_hosts: tuple[str, ...] | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    ignore_unknown_fields: bool = False
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    enable_prompt_tokens_details: bool = False
    # POST /sleep, /wake_up, /pause, /resume; GET /is_sleeping, /is_paused (routes/sleep.py).
    enable_sleep_mode: bool = False
    # LoRA (docs/lora.md): adapters served under their names, and the load/unload routes.
    lora_modules: tuple[tuple[str, str], ...] = ()
    allow_runtime_lora_updating: bool = False

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigurationError(
                f"reasoning_parser={self.reasoning_parser!r} is unknown: expected one of "
                f"{', '.join(sorted(REASONING_PARSERS))} (--reasoning-parser)."
            )
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigurationError(
                f"tool_call_parser={self.tool_call_parser!r} is unknown: expected one of "
                f"{', '.join(sorted(TOOL_CALL_PARSERS))} (--tool-call-parser)."
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigurationError(
                "--enable-auto-tool-choice needs --tool-call-parser: name the model family's "
                f"tool-call format ({', '.join(sorted(TOOL_CALL_PARSERS))})."
            )
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ConfigurationError(
                "api_key must be a non-empty string, or None for no key (an empty "
                f"--api-key / {API_KEY_ENV} would let everyone in)."
            )
        if self.allowed_hosts is not None:
            hosts = tuple(host.strip().lower() for host in self.allowed_hosts if host.strip())
            if not hosts:
                raise ConfigurationError(
                    "allowed_hosts is empty: name at least one host, or '*' for any."
                )
            object.__setattr__(self, "allowed_hosts", hosts)
        for name in ("max_request_bytes", "max_header_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigurationError(f"{name}={value!r} is invalid: expected an integer >= 1.")
        for name in ("header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not (0 < value < math.inf):
                raise ConfigurationError(
                    f"{name}={value!r} is invalid: expected a number of seconds > 0."
                )


def default_allowed_hosts(bind_host: str) -> tuple[str, ...] | None:
    """The Host names a server bound to ``bind_host`` answers by default: the loopback names
    (and the bind address) when it is a loopback address, else any (``None``).

    A browser page from another site can reach a loopback server through DNS rebinding (its
    name resolving to 127.0.0.1); such a request carries that site's name as its Host.
    """
    host = bind_host.strip("[]").lower()
    if host == "localhost":
        return LOOPBACK_HOSTS
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        return None
    if not loopback:
        return None
    return LOOPBACK_HOSTS if host in LOOPBACK_HOSTS else (*LOOPBACK_HOSTS, host)


def load_chat_template(value: str) -> str:
    """``--chat-template``: the contents of the file ``value`` names, else ``value`` itself
    when it looks like a template (it holds ``{``, ``}`` or a newline), its backslash escapes
    (``\\n``) decoded, as vLLM reads it. Raises
    :class:`~pagedinfer.errors.ConfigurationError` for anything else."""
    try:
        with open(value, encoding="utf-8") as file:
            return file.read()
    except UnicodeDecodeError:
        raise ConfigurationError(
            f"--chat-template {value!r} is not a UTF-8 text file: give a Jinja template file."
        ) from None
    except OSError as error:
        if not any(mark in value for mark in "{}\n"):
            raise ConfigurationError(
                f"--chat-template {value!r} looks like a file path but cannot be read "
                f"({error.strerror or error}): give a template file, or the template itself."
            ) from None
    # Non-Latin-1 characters survive as \uXXXX escapes, decoded back with the others.
    return value.encode("latin-1", "backslashreplace").decode("unicode_escape")


def served_name(model_path: str) -> str:
    """The model name clients send by default: the checkpoint directory's name (its path
    stays on the server), without leading dots (``.demo-model`` is served as ``demo-model``)."""
    name = os.path.basename(os.path.abspath(model_path)).lstrip(".")
    return name or "model"
