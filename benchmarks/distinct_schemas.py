"""Many distinct JSON schemas queued at once: no compile in the step loop, steps stay even.

Two parts, side by side with an unconstrained baseline of the same shape:

1. **Engine**: ``--requests`` (300) requests, each under its own JSON schema (distinct, so
   each compiles), are queued at once with ``add_request`` (each compiles and is probed in
   the submitting thread), then the step loop runs them. Reported: the compiles that happened
   inside steps (must be 0: each request carries its compiled grammar, however many the cache
   evicted), the median and slowest step, and their ratio; the same for the requests without
   a schema (baseline).
2. **Server**: a ``pagedinfer serve`` process gets the same requests at once (one thread
   each, distinct schemas) while another thread polls ``/health`` every 20 ms; reported:
   ``/health`` latency (median, 99th percentile, max) during the burst, and idle.

Model: ``--model DIR`` (a checkpoint with a tokenizer) or the ``--preset`` random model
(``tiny`` by default) with a byte-level BPE tokenizer::

    PYTHONPATH=src python3 benchmarks/distinct_schemas.py [--requests 300] [--max-tokens 24]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from pagedinfer import Engine, SamplingParams, StructuredOutputsParams
from pagedinfer.adapters.sampling.grammar import GrammarCompiler

# Every request fits at once in the KV cache; 64 run at a time.
ENGINE: dict[str, Any] = {
    "device": "cpu",
    "max_model_len": 128,
    "max_num_seqs": 64,
    "kv_block_size": 16,
    "num_kv_blocks": 1024,
}


def schema(index: int) -> dict[str, Any]:
    """A small object schema, distinct for each ``index``."""
    return {
        "type": "object",
        "properties": {
            f"field_{index}": {"type": "integer", "minimum": 0, "maximum": 9999},
            "name": {"type": "string", "maxLength": 8},
        },
        "required": [f"field_{index}", "name"],
        "additionalProperties": False,
    }


def _params(index: int, constrained: bool, max_tokens: int) -> SamplingParams:
    if not constrained:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(json=schema(index), disable_any_whitespace=True),
    )


def run_engine(model: str, requests: int, max_tokens: int, constrained: bool) -> dict[str, Any]:
    """Queue every request, then time each step; count compiles inside steps."""
    with Engine(model, **ENGINE) as engine:
        compiler: GrammarCompiler = engine._grammars
        engine.generate(["warm up"], SamplingParams(max_tokens=4), use_tqdm=False)
        started = time.perf_counter()
        for index in range(requests):
            engine.add_request(f"request {index}:", _params(index, constrained, max_tokens))
        submit_s = time.perf_counter() - started
        compiled = compiler.num_compiled
        steps: list[float] = []
        finished = 0
        while engine.has_unfinished_requests():
            began = time.perf_counter()
            outputs = engine.step()
            steps.append(time.perf_counter() - began)
            finished += sum(output.finished for output in outputs)
        assert finished == requests, finished
        in_step = compiler.num_compiled - compiled
    median = statistics.median(steps)
    return {
        "constrained": constrained,
        "submit_s": submit_s,
        "steps": len(steps),
        "compiles_in_steps": in_step,
        "median_step_ms": median * 1e3,
        "slowest_step_ms": max(steps) * 1e3,
        "ratio": max(steps) / median,
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def run_server(model: str, requests: int, max_tokens: int, constrained: bool) -> dict[str, Any]:
    """``/health`` latency while the requests run on a real server (and idle)."""
    import httpx

    port = _free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "pagedinfer", "serve", model, "--host", "127.0.0.1"]
    command += ["--port", str(port), "--log-level", "warning"]
    for name, value in ENGINE.items():
        command += [f"--{name.replace('_', '-')}", str(value)]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError("the server did not start")
            time.sleep(0.2)
        with httpx.Client() as client:  # one connection, as the poller's
            idle = [_health(client, base) for _ in range(50)]
        # /health is polled from another process, so that the load of this one's clients
        # does not count in its latency.
        poller = subprocess.Popen(
            [sys.executable, "-c", _POLLER, base],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        started = time.perf_counter()
        asyncio.run(_burst(base, requests, max_tokens, constrained))
        seconds = time.perf_counter() - started
        out, _ = poller.communicate("stop\n", timeout=120)
        busy = json.loads(out)
    finally:
        process.terminate()
        process.wait(timeout=60)
    busy.sort()
    return {
        "constrained": constrained,
        "burst_s": seconds,
        "health_idle_median_ms": statistics.median(idle) * 1e3,
        "health_median_ms": statistics.median(busy) * 1e3,
        "health_p99_ms": busy[min(len(busy) - 1, int(len(busy) * 0.99))] * 1e3,
        "health_max_ms": busy[-1] * 1e3,
        "health_polls": len(busy),
    }


_POLLER = """
import json, sys, threading, time
import httpx
base, stop, seen = sys.argv[1], threading.Event(), []
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
with httpx.Client() as client:
    while not stop.is_set():
        began = time.perf_counter()
        client.get(base + "/health", timeout=60)
        seen.append(time.perf_counter() - began)
        time.sleep(0.02)
