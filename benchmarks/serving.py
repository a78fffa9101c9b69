"""Serving throughput and latency: ``pagedinfer serve`` under N concurrent streaming clients vs
offline ``Engine.generate`` on the same requests, in the same run.

The workload is nano-vLLM's shape (random token-id prompts, ``ignore_eos``, temperature 0.6,
output lengths drawn per request), at the scale chosen with ``--scale`` (``cpu`` is the CPU
throughput benchmark's: 64 requests, prompts U[16, 256], outputs U[16, 128], small Qwen3).
Each client (asyncio; a lean HTTP/1.1 reader by default, ``--client httpx`` for httpx) sends
one ``/v1/completions`` request with ``stream=true`` and reads its server-sent events; up to
``--concurrency`` requests are in flight (default: all at once, i.e. saturation). The server
is a real ``pagedinfer serve`` subprocess with the same engine settings as the offline
engine; it is warmed up before timing.

Reported per system: request throughput, output tokens/s, and for the server the
client-side time to first token, inter-token latency (a chunk of k tokens after a gap t
counts as k gaps of t/k) and end-to-end latency, p50 and p99. The ratio server/offline
output tok/s is the serving overhead. With ``--repeats N`` the two alternate N times and
medians are shown.

Examples::

    python benchmarks/serving.py                       # CPU scale, small random Qwen3
    python benchmarks/serving.py --concurrency 16      # below saturation
    python benchmarks/serving.py --device cuda --scale full --random-weights qwen3-0.6b
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Run from a plain checkout (`python benchmarks/NAME.py` at the repository root, no install):
# this repository's src/ comes first on the import path.
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(1, str(REPO / "benchmarks"))  # the sibling throughput.py, however this runs

import httpx
import torch

from pagedinfer import Engine, SamplingParams
from pagedinfer.adapters.models.random_checkpoint import build_random_checkpoint
from throughput import Workload, make_workload  # the same workload as the offline benchmark

SCALES: dict[str, dict[str, Any]] = {
    # nano-vLLM's workload.
    "full": {"num_requests": 256, "input_len": (100, 1024), "output_len": (100, 1024)},
    # benchmarks/throughput.py --scale cpu.
    "cpu": {"num_requests": 64, "input_len": (16, 256), "output_len": (16, 128)},
    # A smoke run (tests, quick checks).
    "smoke": {"num_requests": 8, "input_len": (4, 24), "output_len": (4, 12)},
}


@dataclass
class Run:
    """One timed run of one system."""

    name: str
    seconds: float
    output_tokens: int
    num_requests: int
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    cpu_seconds: float = 0.0  # CPU time of the engine's process during the run
    client_cpu_seconds: float = 0.0  # the benchmark's clients (server runs only)

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def requests_per_second(self) -> float:
        return self.num_requests / self.seconds


def engine_kwargs(args: argparse.Namespace, workload: Workload) -> dict[str, Any]:
    longest = max(len(p) for p in workload.prompts) + max(workload.output_lens) + 1
    kwargs: dict[str, Any] = {
        "device": args.device,
        "dtype": args.dtype,
        "max_model_len": max(longest, args.max_model_len),
        "kv_block_size": args.kv_block_size,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    if args.num_kv_blocks is not None:
        kwargs["num_kv_blocks"] = args.num_kv_blocks
    return kwargs


# ------------------------------------------------------------------------------ offline
def run_offline(model: str, workload: Workload, kwargs: dict[str, Any]) -> Run:
    with Engine(model, **kwargs) as engine:
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        params = [
            SamplingParams(temperature=workload.temperature, ignore_eos=True, max_tokens=n)
            for n in workload.output_lens
        ]
        cpu = _cpu_seconds()
        started = time.perf_counter()
        outputs = engine.generate(workload.prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        cpu = _cpu_seconds() - cpu
    produced = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return Run("offline Engine.generate", seconds, produced, len(outputs), cpu_seconds=cpu)


def _cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU time of a process (this one by default), all threads."""
    if pid is None:
        times = os.times()
        return times.user + times.system
    import psutil

    cpu = psutil.Process(pid).cpu_times()
    return float(cpu.user + cpu.system)


