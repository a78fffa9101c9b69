"""Hypothesis settings for the property suites in this folder.

The scheduler and block-pool machines apply the ``pagedinfer-property`` profile to themselves
explicitly (it is not loaded globally, so other Hypothesis tests in the session keep their
own settings); the engine suites (``test_engine_machine.py``, ``test_mixed_batches.py``) name
their own, smaller sizes. ``PAGEDINFER_PROPERTY_PROFILE`` picks the size of all of them (see
``profiles.py``):

* ``ci`` (default): 500 examples of up to 50 steps per domain machine, about 20 seconds in
  all on two CPU cores; the engine suites about a minute together;
* ``quick``: a smoke run while editing;
* ``thorough``: a long hunt before a release, ``make fuzz`` (minutes to tens of minutes).

``PAGEDINFER_PROPERTY_PROGRESS=SECONDS`` (``make fuzz`` sets 30) makes every test here print its
example count and elapsed time that often (``progress.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import settings

from .profiles import sized
from .progress import counting_examples, progress_interval, terminal_writer

settings.register_profile(
    "pagedinfer-property",
    sized(
        {
            "ci": {"max_examples": 500, "stateful_step_count": 50},
            "quick": {"max_examples": 25, "stateful_step_count": 30},
            "thorough": {"max_examples": 3000, "stateful_step_count": 100},
        }
    ),
)


@pytest.fixture(autouse=True)
def _report_progress(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    interval = progress_interval()
    if interval is None:
        yield
        return
    write = terminal_writer(request.config)
    with counting_examples(request.node, monkeypatch, interval, write):
        yield
