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
from collections.abc import Callable, Iterator, Sequence
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
    headers: dict[str, str] = field(default_factory=dict)  # e.g. the API key

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def metrics(self) -> dict[str, float]:
        """The server's /metrics as {name{labels}: value} (comments and buckets left out)."""
        response = httpx.get(self.base_url + "/metrics", headers=self.headers, timeout=30)
        response.raise_for_status()
        text = response.text
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


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("PAGEDINFER_API_KEY", None)
    return env


def serve_command(
    checkpoint: Path,
    port: int,
    *,
    served_model_name: str | None = MODEL_NAME,
    args: Sequence[str] = (),
    **engine_kwargs: Any,
) -> list[str]:
    """``python -m pagedinfer serve ...`` with the test engine settings (overridable)."""
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
        "--log-level",
        "warning",
    ]
    if served_model_name is not None:
        command += ["--served-model-name", served_model_name]
    for name, value in {**ENGINE_KWARGS, **engine_kwargs}.items():
        command += [f"--{name.replace('_', '-')}", str(value)]
    return [*command, *args]


def start_server(
    checkpoint: Path,
    log_path: Path,
    *,
    served_model_name: str | None = MODEL_NAME,
    args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    launcher: Sequence[str] | None = None,
    **engine_kwargs: Any,
) -> ServerProcess:
    """Start a server and wait until /health answers 200. ``args`` are more options of
    ``serve``; ``launcher`` replaces ``python -m pagedinfer`` (a bootstrap script that
    patches something first, given the serve arguments)."""
    port = free_port()
    command = serve_command(
        checkpoint, port, served_model_name=served_model_name, args=args, **engine_kwargs
    )
    if launcher is not None:
        command = [*launcher, *command[3:]]
    log = log_path.open("w")
    process = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        env=env or server_env(),
        cwd=REPO,
    )
    server = ServerProcess(process, f"http://127.0.0.1:{port}", checkpoint, log_path)
    server.engine_kwargs.update(engine_kwargs)
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