print(json.dumps(seen))
"""


async def _burst(base: str, requests: int, max_tokens: int, constrained: bool) -> None:
    """Every request at once, from one event loop."""
    import httpx

    limits = httpx.Limits(max_connections=requests + 8)
    async with httpx.AsyncClient(limits=limits, timeout=900) as client:

        async def send(index: int) -> None:
            body: dict[str, Any] = {
                "prompt": f"request {index}:",
                "max_tokens": max_tokens,
                "temperature": 0,
            }
            if constrained:
                body["guided_json"] = schema(index)
            else:
                body["ignore_eos"] = True
            response = await client.post(base + "/v1/completions", json=body)
            assert response.status_code == 200, response.text

        await asyncio.gather(*(send(index) for index in range(requests)))


def _health(client: Any, base: str) -> float:
    started = time.perf_counter()
    client.get(base + "/health", timeout=30)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="checkpoint directory with a tokenizer")
    parser.add_argument("--preset", default="tiny", help="the random model, without --model")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--skip-server", action="store_true")
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from pagedinfer.adapters.models.random_checkpoint import build_random_checkpoint

        model = str(
            build_random_checkpoint(
                tempfile.mkdtemp(prefix="pagedinfer-schemas-"), args.preset, with_tokenizer=True
            )
        )
    results: dict[str, Any] = {"engine": [], "server": []}
    for constrained in () if args.skip_engine else (False, True):
        results["engine"].append(run_engine(model, args.requests, args.max_tokens, constrained))
        print(json.dumps(results["engine"][-1]), flush=True)
    if not args.skip_server:
        for constrained in (False, True):
            results["server"].append(run_server(model, args.requests, args.max_tokens, constrained))
            print(json.dumps(results["server"][-1]), flush=True)
    print(markdown(results))


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "| schemas | submit (s) | steps | compiles in steps | median step (ms) "
        "| slowest step (ms) | slowest / median |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in results["engine"]:
        lines.append(
            f"| {'distinct' if run['constrained'] else 'none'} | {run['submit_s']:.2f} "
            f"| {run['steps']} | {run['compiles_in_steps']} | {run['median_step_ms']:.1f} "
            f"| {run['slowest_step_ms']:.1f} | {run['ratio']:.2f} |"
        )
    if results["server"]:
        lines += [
            "",
            "| schemas | burst (s) | /health idle median (ms) | /health median (ms) "
            "| p99 (ms) | max (ms) | polls |",
            "|---|---|---|---|---|---|---|",
        ]
        for run in results["server"]:
            lines.append(
                f"| {'distinct' if run['constrained'] else 'none'} | {run['burst_s']:.1f} "
                f"| {run['health_idle_median_ms']:.1f} | {run['health_median_ms']:.1f} "
                f"| {run['health_p99_ms']:.1f} | {run['health_max_ms']:.1f} "
                f"| {run['health_polls']} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
