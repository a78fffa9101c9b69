"""The example and the benchmarks run as users run them: as scripts, in a subprocess.

The example runs with torch, numpy, triton and transformers made unimportable, which proves
the embedding story of SPEC §1.3 end to end (an in-process check would be masked by whatever
earlier tests imported).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from core_env import build_core_venv, mypy_strict  # tests/unit/core_env.py
from core_env import run as run_core

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
EXAMPLE = EXAMPLES / "custom_runtime.py"
BENCHMARK = REPO / "benchmarks" / "block_pool.py"
THROUGHPUT = REPO / "benchmarks" / "throughput.py"
SCHEDULER_BENCHMARK = REPO / "benchmarks" / "scheduler.py"
MIXED_STEPS_BENCHMARK = REPO / "benchmarks" / "mixed_steps.py"
HEAVY = ("torch", "numpy", "triton", "transformers", "safetensors")

# Runs a script as __main__ with the heavy packages blocked, then proves none was loaded.
_RUN_WITHOUT_HEAVY_PACKAGES = """
import runpy, sys

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {heavy!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)")
        return None

sys.meta_path.insert(0, Refuse())
script, *args = sys.argv[1:]
sys.argv = [script, *args]
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as exit:
    if exit.code not in (None, 0):
        raise
loaded = sorted(name for name in sys.modules if name.split(".")[0] in {heavy!r})
assert not loaded, f"heavy modules were imported: {{loaded}}"
"""


def _run_script(script: Path, *args: str, timeout: float = 120) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    code = textwrap.dedent(_RUN_WITHOUT_HEAVY_PACKAGES.format(heavy=HEAVY))
    result = subprocess.run(
        [sys.executable, "-c", code, str(script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout


# ------------------------------------------------------------------------- the example

_PLAN_HEADER = re.compile(
    r"^step (\d+): (prefill|decode|mixed)(?: \((\d+) decode rows \+ \d+ chunks\))?, "
    r"is_prefill=(True|False)"
)
_PLAN_ROW = re.compile(
    r"^  seq (\d+): query_len=\s*(\d+) positions=\[([^\]]*)\] context_len=\s*(\d+) "
    r"slots=\[([^\]]*)\] block_table=\[([^\]]*)\]"
)
_OUTPUT_ROW = re.compile(
    r"^  seq (\d+): prompt=(\d+) cached=(\d+) completion=(\d+) finish_reason=(\w+)"
)


def _expand(spans: str) -> list[int]:
    """Inverse of the example's ``[a..b, c]`` rendering."""
    values: list[int] = []
    for part in spans.split(", "):
        first, _, last = part.partition("..")
        values.extend(range(int(first), int(last or first) + 1))
    return values


@pytest.fixture(scope="module")
def example_output() -> str:
    return _run_script(EXAMPLE, "--seed", "0", "--show-steps", "1000")


def test_example_runs_without_torch(example_output: str) -> None:
    assert "torch imported: False" in example_output


