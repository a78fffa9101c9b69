"""The layer rules of SPEC §2, checked the way they can actually fail.

Import hygiene is checked in fresh interpreters: in this process earlier tests have already
imported torch, so ``"torch" in sys.modules`` here would say nothing about pagedinfer.
The import-linter contracts in ``pyproject.toml`` are run against a copy of the package, once
unmodified (it must pass) and once per injected violation (it must fail, naming the contract),
so the check itself is shown to bite.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
PACKAGE = SRC / "pagedinfer"
HEAVY = ("torch", "numpy", "triton", "transformers", "safetensors")

LAYERS_CONTRACT = "Layers point downward"
PURE_DOMAIN_CONTRACT = "The domain layer is pure Python"
LIGHT_ROOT_CONTRACT = "The package root imports no heavy dependency"
MODELS_CONTRACT = "Models: the registry on top, families side by side, the decoder below"
LIGHT_RAY_CONTRACT = "import pagedinfer.ray stays light"
LIGHT_SERVING_CONTRACT = "import pagedinfer.serving stays light"


def _run_python(code: str, *, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter that imports pagedinfer from this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


def _assert_ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"


# A snippet that reports which heavy packages a fresh interpreter has loaded.
_REPORT_HEAVY = f"""
import sys
loaded = sorted(name for name in sys.modules if name.split(".")[0] in {HEAVY!r})
assert not loaded, f"heavy modules were imported: {{loaded}}"
"""


def test_import_domain_loads_no_heavy_package() -> None:
    _assert_ok(_run_python("import pagedinfer.domain\n" + _REPORT_HEAVY))


def test_import_package_and_sampling_params_load_no_heavy_package() -> None:
    code = """
    import pagedinfer
    params = pagedinfer.SamplingParams(temperature=0.0, max_tokens=4)
    assert params.is_greedy
    assert "pagedinfer.engine" not in sys.modules
    """
    _assert_ok(_run_python("import sys\n" + textwrap.dedent(code) + _REPORT_HEAVY))


def test_domain_works_where_torch_cannot_be_imported() -> None:
    # A meta-path finder that refuses torch & co. stands in for "torch is not installed".
    code = f"""
    import sys

    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {HEAVY!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)")
            return None

    sys.meta_path.insert(0, Refuse())
    for name in {HEAVY!r}:
        try:
            __import__(name)
        except ImportError:
            pass
        else:
            raise SystemExit(f"the blocker failed: {{name}} imported")

    from pagedinfer.domain import Scheduler, SchedulerConfig, SamplingParams, Sequence

    # Not just importable: one request runs through schedule/postprocess.
    scheduler = Scheduler(SchedulerConfig(num_blocks=4, block_size=4, max_model_len=16))
    scheduler.add(Sequence(0, [1, 2, 3, 4, 5], SamplingParams(max_tokens=2)))
    steps = 0
    while (plan := scheduler.schedule()) is not None:
        scheduler.postprocess(plan, [7] * plan.num_samples)
        steps += 1
    assert steps == 2 and not scheduler.has_unfinished(), steps
    print("domain ok without torch")
    """
    result = _run_python(code)
    _assert_ok(result)
    assert "domain ok without torch" in result.stdout


def test_engine_is_imported_lazily_on_first_access() -> None:
    if not (PACKAGE / "engine" / "engine.py").exists():
        pytest.skip("pagedinfer/engine/engine.py does not exist yet; nothing to load lazily")
    code = """
    import sys
    import pagedinfer

    assert "pagedinfer.engine.engine" not in sys.modules
    assert "torch" not in sys.modules
    engine_class = pagedinfer.Engine
    assert "pagedinfer.engine.engine" in sys.modules
    assert engine_class.__module__ == "pagedinfer.engine.engine", engine_class.__module__
    assert engine_class is sys.modules["pagedinfer.engine.engine"].Engine
    """
    _assert_ok(_run_python(code))


# ------------------------------------------------------------------ import-linter contracts


def _lint_imports_command() -> list[str]:
    pytest.importorskip("importlinter", reason="import-linter is a dev dependency")
    script = Path(sys.executable).with_name("lint-imports")
    if script.exists():
        return [str(script)]
    found = shutil.which("lint-imports")
    if found is None:
        pytest.skip("import-linter is installed but its lint-imports script is not on PATH")
    return [found]


def _copy_package(tmp_path: Path) -> Path:
    """A copy of src/pagedinfer plus the project's contracts, ready for lint-imports."""
    shutil.copytree(
        PACKAGE, tmp_path / "src" / "pagedinfer", ignore=shutil.ignore_patterns("__pycache__")
    )
    # The whole pyproject: lint-imports reads only [tool.importlinter], so the contracts
    # checked here are exactly the ones `make layers` checks.
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path / "src" / "pagedinfer"


