"""Packaging: metadata a fresh build accepts (issue 11.11: one version, a license file), what a
CPU install needs and the bounds make test-deps tries (issue 22.13, 22.14, 22.16)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from core_env import build_core_venv, mypy_strict  # tests/unit/core_env.py
from core_env import run as run_core

import pagedinfer

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[2]


def test_the_version_has_one_source() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"]
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "pagedinfer.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", pagedinfer.__version__)


def test_the_license_field_matches_the_build_backend() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "MIT"  # an SPDX string: setuptools >= 77
    requires = project["build-system"]["requires"]
    minimum = next(r for r in requires if r.startswith("setuptools"))
    assert int(minimum.split(">=")[1].split(".")[0]) >= 77
    assert project["project"]["license-files"] == ["LICENSE"]
    assert "MIT License" in (ROOT / "LICENSE").read_text()


def _project() -> dict[str, Any]:
    project: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project


def test_triton_is_a_test_dependency_not_a_runtime_one() -> None:
    """A CPU install never compiles a kernel (issue 22.13): triton (about 1 GB) comes with
    torch's CUDA wheels, and [test] installs it for the interpreter tests."""
    project = _project()
    assert not [r for r in project["dependencies"] if r.startswith("triton")]
    extras = project["optional-dependencies"]
    assert [r for r in extras["test"] if r.startswith("triton")] == [
        "triton>=3.6; sys_platform == 'linux'"
    ]
    assert "pagedinfer[test]" in extras["dev"]


def test_every_requirement_names_the_lower_bound_make_test_deps_installs() -> None:
    """make test-deps-lowest pins each requirement of the package and of [test] at its '>='
    bound; one without a bound could not be tried."""
    sys.path.insert(0, str(ROOT / "tests" / "deps"))
    try:
        from lowest_constraints import lower_bound_constraints
    finally:
        sys.path.remove(str(ROOT / "tests" / "deps"))
    project = _project()
    pins = lower_bound_constraints(project, ["test"])
    assert "torch==2.13" in pins and "transformers==4.56" in pins  # [test] names [engine]
    assert "triton==3.6; sys_platform == 'linux'" in pins
    extras = project["optional-dependencies"]
    followed = [project["dependencies"], extras["engine"], extras["test"], extras["structured"]]
    requirements = [r for group in followed for r in group if not r.startswith("pagedinfer[")]
    assert len(pins) == len(requirements)
    assert lower_bound_constraints(project, []) == ["xxhash==3.4.1"]  # the core install
    with pytest.raises(SystemExit, match="no single '>=' lower bound"):
        lower_bound_constraints({**project, "dependencies": ["torch"]}, [])
    # Extras that name others are followed (dev -> test, ray, serve).
    assert "ray==2.44" in lower_bound_constraints(project, ["dev"])


def test_the_core_install_is_the_domain_and_the_engine_an_extra() -> None:
    """pip install pagedinfer brings what pagedinfer.domain needs (xxhash) and nothing heavy;
    [engine] brings torch, transformers and safetensors, and every extra that runs the engine
    names it (issue 29.4)."""
    project = _project()
    assert project["dependencies"] == ["xxhash>=3.4.1"]
    extras = project["optional-dependencies"]
    engine = [r.split(">=")[0] for r in extras["engine"]]
    assert {"torch", "transformers", "safetensors"} <= set(engine)
    for extra in ("test", "serve", "ray"):
        assert "pagedinfer[engine]" in extras[extra], extra


def test_the_metadata_names_license_classifiers_and_keywords() -> None:
    project = _project()
    assert project["authors"] == [{"name": "the pagedinfer contributors"}]
    assert "the pagedinfer contributors" in (ROOT / "LICENSE").read_text()
    assert "Programming Language :: Python :: 3.11" in project["classifiers"]
    assert "Typing :: Typed" in project["classifiers"]
    # An SPDX license string forbids license classifiers (setuptools >= 77 refuses both).
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]
    assert {"llm", "inference", "paged-attention"} <= set(project["keywords"])


_CPU_ENGINE_WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # `import triton` raises ImportError; find_spec says absent
from pagedinfer import Engine, SamplingParams
with Engine(sys.argv[1], device="cpu", max_model_len=64) as engine:
    output = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0),
                             use_tqdm=False)[0]
print(len(output.outputs[0].token_ids))
"""


def test_a_cpu_engine_runs_without_triton(make_checkpoint: Callable[..., Path]) -> None:
    """CPU inference imports no triton (its kernels load lazily, only for the triton and
    flash backends and CUDA sampling), so a CPU install without it works (issue 22.13)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", _CPU_ENGINE_WITHOUT_TRITON, str(make_checkpoint())],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[0] == "4"


