"""Hypothesis settings for the stateful property suites in this folder.

The machines apply the ``pagedinfer-property`` profile to themselves explicitly (it is not
loaded globally, so other Hypothesis tests in the session keep their own settings). Pick
its size with ``PAGEDINFER_PROPERTY_PROFILE``:

* ``ci`` (default): 500 examples of up to 50 steps per machine, about 20 seconds in all on
  two CPU cores;
* ``quick``: a smoke run while editing;
* ``thorough``: a long hunt before a release (minutes to tens of minutes).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_SIZES = {
    "ci": {"max_examples": 500, "stateful_step_count": 50},
    "quick": {"max_examples": 25, "stateful_step_count": 30},
    "thorough": {"max_examples": 3000, "stateful_step_count": 100},
}

_name = os.environ.get("PAGEDINFER_PROPERTY_PROFILE", "ci")
if _name not in _SIZES:
    raise ValueError(
        f"PAGEDINFER_PROPERTY_PROFILE={_name!r} is unknown: expected one of {sorted(_SIZES)}."
    )

settings.register_profile(
    "pagedinfer-property",
    deadline=None,  # steps vary a lot in cost; timing is the benchmark's job
    print_blob=True,  # a failure prints the @reproduce_failure line to pin it
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    **_SIZES[_name],  # type: ignore[arg-type]
)
