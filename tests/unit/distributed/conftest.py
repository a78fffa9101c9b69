"""Registers the ``tensor_parallel`` and ``ray`` markers: ``pytest -m tensor_parallel`` runs the
TP tests, ``pytest -m ray`` the ones on a local Ray cluster."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "tensor_parallel: spawns tensor-parallel worker processes (gloo on the CPU)",
    )
    config.addinivalue_line("markers", "ray: starts a local Ray cluster")
