"""Code the Ray tests ship to their actors (importable there: the cluster's PYTHONPATH has
this directory's parent)."""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from typing import Any

from pagedinfer.ray import EnginePredictor


class KillOncePredictor(EnginePredictor):
    """An ``EnginePredictor`` whose process dies by ``SIGKILL`` (as an OOM kill would) in the
    middle of its second batch, after generating and before returning.

    Only the first actor to get there dies: it claims ``marker`` (created exclusively, holding
    its pid), so the actor Ray restarts, and every other actor, runs normally.
    """

    def __init__(self, *, marker: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._marker = marker
        self._calls = 0

    def __call__(self, batch: Mapping[str, Any]) -> Any:
        self._calls += 1
        result = super().__call__(batch)
        if self._calls == 2 and _claim(self._marker):
            os.kill(os.getpid(), signal.SIGKILL)
        return result


def _claim(path: str) -> bool:
    try:
        descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(descriptor, "w") as marker:
        marker.write(str(os.getpid()))
    return True
