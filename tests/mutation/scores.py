"""Mutation scores per module from mutmut's results in ``mutants/`` (``make mutation``).

Prints a Markdown table (the one docs/testing.md keeps): per mutated file, how many mutants
were killed (a test failed), survived (every test that runs the mutated function passed),
timed out, or had no test that runs the function at all; the score is killed / (killed +
survived + timeouts + no tests). Mutants of the integrity checks that only tests call
(``TEST_SUPPORT``) are counted apart, in the last column, and not in the score.
``--survivors`` lists the surviving mutants by name (``mutmut show NAME`` prints one's diff);
``--diffs`` lists them as a Markdown table of the original and the mutated line.

Run from the repository root after ``mutmut run``: ``python tests/mutation/scores.py``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

# mutmut's exit codes (mutmut/stats.py): 1 and 3 a test failed, 0 every test passed, 5 and 33
# no test ran the function, 34 skipped, None not run yet, the others a timeout. mutmut counts
# timeouts as killed; here they are shown apart and not counted as killed (a mutant that loops
# forever is killed, but one whose tests were only slow on a busy machine is not).
KILLED = {1, 3}
TIMEOUT = {36, 24, -24, 152, 255}
SURVIVED = {0}
NO_TESTS = {5, 33}
NOT_RUN = {None, 34}
# Functions that exist for the tests (consistency checks they call between steps), not
# behaviour: their mutants are reported apart.
TEST_SUPPORT = (
    "ǁBlockPoolǁcheck_integrity__",
    "ǁSchedulerǁcheck_integrity__",
    "ǁSchedulerǁ_check_slots__",
    "ǁSchedulerǁ_check_forks_state__",
    "ǁDecodeBatchǁcheck__",
)


def is_test_support(name: str) -> bool:
    return any(marker in name for marker in TEST_SUPPORT)


def collect(root: Path) -> dict[str, dict[str, int | None]]:
    """Exit code per mutant name, per mutated source file (relative to ``root``/src)."""
    results: dict[str, dict[str, int | None]] = {}
    for meta in sorted((root / "src").rglob("*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        if codes:
            module = str(meta.relative_to(root / "src")).removesuffix(".meta")
            results[module] = codes
    return results


def table(results: dict[str, dict[str, int | None]]) -> list[str]:
    lines = [
        "| module | mutants | killed | survived | timeout | no tests | not run | score | "
        "test support |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for module, all_codes in results.items():
        codes = {k: v for k, v in all_codes.items() if not is_test_support(k)}
        support = len(all_codes) - len(codes)
        count = Counter(
            "killed"
            if code in KILLED
            else "timeout"
            if code in TIMEOUT
            else "survived"
            if code in SURVIVED
            else "no tests"
            if code in NO_TESTS
            else "not run"
            if code in NOT_RUN
            else "other"
            for code in codes.values()
        )
        tested = (
            count["killed"]
            + count["survived"]
            + count["timeout"]
            + count["no tests"]
            + count["other"]
        )
        score = f"{100 * count['killed'] / tested:.1f} %" if tested else "-"
        lines.append(
            f"| {module} | {len(codes)} | {count['killed']} | {count['survived']} | "
            f"{count['timeout']} | {count['no tests']} | {count['not run']} | {score} | "
            f"{support} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutants", type=Path, default=Path("mutants"), help="mutmut's folder")
    parser.add_argument("--survivors", action="store_true", help="list the surviving mutants")
    parser.add_argument(
        "--diffs", action="store_true", help="the survivors' lines, original and mutated"
    )
    args = parser.parse_args(argv)
    results = collect(args.mutants)
    if not results:
        print(f"no mutmut results under {args.mutants}/src: run `make mutation` first.")
        return 1
    print("\n".join(table(results)))
    survivors = [
        name
        for codes in results.values()
        for name, code in codes.items()
        if (code in SURVIVED or code in NO_TESTS) and not is_test_support(name)
    ]
    if args.survivors:
        print()
        print("\n".join(survivors))
    if args.diffs:
        print()
        print("| mutant | original | mutant |")
        print("| --- | --- | --- |")
        for name in survivors:
            removed, added = diff_lines(name)
            print(f"| `{short_name(name)}` | {cell(removed)} | {cell(added)} |")
    return 0


def diff_lines(name: str) -> tuple[list[str], list[str]]:
    """The lines ``mutmut show`` removes and adds for one mutant."""
    shown = subprocess.run(
        [sys.executable, "-m", "mutmut", "show", name], capture_output=True, text=True
    ).stdout
    lines = shown.splitlines()
    removed = [line[1:].strip() for line in lines if line[:1] == "-" and line[:3] != "---"]
    added = [line[1:].strip() for line in lines if line[:1] == "+" and line[:3] != "+++"]
    return removed, added


def short_name(name: str) -> str:
    """``pagedinfer.domain.plan.xǁCǁf__mutmut_3`` as ``plan.C.f #3``."""
    module, _, rest = name.rpartition(".")
    function, _, number = rest.rpartition("__mutmut_")
    function = function.removeprefix("x_").removeprefix("x").strip("ǁ").replace("ǁ", ".")
    return f"{module.rpartition('.')[2]}.{function} #{number}"


def cell(lines: list[str]) -> str:
    text = " ".join(lines).replace("|", "\\|")
    return f"`{text}`" if text else ""


if __name__ == "__main__":
    sys.exit(main())
