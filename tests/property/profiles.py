"""How long the property suites in this folder run: ``PAGEDINFER_PROPERTY_PROFILE``.

* ``ci`` (default): the sizes ``make test`` affords on two CPU cores;
* ``quick``: a smoke run while editing;
* ``thorough``: a long hunt before a release (``make fuzz``: minutes to tens of minutes).

Each suite names its own sizes per profile (examples, steps); :func:`sized` turns them into
Hypothesis settings for the profile chosen.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from hypothesis import HealthCheck, settings

PROFILES = ("ci", "quick", "thorough")
PROFILE = os.environ.get("PAGEDINFER_PROPERTY_PROFILE", "ci")
if PROFILE not in PROFILES:
    raise ValueError(
        f"PAGEDINFER_PROPERTY_PROFILE={PROFILE!r} is unknown: expected one of {list(PROFILES)}."
    )


def sized(sizes: Mapping[str, Mapping[str, int]]) -> settings:
    """Settings for the chosen profile: ``sizes[profile]`` holds ``max_examples`` (and
    ``stateful_step_count`` for state machines)."""
    return settings(
        deadline=None,  # steps vary a lot in cost; timing is the benchmark's job
        print_blob=True,  # a failure prints the @reproduce_failure line to pin it
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.function_scoped_fixture,
        ],
        **sizes[PROFILE],  # type: ignore[arg-type]
    )
