"""Install hints work from where users are: pagedinfer is not on the package index, so no
README, doc, example or message may tell anyone to ``pip install pagedinfer[...]`` by name
(issue 46: all 18 such hints failed with "No matching distribution")."""

from __future__ import annotations

import re
from pathlib import Path

from pagedinfer.errors import install_hint

ROOT = Path(__file__).resolve().parents[2]
# `pip install` (uv's too), its options, then pagedinfer by name: bare, quoted, with extras.
_INDEX_HINT = re.compile(
    r"pip\s+install\s+(?:-{1,2}[\w-]+(?:[= ]\S+)?\s+)*[\"'`]?pagedinfer(?![\w./-])", re.I
)
# A Python string continued on the next line ("pip install " "'pagedinfer[x]'").
_STRING_BREAK = re.compile(r"[\"']\s*\n\s*[rf]?[\"']")


def _scanned() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for folder in ("src", "examples", "benchmarks"):
        files += sorted((ROOT / folder).rglob("*.py"))
    return files


def index_hints(text: str) -> list[str]:
    """The index-install hints of pagedinfer in ``text``, across line breaks."""
    joined = " ".join(_STRING_BREAK.sub("", text).split())
    return [match.group(0) for match in _INDEX_HINT.finditer(joined)]


def test_the_scanner_finds_the_hints_that_fail() -> None:
    for text in (
        "pip install pagedinfer",
        "pip install 'pagedinfer[serve]'",
        'pip install -U "pagedinfer[ray]"',
        "``pip install\npagedinfer``",
        '"needs Ray: pip install "\n    "\'pagedinfer[ray]\'"',
        "uv pip install pagedinfer[engine]",
    ):
        assert index_hints(text), text
    for text in (
        "pip install '.[serve]'",
        "pip install -e '.[dev]'",
        "pip install 'dist/pagedinfer-0.1.0-py3-none-any.whl[engine]'",
        "pip install 'pagedinfer-VERSION-py3-none-any.whl[ray]'",
        "pip install llguidance",
    ):
        assert not index_hints(text), text


def test_no_readme_doc_or_message_installs_pagedinfer_from_the_index() -> None:
    found = {
        str(path.relative_to(ROOT)): hints
        for path in _scanned()
        if (hints := index_hints(path.read_text(encoding="utf-8")))
    }
    assert not found, f"install from the checkout (pip install '.[extra]'), not by name: {found}"


def test_the_hint_in_messages_installs_from_the_checkout() -> None:
    assert install_hint("serve").startswith("pip install '.[serve]' in the pagedinfer checkout")
    assert install_hint().startswith("pip install . in")
