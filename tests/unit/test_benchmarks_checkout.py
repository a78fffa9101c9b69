"""Every benchmark runs from a plain checkout: ``python benchmarks/NAME.py`` at the repository
root, with the dependencies installed but pagedinfer itself not installed.

The subprocess starts Python with ``-S`` (no ``.pth`` files, so the editable install of this
environment is invisible) and adds site-packages back by hand: torch and friends import,
``pagedinfer`` only if the script puts ``src/`` on the path itself.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = sorted(p for p in (REPO / "benchmarks").glob("*.py") if not p.name.startswith("_"))

_RUN = """
import runpy, sys
sys.path.append({site!r})
try:
    import pagedinfer
except ModuleNotFoundError:
    pass
else:
    raise AssertionError(f"pagedinfer is importable without the checkout: {{pagedinfer.__file__}}")
script = {script!r}
sys.argv = [script, "--help"]
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as exit:
    if exit.code not in (None, 0):
        raise
"""


@pytest.mark.parametrize("script", BENCHMARKS, ids=[path.name for path in BENCHMARKS])
def test_benchmark_imports_from_a_plain_checkout(script: Path) -> None:
    site = sysconfig.get_paths()["purelib"]
    code = _RUN.format(site=site, script=str(script.relative_to(REPO)))
    result = subprocess.run(
        [sys.executable, "-S", "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "usage" in result.stdout.lower()
