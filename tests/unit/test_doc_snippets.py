"""Every ```python block of the README and docs/ runs, and every ``pagedinfer ...`` command
line of their shell blocks parses, so that a doc cannot rot (issue 46: docs/structured-
outputs.md's snippets failed verbatim).

A Python block runs in a fresh namespace, as a reader pastes it, with each checkpoint path
(``/path/to/...``, ``/models/...``) replaced by one shared tiny random checkpoint. A block
that needs what CI has not (a GPU, a Ray cluster, a running server, your own executor) or is
a signature rather than a program is marked in the doc by the line before its fence:
``<!-- snippet: skip REASON -->``; the test keeps that list short and each reason stated.
"""

from __future__ import annotations

import asyncio
import re
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pagedinfer.cli import _build_parser, _resolve_model

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_SKIP = re.compile(r"<!-- snippet: skip (.+?) -->\s*$")
_MODEL_PATH = re.compile(r"""(["'])(?:/path/to/|/models/)[^"']*\1""")
MAX_SKIPPED = 12  # signatures, Ray, a server, your executor, a real tokenizer (raise with care)


@dataclass(frozen=True)
class Block:
    doc: str
    line: int
    language: str
    code: str
    skip: str | None  # the reason, for a block marked to skip

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}"


def _blocks() -> Iterator[Block]:
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for match in _FENCE.finditer(text):
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            skip = _SKIP.search(before)
            yield Block(
                doc=str(path.relative_to(ROOT)),
                line=text.count("\n", 0, match.start()) + 1,
                language=match.group(1),
                code=match.group(2),
                skip=skip.group(1) if skip else None,
            )


PYTHON = [block for block in _blocks() if block.language == "python"]
SHELL = [block for block in _blocks() if block.language in ("bash", "sh", "shell", "console")]


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny", with_tokenizer=True)


def test_few_blocks_are_skipped_and_each_says_why() -> None:
    skipped = [block for block in PYTHON if block.skip is not None]
    assert len(skipped) <= MAX_SKIPPED, [f"{block}: {block.skip}" for block in skipped]
    assert len(PYTHON) - len(skipped) >= 6  # the runner runs something


@pytest.mark.parametrize("block", [b for b in PYTHON if b.skip is None], ids=str)
def test_python_block_runs(block: Block, checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code = _MODEL_PATH.sub(repr(str(checkpoint)), block.code)
    monkeypatch.setattr("builtins.print", lambda *args, **kwargs: None)
    namespace: dict[str, object] = {"__name__": "__snippet__"}
    try:
        exec(compile(code, str(block), "exec"), namespace)  # the docs' own code
    finally:
        for value in namespace.values():  # engines a snippet leaves open
            close = getattr(value, "close", None)
            if callable(close) and type(value).__module__.startswith("pagedinfer."):
                result = close()
                if asyncio.iscoroutine(result):
                    asyncio.run(result)


def _command_lines(block: Block) -> Iterator[list[str]]:
    """The ``pagedinfer`` / ``python -m pagedinfer`` command lines of a shell block, joined
    across backslash continuations, without comments and the prompt."""
    for line in block.code.replace("\\\n", " ").splitlines():
        line = line.strip().removeprefix("$ ")
        if not line.startswith(("pagedinfer ", "python -m pagedinfer ")):
            continue
        words = [word.strip("[]") for word in shlex.split(line, comments=True)]  # [--opt X]
        if words[0] == "python":
            words = words[2:]
        if "|" not in words and words[-1] != "...":  # "python -m pagedinfer ...": a pattern
            yield words[1:]


@pytest.mark.parametrize("block", [b for b in SHELL if b.skip is None], ids=str)
def test_shell_blocks_pagedinfer_commands_parse(block: Block, checkpoint: Path) -> None:
    for argv in _command_lines(block):
        argv = [_MODEL_PATH.sub(str(checkpoint), f'"{word}"').strip('"') for word in argv]
        command = next((word for word in argv if not word.startswith("-")), None)
        parser = _build_parser(engine_commands=(command,) if command else ())
        try:
            args = parser.parse_args(argv)
        except SystemExit as exit_:
            if exit_.code == 0:  # --help, --version
                continue
            message = f"{block}: pagedinfer {shlex.join(argv)} does not parse"
            raise AssertionError(message) from None
        _resolve_model(args)
