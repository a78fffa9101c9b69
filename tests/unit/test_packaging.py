"""Packaging metadata a fresh build accepts (issue 11.11): one version, a license file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import pagedinfer

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[2]


def test_the_version_has_one_source() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"]
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "pagedinfer.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", pagedinfer.__version__)


def test_the_license_field_matches_the_build_backend() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "MIT"  # an SPDX string: setuptools >= 77
    requires = project["build-system"]["requires"]
    minimum = next(r for r in requires if r.startswith("setuptools"))
    assert int(minimum.split(">=")[1].split(".")[0]) >= 77
    assert project["project"]["license-files"] == ["LICENSE"]
    assert "MIT License" in (ROOT / "LICENSE").read_text()
