"""A real ``pagedinfer serve`` process on 127.0.0.1 and a free port, shared by a module.

The server runs as the user runs it (``python -m pagedinfer serve DIR ...`` in a subprocess),
on the tiny random checkpoint with a tokenizer and a chat template. ``ServerProcess`` knows
its base URL, the engine settings (so a test can build the same ``Engine`` for parity) and
how to stop it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

REPO = Path(__file__).resolve().parents[3]

# Small enough for 2 shared cores, large enough for 64 concurrent requests without preemption.
ENGINE_KWARGS: dict[str, Any] = {
    "device": "cpu",
    "kv_block_size": 16,
    "num_kv_blocks": 512,
    "max_model_len": 2048,
    "max_num_seqs": 128,
    "max_num_batched_tokens": 2048,
}
MODEL_NAME = "tiny-chat"


@dataclass
class ServerProcess:
    process: subprocess.Popen[str]
    base_url: str
    checkpoint: Path
    log_path: Path
    engine_kwargs: dict[str, Any] = field(default_factory=lambda: dict(ENGINE_KWARGS))

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def metrics(self) -> dict[str, float]:
        """The server's /metrics as {name{labels}: value} (comments and buckets left out)."""
        text = httpx.get(self.base_url + "/metrics", timeout=30).text
        values = {}
        for line in text.splitlines():
            if line.startswith("#") or "_bucket" in line or not line.strip():
                continue
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
        return values

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
            raise


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_server(checkpoint: Path, log_path: Path, **extra: Any) -> ServerProcess:
    kwargs = {**ENGINE_KWARGS, **extra}
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "pagedinfer",
        "serve",
        str(checkpoint),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        MODEL_NAME,
        "--log-level",
        "warning",
    ]
    for name, value in kwargs.items():
        command += [f"--{name.replace('_', '-')}", str(value)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    log = log_path.open("w")
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO
    )
    server = ServerProcess(process, f"http://127.0.0.1:{port}", checkpoint, log_path)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.base_url + "/health", timeout=5).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"the server did not become healthy in time:\n{server.log()}")


@pytest.fixture(scope="module")
def chat_checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny", with_tokenizer=True)


@pytest.fixture(scope="module")
def server(
    chat_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    server = start_server(chat_checkpoint, log_path)
    try:
        yield server
    finally:
        if server.process.poll() is None:
            server.stop(signal.SIGKILL)