# ------------------------------------------------------------------------------- server
class Server:
    """A ``pagedinfer serve`` subprocess on 127.0.0.1 and a free port."""

    def __init__(self, model: str, kwargs: dict[str, Any], threads: int) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        command = [sys.executable, "-m", "pagedinfer", "serve", model]
        command += ["--port", str(self.port), "--served-model-name", "bench"]
        command += ["--log-level", "warning"]
        for name, value in kwargs.items():
            command += [f"--{name.replace('_', '-')}", str(value)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(REPO / "src"), env.get("PYTHONPATH")])
        )
        env["OMP_NUM_THREADS"] = str(threads)  # the offline run uses as many (same process count)
        self.process = subprocess.Popen(command, env=env, cwd=REPO)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 300
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.process.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the server did not become healthy within 300 s")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@dataclass
class _Timing:
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    tokens: int = 0


def _request_body(prompt: list[int], max_tokens: int, temperature: float) -> dict[str, Any]:
    return {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }


class _Clock:
    """Client-side timing of one streamed request."""

    def __init__(self) -> None:
        self.timing = _Timing()
        self.started = self.last = time.perf_counter()

    def event(self, data: bytes) -> None:
        """One server-sent event's payload (after ``data: ``)."""
        if data == b"[DONE]":
            return
        chunk = json.loads(data)
        new = len(chunk["choices"][0].get("token_ids", ())) if chunk["choices"] else 0
        if not new:
            return
        now = time.perf_counter()
        timing = self.timing
        if timing.tokens == 0:
            timing.ttft = now - self.started
        else:
            timing.itl.extend([(now - self.last) / new] * new)
        timing.tokens += new
        self.last = now

    def done(self) -> _Timing:
        self.timing.e2e = time.perf_counter() - self.started
        return self.timing


async def _stream_raw(port: int, body: dict[str, Any]) -> _Timing:
    """One request over a plain asyncio connection: HTTP/1.1, chunked SSE response.

    The clients share the machine with the server, so they are kept lean: httpx costs
    several times more CPU per event than the server spends producing it (``--client
    httpx`` to compare).
    """
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(body).encode()
    clock = _Clock()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload
    )
    try:
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"the server answered {status!r}")
        while await reader.readline() not in (b"\r\n", b""):
            pass  # headers (the body is chunked: uvicorn streams without a length)
        pending = b""
        while True:
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                break
            pending += await reader.readexactly(size + 2)  # the chunk and its CRLF
            pending = pending[:-2]
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: "):
                    clock.event(event[6:])
    finally:
        writer.close()
    return clock.done()


async def _stream_httpx(client: Any, body: dict[str, Any]) -> _Timing:
    clock = _Clock()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                clock.event(line[6:].encode())
    return clock.done()


async def _drive(
    server: Server, workload: Workload, concurrency: int, client_kind: str
) -> tuple[float, list[_Timing]]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=None) as client:

        async def one(prompt: list[int], max_tokens: int) -> _Timing:
            body = _request_body(prompt, max_tokens, workload.temperature)
            async with gate:
                if client_kind == "httpx":
                    return await _stream_httpx(client, body)
                return await _stream_raw(server.port, body)

        await one([1, 2, 3], 4)  # warm-up (connection, first step)
        started = time.perf_counter()
        timings = await asyncio.gather(
            *(one(p, n) for p, n in zip(workload.prompts, workload.output_lens, strict=True))
        )
        return time.perf_counter() - started, list(timings)


def _drive_measured(server: Server, workload: Workload, args: Any) -> tuple[Any, ...]:
    server_cpu, client_cpu = _cpu_seconds(server.process.pid), _cpu_seconds()
    seconds, timings = asyncio.run(_drive(server, workload, args.concurrency, args.client))
    server_cpu = _cpu_seconds(server.process.pid) - server_cpu
    return seconds, timings, server_cpu, _cpu_seconds() - client_cpu


def run_server(model: str, workload: Workload, kwargs: dict[str, Any], args: Any) -> Run:
    server = Server(model, kwargs, args.threads)
    try:
        seconds, timings, server_cpu, client_cpu = _drive_measured(server, workload, args)
    finally:
        server.stop()
    run = Run(
        f"pagedinfer serve, {args.concurrency} concurrent streams ({args.client} client)",
        seconds,
        sum(t.tokens for t in timings),
        len(timings),
        cpu_seconds=server_cpu,
        client_cpu_seconds=client_cpu,
    )
    for timing in timings:
        run.ttft.append(timing.ttft)
        run.itl.extend(timing.itl)
        run.e2e.append(timing.e2e)
    return run


