"""Loading a checkpoint's tokenizer, with errors that name the file and what was expected.

The engine reads ``config.json`` (``ModelConfig``) first, so a broken configuration is
reported by our own check before transformers' tokenizer loading, which reads it too, can
fail on it with a bare library error. Tokenizer files are then checked here: every one that
is present must be readable (a dangling link, a symlink loop or a directory in its place is
named), and when transformers cannot build the tokenizer, the file that is not valid JSON is
named with the position of the problem.

Threads: the engine tokenizes in its callers' threads, concurrently, without a lock. A fast
(Rust) tokenizer's ``encode`` and ``decode`` only read it and release the GIL, so that is
safe, as long as nothing changes its truncation or padding settings (transformers' encode
calls do so only when those differ from "none"): :func:`load_tokenizer` switches both off
once, at load, and the engine never passes truncation or padding arguments.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pagedinfer.errors import CheckpointNotFoundError, UnsupportedModelError

__all__ = ["TOKENIZER_FILES", "load_tokenizer", "tokenizer_for"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""A checkpoint has a tokenizer when one of these is present."""
_COMPANION_FILES = ("special_tokens_map.json", "merges.txt", "added_tokens.json")


def load_tokenizer(model_path: str) -> Any:
    """The checkpoint's tokenizer, or None if it has no tokenizer files."""
    directory = Path(model_path)
    if not any(os.path.lexists(directory / name) for name in TOKENIZER_FILES):
        return None
    present = [
        directory / name
        for name in (*TOKENIZER_FILES, *_COMPANION_FILES)
        if os.path.lexists(directory / name)
    ]
    for path in present:
        _check_readable(path)
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except Exception as error:
        for path in present:
            _check_json(path)
        names = ", ".join(path.name for path in present)
        raise UnsupportedModelError(
            f"the tokenizer of checkpoint {model_path!r} ({names}) could not be loaded: "
            f"{type(error).__name__}: {error}. Expected the files a Hugging Face tokenizer's "
            "save_pretrained writes; copy them again from the original checkpoint."
        ) from error
    _no_truncation_or_padding(tokenizer)
    return tokenizer


def tokenizer_for(
    model_path: str, tokenizer: str | os.PathLike[str] | None, *, skip_tokenizer_init: bool
) -> Any:
    """The tokenizer an engine asks for: none (``skip_tokenizer_init``), the model
    directory's (``tokenizer`` is None), or another directory's (which must hold one)."""
    if skip_tokenizer_init:
        return None
    if tokenizer is None:
        return load_tokenizer(model_path)
    directory = os.fspath(tokenizer)
    if not os.path.isdir(directory):
        raise CheckpointNotFoundError(
            f"tokenizer={directory!r} is not a directory: pass the local directory that holds "
            "the tokenizer files (tokenizer.json, tokenizer_config.json, ...), or leave "
            "tokenizer out to use the model directory's. pagedinfer never downloads; get a "
            "Hub tokenizer with: hf download REPO --local-dir DIR"
        )
    loaded = load_tokenizer(directory)
    if loaded is None:
        raise UnsupportedModelError(
            f"tokenizer={directory!r} holds no tokenizer files (one of "
            f"{', '.join(TOKENIZER_FILES)}): pass a directory that does."
        )
    return loaded


def _no_truncation_or_padding(tokenizer: Any) -> None:
    """Settle a fast tokenizer's truncation and padding to "none" now, from one thread.

    transformers' ``encode`` resets them to "none" on every call where they are set (a
    ``tokenizer.json`` may enable either); that reset mutates the Rust tokenizer, which
    fails ("Already borrowed") or races while another thread encodes. Once both are off,
    encode and decode only read it.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow (pure-Python) tokenizer: no such settings
        return
    if backend.truncation is not None:
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()


def _check_readable(path: Path) -> None:
    try:
        with path.open("rb") as file:
            file.read(1)
    except OSError as error:
        raise UnsupportedModelError(
            f"tokenizer file {str(path)!r} cannot be read ({error.strerror or error}): expected "
            "a regular file; replace it with the checkpoint's original."
        ) from error


def _check_json(path: Path) -> None:
    if path.suffix != ".json":
        return
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UnsupportedModelError(
            f"tokenizer file {str(path)!r} is not valid JSON ({error}): it is corrupt or "
            "truncated; copy it again from the original checkpoint."
        ) from error
