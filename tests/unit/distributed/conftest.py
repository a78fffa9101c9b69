"""Registers the ``tensor_parallel`` marker: ``pytest -m tensor_parallel`` runs the TP tests."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "tensor_parallel: spawns tensor-parallel worker processes (gloo on the CPU)",
    )