def test_example_plans_are_consistent(example_output: str) -> None:
    plans: list[tuple[bool, list[tuple[int, ...]]]] = []
    kinds: set[str] = set()
    for line in example_output.splitlines():
        if header := _PLAN_HEADER.match(line):
            assert (header[2] != "decode") == (header[4] == "True")
            plans.append((header[4] == "True", []))
            kinds.add(header[2])
        elif row := _PLAN_ROW.match(line):
            seq_id, query_len, positions, context_len = (
                int(row[1]),
                int(row[2]),
                _expand(row[3]),
                int(row[4]),
            )
            slots = _expand(row[5])
            table = [int(entry) for entry in row[6].split(", ") if entry != "-"]
            assert len(positions) == len(slots) == query_len
            # The query is the tail of the context, and every slot lies in the block the
            # table assigns to its position (block_size 8 in the example).
            assert positions == list(range(context_len - query_len, context_len))
            for position, slot in zip(positions, slots, strict=True):
                assert slot // 8 == table[position // 8]
            assert len(table) == -(-context_len // 8)
            plans[-1][1].append((seq_id, query_len, positions[0], context_len))
    assert len(plans) > 5
    assert kinds == {"prefill", "mixed", "decode"}, kinds
    assert any(is_prefill for is_prefill, _ in plans)
    assert any(not is_prefill for is_prefill, _ in plans)
    for is_prefill, rows in plans:
        assert rows, "a plan without sequences"
        if not is_prefill:
            assert all(query_len == 1 for _, query_len, _, _ in rows)
    # Chunked prefill: some sequence's prompt arrives in more than one prefill step, each
    # chunk starting where the previous one ended.
    chunks: dict[int, list[tuple[int, int]]] = {}
    for is_prefill, rows in plans:
        for seq_id, query_len, start, _ in rows:
            if is_prefill:
                chunks.setdefault(seq_id, []).append((start, query_len))
    assert any(len(parts) > 1 for parts in chunks.values()), chunks


def test_example_finishes_every_request_and_frees_the_pool(example_output: str) -> None:
    outputs = [_OUTPUT_ROW.match(line) for line in example_output.splitlines()]
    rows = [row for row in outputs if row is not None]
    assert sorted(int(row[1]) for row in rows) == [0, 1, 2, 3, 4]
    for row in rows:
        assert row[5] in {"length", "stop"}
        assert 1 <= int(row[4]) <= 30  # max_tokens is drawn from [12, 30]
        assert int(row[3]) <= int(row[2])
    # The shared system prompt is served from the prefix cache for later requests.
    assert any(int(row[3]) >= 24 for row in rows)
    pool = re.search(r"pool: free=(\d+)/(\d+) .* prefix_hits=(\d+)/(\d+)", example_output)
    assert pool is not None
    assert pool[1] == pool[2], "finished requests must give every block back"
    assert 0 < int(pool[3]) <= int(pool[4])
    sched = re.search(r"preemptions=(\d+) waiting=(\d+) running=(\d+)", example_output)
    assert sched is not None
    assert int(sched[1]) >= 1, "the small pool is meant to force a preemption"
    assert sched[2] == sched[3] == "0"
    assert "preempted (no free block)" in example_output


# ---------------------------------------------------------------- the block-pool benchmark

_TIME = re.compile(r"^([\d.]+) (ns|µs)$")


def _seconds(cell: str) -> float:
    match = _TIME.match(cell.strip())
    assert match is not None, cell
    return float(match[1]) * (1e-9 if match[2] == "ns" else 1e-6)


def _table_rows(output: str, header_start: str) -> list[list[str]]:
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_block_pool_benchmark_quick_run() -> None:
    output = _run_script(BENCHMARK, "--quick", "--sizes", "1000,4000", "--ops", "400")
    pool_rows = _table_rows(output, "| pool blocks |")
    workloads = {
        "alloc+free",
        "hit free cached",
        "hit free cached, hot",
        "hit in-use",
        "alloc(evict)+register+free",
    }
    assert {(row[0], row[1]) for row in pool_rows} == {
        (size, workload) for size in ("1,000", "4,000") for workload in workloads
    }
    for row in pool_rows:
        ours, theirs = _seconds(row[2]), _seconds(row[4])
        assert 0 < ours < 1e-3 and 0 < theirs < 1e-1
        assert int(row[7].replace(",", "")) >= 4  # the baseline did at least one chain
    scheduler_rows = _table_rows(output, "| scenario |")
    assert len(scheduler_rows) == 3
    for row in scheduler_rows:
        prefill_steps, decode_steps = (int(part) for part in row[3].split(" + "))
        assert (
            prefill_steps >= 1 and decode_steps >= 99
        )  # outputs have >= 100 tokens, the first from prefill
        assert float(row[7]) > 0


# ------------------------------------------------------------------ the scheduler benchmark


def test_scheduler_benchmark_quick_run() -> None:
    """Every system runs the same workload to the end (the script raises if one generates a
    different number of tokens) and reports positive costs; no torch is needed. pagedinfer
    runs under both scheduling policies; prefill_first takes nano-vLLM's steps."""
    output = _run_script(SCHEDULER_BENCHMARK, "--quick")
    rows = _table_rows(output, "| system |")
    assert [row[0] for row in rows] == ["pagedinfer", "pagedinfer (prefill_first)", "nano-vLLM"]
    assert rows[1][1] == rows[2][1], "prefill_first takes the same steps as nano-vLLM"
    for row in rows:
        prefill_steps, mixed_steps, decode_steps = (int(part) for part in row[1].split(" + "))
        assert prefill_steps >= 1 and decode_steps >= 9
        assert mixed_steps == 0 or row[0] == "pagedinfer"
        assert float(row[4]) > 0 and float(row[6]) > 0 and int(row[7]) >= 1
    assert "nano-vLLM / pagedinfer:" in output
    assert "nano-vLLM / pagedinfer (prefill_first):" in output


# ---------------------------------------------------------------- the throughput benchmark


def test_throughput_benchmark_smoke_run(tmp_path: Path) -> None:
    """The script runs pagedinfer and both transformers baselines on one workload and reports
    every request's tokens (it raises if pagedinfer produced a different count)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    report = tmp_path / "result.json"
    result = subprocess.run(
        [
            sys.executable,
            str(THROUGHPUT),
            "--device=cpu",
            "--scale=smoke",
            "--random-weights=tiny",
            f"--cache-dir={tmp_path}",
            "--repeats=2",
            "--threads=1",
            f"--json={report}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    payload = json.loads(report.read_text())
    names = [entry["name"] for entry in payload["results"]]
    assert names[0].startswith("pagedinfer (torch")
    assert any(name.startswith("transformers generate (padded") for name in names)
    assert any(name.startswith("transformers generate_batch") for name in names)
    tokens = {run["output_tokens"] for entry in payload["results"] for run in entry["runs"]}
    assert len(tokens) == 1 and tokens.pop() > 0, "every system must produce the same tokens"
    for entry in payload["results"]:
        assert len(entry["runs"]) == 2
        assert entry["median_throughput"] > 0
    table = _table_rows(result.stdout, "| system |")
    assert [row[0] for row in table] == names
    assert table[0][5] == "1.00x"


def test_sampling_features_example_runs(tmp_path: Path) -> None:
    """The vLLM-style example (n, logprobs, penalties, chat, stream) on a random checkpoint,
    which it leaves no copy of in the temporary folder (issue 46)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    env["TMPDIR"] = str(tmp_path)
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / "sampling_features.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("cumulative logprob") == 3
    assert "chat prompt:" in result.stdout and "delta:" in result.stdout
    assert not [path for path in tmp_path.rglob("*.safetensors")], "a checkpoint was left"


# --------------------------------------------------------------- the mixed-steps benchmark


def test_mixed_steps_benchmark_counts_decode_stalls_without_torch() -> None:
    output = _run_script(MIXED_STEPS_BENCHMARK, "--quick", "--section", "stalls")
    rows = {row[0]: row for row in _table_rows(output, "| policy | steps |")}
    assert set(rows) == {"mixed", "prefill_first"}
    # steps, mixed steps, stall steps, stalled tokens, longest wait, preemptions
    assert rows["mixed"][3:] == ["0", "0", "0", "0"] and int(rows["mixed"][2]) > 0
    assert int(rows["prefill_first"][3]) > 0 and rows["prefill_first"][2] == "0"
    assert rows["prefill_first"][6] == "0"


def test_mixed_steps_benchmark_quick_run(tmp_path: Path) -> None:
    """Both policies through the Engine on a tiny model: the same tokens (the script raises
    otherwise), no stall under the mixed policy."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [
            sys.executable,
            str(MIXED_STEPS_BENCHMARK),
            "--quick",
            "--threads=1",
            f"--cache-dir={tmp_path}",
            "--section=latency",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    rows = {row[0]: row for row in _table_rows(result.stdout, "| policy | ITL p50")}
    assert set(rows) == {"mixed", "prefill_first"}
    assert rows["mixed"][9] == "0" and int(rows["prefill_first"][9]) > 0  # stall steps
    assert float(rows["mixed"][1]) > 0 and float(rows["mixed"][2]) > 0


# ---------------------------------------------------------------- the host-step benchmark


def test_host_step_benchmark_quick_run(tmp_path: Path) -> None:
    """The CPU stand-in of a graph decode step runs the workload to the end and reports the
    host phases of the decode steps that held every request."""
    script = REPO / "benchmarks" / "host_step.py"
    result = subprocess.run(
        [sys.executable, str(script), "--quick", "--rounds", "1", "--cache-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    rows = {row[0]: row[1] for row in _table_rows(result.stdout, "| measure |")}
    assert len(rows) == 5
    for cell in rows.values():
        median, best = (float(value) for value in cell.split(" / "))
        assert 0 < best == median  # one round: its median is its best


def test_serving_benchmark_smoke_run(tmp_path: Path) -> None:
    """The server benchmark starts ``pagedinfer serve``, drives it with streaming clients on
    the offline benchmark's workload and reports both systems and their ratio."""
    script = REPO / "benchmarks" / "serving.py"
    result = subprocess.run(
        [sys.executable, str(script), "--scale", "smoke", "--cache-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "| offline Engine.generate |" in result.stdout
    assert "| pagedinfer serve, 8 concurrent streams" in result.stdout
    assert "server / offline output throughput:" in result.stdout


# ------------------------------------------------------------- the NumPy runtime (issue 29)


@pytest.fixture(scope="module")
def numpy_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with pagedinfer, xxhash and numpy only: torch is not installed there."""
    return build_core_venv(tmp_path_factory.mktemp("numpy-core") / "venv", ("xxhash", "numpy"))


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"architecture": "LlamaForCausalLM", "tie_word_embeddings": False},
        {"num_hidden_layers": 4, "num_key_value_heads": 4},
    ],
    ids=["qwen3", "llama-untied", "qwen3-4-layers"],
)
def test_numpy_runtime_is_token_exact_with_the_engine_without_torch(
    numpy_python: Path, make_checkpoint: Callable[..., Path], overrides: dict[str, object]
) -> None:
    """examples/numpy_runtime.py, in a venv without torch, generates Engine's greedy tokens
    through a small pool (preemptions), a shared prefix (cache hits), n=2 forks (block copies)
    and failed steps recovered both ways."""
    from pagedinfer import Engine, SamplingParams

    checkpoint = make_checkpoint("tiny", **overrides)
    prompts = [[5 + i for i in range(40)] + tail for tail in ([7, 8, 9], [10] * 12, [11])]
    prompts.append(list(range(100, 125)))
    options = ["--max-tokens", "20", "--n", "2", "--num-blocks", "12", "--block-size", "8"]
    options += ["--max-num-batched-tokens", "24", "--fail-every", "4"]
    result = run_core(
        numpy_python,
        str(EXAMPLES / "numpy_runtime.py"),
        str(checkpoint),
        "--json",
        "--prompts",
        json.dumps(prompts),
        *options,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["preemptions"] > 0 and report["prefix_hit_tokens"] > 0
    assert report["failed_steps"] > 2
    params = SamplingParams(temperature=0.0, max_tokens=20, n=2)
    with Engine(checkpoint, device="cpu", max_model_len=256, skip_tokenizer_init=True) as engine:
        outputs = engine.generate(
            [{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False
        )
    assert report["outputs"] == [[list(c.token_ids) for c in o.outputs] for o in outputs]


def test_the_examples_type_check_strictly_without_torch(numpy_python: Path, tmp_path: Path) -> None:
    """mypy --strict of both examples against a venv without torch, from this checkout (with
    the documented --always-true=PAGEDINFER_DOMAIN_ONLY)."""
    result = mypy_strict(
        numpy_python,
        str(EXAMPLES / "numpy_runtime.py"),
        str(EXAMPLE),
        cache_dir=tmp_path / "cache",
        source_checkout=True,
    )
    assert result.returncode == 0, result.stdout[-3000:]
