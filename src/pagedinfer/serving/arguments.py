"""`pagedinfer serve`'s own flags: where it listens, what it serves, its security and limits.

The engine's flags come from ``EngineConfig`` (``pagedinfer.engine.config``); these are the
server's, added to the same parser by the command line."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from pagedinfer.serving.options import (
    API_KEY_ENV,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_REQUEST_BYTES,
)
from pagedinfer.serving.reasoning.registry import REASONING_PARSERS
from pagedinfer.serving.tools.parsers import TOOL_CALL_PARSERS

__all__ = ["add_serve_arguments"]


def _port(text: str) -> int:
    """argparse type of ``--port``: an integer in [0, 65535] (0: any free port)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(
            f"port {port} is out of range: expected 0 to 65535 (0 picks a free port)"
        )
    return port


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    """argparse type: a number > 0 of ``kind`` (int or float)."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _host_list(text: str) -> list[str]:
    """argparse type of ``--allowed-hosts``: comma-separated host names."""
    hosts = [part.strip() for part in text.split(",") if part.strip()]
    if not hosts:
        raise argparse.ArgumentTypeError(f"expected comma-separated host names, got {text!r}")
    return hosts


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    """Add the server's flags (not the model's or the engine's) to ``serve``."""
    serve.add_argument("--host", default="127.0.0.1", help="address to bind")
    serve.add_argument(
        "--port", type=_port, default=8000, metavar="N", help="port (0: any free port)"
    )
    serve.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model name clients send (default: MODEL_DIR's directory name)",
    )
    serve.add_argument(
        "--log-level",
        "--uvicorn-log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="log level (uvicorn's and pagedinfer's)",
    )
    requests = serve.add_argument_group("requests (docs/serving.md, Parameters)")
    requests.add_argument(
        "--chat-template",
        default=None,
        metavar="TEMPLATE",
        help="Jinja chat template for every chat: a file, or the template itself (default: "
        "the tokenizer's)",
    )
    requests.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat_template sent in a request (a template is code the server runs)",
    )
    requests.add_argument(
        "--ignore-unknown-fields",
        action="store_true",
        help="log and ignore request fields the server does not know (default: answer 400, "
        "as OpenAI does)",
    )
    requests.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_CALL_PARSERS),
        metavar="NAME",
        help="how tool calls are read from answers with tool_choice 'auto': the model "
        f"family's format ({', '.join(sorted(TOOL_CALL_PARSERS))}; docs/serving.md, Tool "
        "calling)",
    )
    requests.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="serve tool_choice 'auto' (the default of a request with tools); needs "
        "--tool-call-parser",
    )
    requests.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        metavar="NAME",
        help="split a thinking model's answers into reasoning_content and content: the model "
        f"family's markers ({', '.join(sorted(REASONING_PARSERS))}; docs/serving.md, "
        "Reasoning)",
    )
    requests.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="send usage.prompt_tokens_details (the prompt tokens the prefix cache served), as "
        "vLLM does with this flag (default: left out)",
    )
    requests.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        help="serve POST /sleep?level=, /wake_up, /pause, /resume and GET /is_sleeping, "
        "/is_paused (vLLM's development endpoints; behind --api-key; docs/sleep_mode.md)",
    )
    group = serve.add_argument_group("security and limits (docs/serving.md, Deploying)")
    group.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' on every route but /health and /version "
        f"(and /metrics with --metrics-public; default: "
        f"${API_KEY_ENV}, else no key; the variable keeps the key out of the process list)",
    )
    group.add_argument(
        "--metrics-public", action="store_true", help="serve /metrics without the API key"
    )
    group.add_argument(
        "--allowed-hosts",
        action="extend",
        type=_host_list,
        default=None,
        metavar="HOSTS",
        help="comma-separated names the Host header may carry ('*.example.com', '*': any); "
        "default: localhost, 127.0.0.1 and ::1 when bound to a loopback address, else any",
    )
    group.add_argument(
        "--max-request-bytes",
        type=_positive(int),
        default=DEFAULT_MAX_REQUEST_BYTES,
        metavar="N",
        help="largest request body (413 beyond)",
    )
    group.add_argument(
        "--header-timeout-s",
        type=_positive(float),
        default=DEFAULT_HEADER_TIMEOUT_S,
        metavar="X",
        help="seconds a request's line and headers may take (the connection is closed)",
    )
    group.add_argument(
        "--body-timeout-s",
        type=_positive(float),
        default=DEFAULT_BODY_TIMEOUT_S,
        metavar="X",
        help="seconds a request's body may take (408 beyond)",
    )