def _make_dry_run(target: str, tmp_path: Path) -> list[str]:
    """The commands ``make TARGET`` would run for a venv that does not exist yet."""
    result = subprocess.run(
        ["make", "-n", "-C", str(ROOT), target, f"VENV={tmp_path / 'venv'}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_installs_the_package_alone_and_make_test_everything(tmp_path: Path) -> None:
    """make demo installs what inference needs, not [dev] (ray, pyarrow, mypy, triton: 2.5 GB
    instead of 1.2 GB); make test still installs everything from nothing (issue 22.13)."""
    demo = [line for line in _make_dry_run("demo", tmp_path) if "pip install" in line]
    assert any(line.endswith("torch==2.13.0") for line in demo)
    assert any(line.endswith("-e '.[engine]'") for line in demo)  # the engine, not the core
    assert not [line for line in demo if "[dev]" in line or "[test]" in line]
    test = _make_dry_run("test", tmp_path)
    assert any(line.endswith("-e '.[dev]'") for line in test)
    assert any("pytest" in line for line in test)


# ----------------------------------------------------------------- the core install (issue 29)


@pytest.fixture(scope="module")
def core_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv holding pagedinfer and xxhash only (``tests/unit/core_env.py``)."""
    return build_core_venv(tmp_path_factory.mktemp("core") / "venv")


_CORE_SCRIPT = """
import sys
from pagedinfer.domain import SamplingParams, Scheduler, SchedulerConfig, Sequence, StepOutput
from pagedinfer.errors import MissingDependencyError

scheduler = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, max_model_len=32))
scheduler.add(Sequence(0, [1, 2, 3], SamplingParams(max_tokens=3)))
while (plan := scheduler.schedule()) is not None:
    scheduler.postprocess(plan, StepOutput([7] * plan.num_samples).sampled_token_ids)
for name in ("torch", "triton", "transformers", "numpy"):
    try:
        __import__(name)
    except ImportError:
        continue
    sys.exit(f"{name} is importable: not a core install")
import pagedinfer
messages = []
for load in (
    lambda: pagedinfer.Engine,
    lambda: __import__("pagedinfer.engine"),
    lambda: __import__("pagedinfer.adapters.kv_cache"),
):
    try:
        load()
    except MissingDependencyError as error:
        messages.append(str(error))
print("\\n".join(messages))
"""


def test_the_core_install_runs_the_domain_and_names_the_extra_for_the_engine(
    core_python: Path,
) -> None:
    """Without torch, triton or transformers installed (not blocked: absent), the domain runs a
    request, and everything that needs torch says which extra to install (issue 29.4)."""
    result = run_core(core_python, "-c", _CORE_SCRIPT)
    assert result.returncode == 0, result.stderr[-3000:]
    messages = result.stdout.strip().splitlines()
    assert len(messages) == 3, result.stdout
    for message in messages:
        assert "torch, safetensors, transformers" in message
        assert "pip install '.[engine]' in the pagedinfer checkout" in message


_DOMAIN_ONLY_SCRIPT = """
from pagedinfer.domain import (
    BatchPlan, Executor, SamplingParams, Scheduler, SchedulerConfig, Sequence, StepOutput,
)


class Echo:
    def execute(self, plan: BatchPlan) -> StepOutput:
        return StepOutput(plan.input_ids[-1:].tolist() * plan.num_samples)


def main() -> list[int]:
    config = SchedulerConfig(num_blocks=8, block_size=4, scheduling_policy="mixed")
    scheduler = Scheduler(config, record_events=True)
    seq = Sequence(0, [1, 2, 3], SamplingParams(max_tokens=3))
    scheduler.add(seq)
    executor: Executor = Echo()
    while (plan := scheduler.schedule()) is not None:
        scheduler.postprocess(plan, executor.execute(plan).sampled_token_ids)
    return seq.completion_token_ids
"""


@pytest.mark.parametrize("source_checkout", [False, True], ids=["installed", "checkout"])
def test_mypy_strict_of_domain_only_code_needs_no_torch(
    core_python: Path, tmp_path: Path, source_checkout: bool
) -> None:
    """A domain-only script type-checks strictly where torch is not installed: against the
    installed package as it is, and against a checkout with the documented
    ``--always-true=PAGEDINFER_DOMAIN_ONLY`` (without it the root's engine names make mypy
    read the engine; 90 errors without torch). A policy typo is a type error."""
    script = tmp_path / "domain_only.py"
    script.write_text(_DOMAIN_ONLY_SCRIPT)
    result = mypy_strict(
        core_python, str(script), cache_dir=tmp_path / "cache", source_checkout=source_checkout
    )
    assert result.returncode == 0, result.stdout[-3000:]
    script.write_text(_DOMAIN_ONLY_SCRIPT.replace('"mixed"', '"mixd"'))
    result = mypy_strict(
        core_python, str(script), cache_dir=tmp_path / "cache", source_checkout=source_checkout
    )
    assert result.returncode == 1 and "Literal['mixd']" in result.stdout, result.stdout[-3000:]