# ------------------------------------------------------------------------------- report
def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def report(offline: list[Run], served: list[Run], args: argparse.Namespace, model: str) -> str:
    def median(runs: list[Run], attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in runs)

    off_tps, srv_tps = median(offline, "tokens_per_second"), median(served, "tokens_per_second")
    lines = [
        f"model: {model}; device: {describe_device(args.device)}; "
        f"{args.num_requests} requests, prompts U{list(args.input_len)}, "
        f"outputs U{list(args.output_len)}, temperature {args.temperature}, "
        f"{len(served)} run(s) each",
        "",
        "| system | req/s | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) "
        "| E2E p50 / p99 (s) |",
        "|---|---:|---:|---:|---:|---:|",
        f"| {offline[0].name} | {median(offline, 'requests_per_second'):.2f} "
        f"| {off_tps:.1f} | – | – | – |",
    ]
    best = sorted(served, key=lambda r: r.tokens_per_second)[len(served) // 2]
    lines.append(
        f"| {best.name} | {median(served, 'requests_per_second'):.2f} | {srv_tps:.1f} "
        f"| {1000 * percentile(best.ttft, 50):.0f} / {1000 * percentile(best.ttft, 99):.0f} "
        f"| {1000 * percentile(best.itl, 50):.1f} / {1000 * percentile(best.itl, 99):.1f} "
        f"| {percentile(best.e2e, 50):.2f} / {percentile(best.e2e, 99):.2f} |"
    )
    lines += [
        "",
        f"server / offline output throughput: {srv_tps / off_tps:.1%}",
        f"CPU seconds per run (median): offline {median(offline, 'cpu_seconds'):.2f}; server "
        f"process {median(served, 'cpu_seconds'):.2f}, clients "
        f"{median(served, 'client_cpu_seconds'):.2f}",
    ]
    if len(served) > 1:
        lines.append(
            "runs (tok/s): offline "
            + ", ".join(f"{r.tokens_per_second:.0f}" for r in offline)
            + "; server "
            + ", ".join(f"{r.tokens_per_second:.0f}" for r in served)
        )
    return "\n".join(lines)


def describe_device(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def resolve_model(args: argparse.Namespace) -> str:
    if args.model:
        return str(args.model)
    directory = Path(args.cache_dir) / args.random_weights
    if not (directory / "config.json").exists():
        print(f"building a random-weight {args.random_weights} checkpoint in {directory} ...")
        build_random_checkpoint(directory, args.random_weights, seed=0)
    return str(directory)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", help="local checkpoint directory")
    parser.add_argument("--random-weights", default="small", help="preset when --model is absent")
    parser.add_argument("--cache-dir", default=".bench-cache/model")
    parser.add_argument("--scale", choices=sorted(SCALES), default="cpu")
    parser.add_argument("--num-requests", type=int)
    parser.add_argument("--input-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    parser.add_argument("--concurrency", type=int, help="requests in flight (default: all)")
    parser.add_argument(
        "--client",
        choices=("raw", "httpx"),
        default="raw",
        help="raw: lean HTTP/1.1 over asyncio streams (default); httpx: httpx.AsyncClient",
    )
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-block-size", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--num-kv-blocks", type=int)
    parser.add_argument("--json", help="also write the runs to this JSON file")
    args = parser.parse_args(argv)
    for name, value in SCALES[args.scale].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.concurrency is None:
        args.concurrency = args.num_requests
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model = resolve_model(args)
    with open(Path(model) / "config.json") as config:
        vocab_size = json.load(config)["vocab_size"]
    workload = make_workload(args, vocab_size)
    kwargs = engine_kwargs(args, workload)
    offline: list[Run] = []
    served: list[Run] = []
    for _ in range(args.repeats):  # alternate, so slow phases of a shared machine hit both
        offline.append(run_offline(model, workload, kwargs))
        served.append(run_server(model, workload, kwargs, args))
        print(
            f"offline {offline[-1].tokens_per_second:.1f} tok/s, "
            f"server {served[-1].tokens_per_second:.1f} tok/s",
            flush=True,
        )
    for run in served:
        if run.output_tokens != workload.output_tokens:
            raise RuntimeError(
                f"the server produced {run.output_tokens} tokens, expected {workload.output_tokens}"
            )
    print(report(offline, served, args, model))
    if args.json:
        Path(args.json).write_text(json.dumps([run.__dict__ for run in offline + served], indent=1))


if __name__ == "__main__":
    main()
