"""What a newcomer reads at start-up agrees with the docs: the served name of a hidden
directory (``make demo``'s ``.demo-model``) and the routes ``--api-key`` leaves open (issue 46)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pagedinfer.cli import main
from pagedinfer.serving.options import served_name

DOCS = Path(__file__).resolve().parents[3] / "docs" / "serving.md"


def test_the_served_name_drops_leading_dots() -> None:
    assert served_name(".demo-model") == "demo-model"
    assert served_name("/models/Qwen3-0.6B/") == "Qwen3-0.6B"
    assert served_name("/tmp/...") == "model"


def test_api_key_help_and_docs_name_the_same_open_routes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    (row,) = [line for line in DOCS.read_text().splitlines() if line.startswith("| `--api-key`")]
    start = help_text.index("--api-key KEY require")
    for text in (help_text[start:][:300], row):
        open_routes = set(re.findall(r"/(health|version|metrics)\b", text))
        assert open_routes == {"health", "version", "metrics"}, text
