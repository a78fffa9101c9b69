"""Print pip constraints that pin pagedinfer's dependencies at their lower bounds.

``make test-deps-lowest`` installs with these (``pip install -c FILE``) to check that the
lower bounds declared in ``pyproject.toml`` really work. Reads ``[project].dependencies``
and the extras named on the command line (default: ``test``), following references to
pagedinfer's own extras (``pagedinfer[ray]``). Every requirement must name a ``>=`` bound:
one without is an error, since the run could not say what the lowest version is.

    python tests/deps/lowest_constraints.py [EXTRA ...] > lowest.txt
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*([^;]*?)\s*(;.*)?$")


def lower_bound_constraints(project: dict[str, object], extras: list[str]) -> list[str]:
    """``name==lowest[; marker]`` for every requirement of the project and ``extras``."""
    optional = project.get("optional-dependencies", {})
    assert isinstance(optional, dict)
    name = project["name"]
    pending: list[str] = list(project.get("dependencies", []))  # type: ignore[call-overload]
    seen_extras: set[str] = set()
    for extra in extras:
        if extra not in optional:
            raise SystemExit(f"unknown extra {extra!r}: pyproject.toml has {sorted(optional)}")
        pending.extend(optional[extra])
        seen_extras.add(extra)
    pins: list[str] = []
    while pending:
        requirement = pending.pop(0)
        match = _REQUIREMENT.match(requirement)
        if match is None:
            raise SystemExit(f"cannot read the requirement {requirement!r}")
        package, package_extras, specifiers, marker = match.groups()
        if package == name:  # pagedinfer[ray]: follow the extras it names
            for extra in (package_extras or "[]")[1:-1].split(","):
                extra = extra.strip()
                if extra and extra not in seen_extras:
                    seen_extras.add(extra)
                    pending.extend(optional[extra])
            continue
        lower = [s.strip()[2:].strip() for s in specifiers.split(",") if s.strip().startswith(">=")]
        if len(lower) != 1:
            raise SystemExit(
                f"{requirement!r} names no single '>=' lower bound: give it one in "
                "pyproject.toml (the lowest version a `make test-deps` run passed)."
            )
        pins.append(f"{package}=={lower[0]}{marker or ''}")
    return pins


def main(argv: list[str]) -> int:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        print("lowest_constraints.py needs Python >= 3.11 (tomllib).", file=sys.stderr)
        return 2
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for pin in lower_bound_constraints(project, argv or ["test"]):
        print(pin)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