def _lint(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    # The copy must shadow the editable install of the real tree.
    env["PYTHONPATH"] = str(tmp_path / "src")
    return subprocess.run(
        [
            *_lint_imports_command(),
            "--config",
            str(tmp_path / "pyproject.toml"),
            "--no-cache",
            "--no-logo",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def _inject(module: Path, line: str) -> None:
    assert module.exists(), f"{module} is gone; pick another module for this check"
    module.write_text(module.read_text() + f"\n{line}  # injected by test_layering\n")


def test_contracts_hold_on_an_unmodified_copy(tmp_path: Path) -> None:
    _copy_package(tmp_path)
    result = _lint(tmp_path)
    hint = (
        "\nHint: a chain step '<module> -> pagedinfer (l.N)' usually means line N imports a "
        "module that does not exist (yet); import-linter resolves it to the package root, "
        "which refers to the engine."
    )
    assert result.returncode == 0, result.stdout + result.stderr + hint
    assert "BROKEN" not in result.stdout
    for contract in (
        LAYERS_CONTRACT,
        PURE_DOMAIN_CONTRACT,
        LIGHT_ROOT_CONTRACT,
        MODELS_CONTRACT,
        LIGHT_RAY_CONTRACT,
        LIGHT_SERVING_CONTRACT,
    ):
        assert contract in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract", "reported"),
    [
        pytest.param(
            "domain/hashing.py",
            "import torch",
            PURE_DOMAIN_CONTRACT,
            "pagedinfer.domain.hashing -> torch",
            id="domain-imports-torch",
        ),
        pytest.param(
            "domain/plan.py",
            "import numpy",
            PURE_DOMAIN_CONTRACT,
            "pagedinfer.domain.plan -> numpy",
            id="domain-imports-numpy",
        ),
        pytest.param(
            "domain/scheduler/core.py",
            "import pagedinfer.adapters.runner_config",
            LAYERS_CONTRACT,
            "pagedinfer.domain.scheduler.core -> pagedinfer.adapters.runner_config",
            id="domain-imports-adapters",
        ),
        pytest.param(
            "adapters/runner_config.py",
            "import pagedinfer.engine",
            LAYERS_CONTRACT,
            "pagedinfer.adapters.runner_config -> pagedinfer.engine",
            id="adapters-import-engine",
        ),
        pytest.param(
            "errors.py",
            "import pagedinfer.domain.sequence",
            LAYERS_CONTRACT,
            "pagedinfer.errors -> pagedinfer.domain.sequence",
            id="errors-import-domain",
        ),
        pytest.param(
            "adapters/models/config.py",
            "import pagedinfer.adapters.models.registry",
            MODELS_CONTRACT,
            "pagedinfer.adapters.models.config -> pagedinfer.adapters.models.registry",
            id="config-imports-the-registry",
        ),
        pytest.param(
            "adapters/models/llama.py",
            "import pagedinfer.adapters.models.qwen2",
            MODELS_CONTRACT,
            "pagedinfer.adapters.models.llama -> pagedinfer.adapters.models.qwen2",
            id="a-family-imports-another",
        ),
        pytest.param(
            "__init__.py",
            "import torch",
            LIGHT_ROOT_CONTRACT,
            "pagedinfer -> torch",
            id="package-root-imports-torch",
        ),
        pytest.param(
            "engine/outputs.py",
            "import pagedinfer.ray.columns",
            LAYERS_CONTRACT,
            "pagedinfer.engine.outputs -> pagedinfer.ray.columns",
            id="engine-imports-ray-layer",
        ),
        pytest.param(
            "ray/columns.py",
            "import pagedinfer.cli",
            LAYERS_CONTRACT,
            "pagedinfer.ray.columns -> pagedinfer.cli",
            id="ray-layer-imports-cli",
        ),
        pytest.param(
            "ray/__init__.py",
            "import ray",
            LIGHT_RAY_CONTRACT,
            "pagedinfer.ray -> ray",
            id="ray-package-imports-ray",
        ),
        pytest.param(
            "engine/outputs.py",
            "import pagedinfer.serving.protocol",
            LAYERS_CONTRACT,
            "pagedinfer.engine.outputs -> pagedinfer.serving.protocol",
            id="engine-imports-serving-layer",
        ),
        pytest.param(
            "serving/protocol.py",
            "import pagedinfer.ray.columns",
            LAYERS_CONTRACT,
            "pagedinfer.serving.protocol -> pagedinfer.ray.columns",
            id="serving-imports-its-sibling-ray",
        ),
        pytest.param(
            "serving/__init__.py",
            "import fastapi",
            LIGHT_SERVING_CONTRACT,
            "pagedinfer.serving -> fastapi",
            id="serving-package-imports-fastapi",
        ),
    ],
)
def test_contracts_fail_when_a_rule_is_broken(
    tmp_path: Path, module: str, line: str, contract: str, reported: str
) -> None:
    package = _copy_package(tmp_path)
    _inject(package / module, line)
    result = _lint(tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert f"{contract}" in output
    broken = [text for text in output.splitlines() if text.endswith("BROKEN")]
    assert any(text.startswith(contract) for text in broken), output
    # The report points at the injected import, not at something that was broken already.
    assert reported in output, output
