"""A virtual environment with the core install only: no torch, triton or transformers.

``pip install pagedinfer`` installs the package and xxhash (pyproject.toml). Tests that check
what works there build this venv once per session (a fifth of a second): a fresh
``python -m venv --without-pip``, whose site-packages holds a copy of ``src/pagedinfer`` (as a
non-editable install puts it) and links to the packages asked for, taken from the test's own
environment (xxhash always; numpy for the NumPy example). torch is not blocked there: it is
absent, as on an embedder's machine.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def build_core_venv(root: Path, packages: tuple[str, ...] = ("xxhash",)) -> Path:
    """Create the venv under ``root``; return its Python executable."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120
    )
    python = root / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    shutil.copytree(
        REPO / "src" / "pagedinfer", site / "pagedinfer", ignore=shutil.ignore_patterns("*.pyc")
    )
    for name in packages:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.submodule_search_locations, name
        source = Path(next(iter(spec.submodule_search_locations)))
        (site / name).symlink_to(source, target_is_directory=True)
        libs = source.parent / f"{name}.libs"  # manylinux wheels' shared libraries
        if libs.is_dir():
            (site / libs.name).symlink_to(libs, target_is_directory=True)
    return python


def run(python: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run the venv's Python (no PYTHONPATH: only what the venv holds is importable)."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    return subprocess.run(
        [str(python), *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO
    )


def mypy_strict(
    python: Path, *paths: str, cache_dir: Path, source_checkout: bool
) -> subprocess.CompletedProcess[str]:
    """``mypy --strict`` of ``paths`` against the venv's packages (torch is not there).

    ``source_checkout``: pagedinfer is read from ``src/`` (errors in it are reported, as for a
    checkout on ``MYPYPATH``), with ``--always-true=PAGEDINFER_DOMAIN_ONLY``; otherwise from
    the venv's installed copy, without flags.
    """
    mypy = Path(sys.executable).parent / "mypy"
    cache_dir.mkdir(parents=True, exist_ok=True)
    config = cache_dir / "mypy.ini"  # not the checkout's pyproject.toml
    config.write_text("[mypy]\n")
    command = [
        str(mypy),
        "--strict",
        f"--config-file={config}",
        f"--python-executable={python}",
        f"--cache-dir={cache_dir}",
        "--python-version=3.11",
    ]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    if source_checkout:
        command.append("--always-true=PAGEDINFER_DOMAIN_ONLY")
        env["MYPYPATH"] = str(REPO / "src")
    return subprocess.run(
        [*command, *paths], capture_output=True, text=True, env=env, timeout=300, cwd=REPO
    )
