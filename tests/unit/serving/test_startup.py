"""``pagedinfer serve`` from the outside: start-up checks and exit codes (issue 21, items 3
and 9; docs/api.md lists the codes).

Before: ``--port 99999`` was accepted (it listened on 99999 mod 65536), a busy port was found
only after the model had loaded and the process exited with uvicorn's undocumented 3, and a
dead engine left the process running, answering 503 forever.
"""

from __future__ import annotations

import errno
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.unit.serving.conftest import REPO, server_env, start_server

from pagedinfer.cli import EXIT_ENGINE_DEAD, EXIT_FAILURE, EXIT_USER_ERROR, main
from pagedinfer.serving.options import AddressInUseError, ServingOptions


def serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pagedinfer", "serve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=server_env(),
        check=False,
    )


@pytest.mark.parametrize("port", ["99999", "-1", "65536", "http"])
def test_a_port_out_of_range_is_a_user_error(port: str, tmp_path: Path) -> None:
    result = serve(str(tmp_path), "--port", port)
    assert result.returncode == EXIT_USER_ERROR
    (line,) = result.stderr.strip().splitlines()
    assert "--port" in line and ("out of range" in line or "port number" in line)


def test_a_busy_port_fails_before_the_model_loads(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # No checkpoint there: had the model been loaded first, this would be exit 2 (a path
        # that is no checkpoint), and only after the load.
        started = time.monotonic()
        result = serve(str(tmp_path / "no-such-model"), "--port", str(port))
    assert result.returncode == EXIT_FAILURE, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith(f"pagedinfer serve: error: cannot listen on 127.0.0.1:{port}: ")
    assert "already in use" in lines[0]
    assert time.monotonic() - started < 60


def test_an_address_the_machine_lacks_is_a_user_error() -> None:
    from pagedinfer.errors import ConfigurationError
    from pagedinfer.serving.server import bind_socket

    with pytest.raises(ConfigurationError, match=r"cannot listen on 192\.0\.2\.1:0: "):
        bind_socket("192.0.2.1", 0)  # TEST-NET-1: no machine has it
    with pytest.raises(ConfigurationError, match="out of range"):
        bind_socket("127.0.0.1", 65536)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(AddressInUseError, match="already in use") as error:
            bind_socket("127.0.0.1", taken.getsockname()[1])
    assert isinstance(error.value, OSError) and error.value.errno == errno.EADDRINUSE
    with bind_socket("127.0.0.1", 0) as sock:  # listening at once: connections queue
        socket.create_connection(sock.getsockname(), timeout=5).close()


FATAL_LAUNCHER = textwrap.dedent(
    """
    import sys

    import pagedinfer.serving.server as server
    from pagedinfer.cli import main
    from pagedinfer.errors import WorkerDiedError

    serve_engine = server.serve_engine

    def fail_every_step(engine, *args, **kwargs):
        def execute(plan):
            raise WorkerDiedError("injected: worker 1 exited with status -9 (/secret/path)")

        engine.engine._executor.execute = execute
        return serve_engine(engine, *args, **kwargs)

    server.serve_engine = fail_every_step
    sys.exit(main(sys.argv[1:]))
    """
)


def test_the_process_exits_when_the_engine_dies(chat_checkpoint: Path, tmp_path: Path) -> None:
    server = start_server(
        chat_checkpoint, tmp_path / "server.log", launcher=[sys.executable, "-c", FATAL_LAUNCHER]
    )
    try:
        response = httpx.post(
            server.api_url + "/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60
        )
        assert response.status_code == 503
        assert "secret" not in response.text and "injected" not in response.text
        # The server shuts down by itself, with the documented exit code.
        assert server.process.wait(timeout=60) == EXIT_ENGINE_DEAD
    finally:
        if server.process.poll() is None:
            server.process.kill()
    log = server.log()
    assert "injected: worker 1 exited" in log and "Traceback" in log  # the cause, logged
    assert "pagedinfer serve: error: the engine failed while serving" in log


# --------------------------------------------------------------- options -> ServingOptions
def captured_options(
    monkeypatch: pytest.MonkeyPatch, *args: str, model: tuple[str, ...] = ("model-dir",)
) -> dict[str, Any]:
    """What ``pagedinfer serve MODEL ARGS`` hands to ``run_server`` (its keyword arguments,
    and the model as ``"model"``)."""
    import pagedinfer.serving.server as server

    seen: dict[str, Any] = {}

    def run(model_path: str, **kwargs: Any) -> None:
        seen.update(kwargs, model=model_path)

    monkeypatch.setattr(server, "run_server", run)
    assert main(["serve", *model, *args]) == 0
    return seen


def test_serve_options_reach_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDINFER_API_KEY", raising=False)
    seen = captured_options(monkeypatch)
    assert seen["options"] == ServingOptions()  # no key, the defaults
    assert seen["served_model_name"] is None  # run_server takes the directory's name
    seen = captured_options(
        monkeypatch,
        "--api-key",
        "k1",
        "--metrics-public",
        "--allowed-hosts",
        "a.example,*.b.example",
        "--allowed-hosts",
        "C.example",
        "--max-request-bytes",
        "2048",
        "--header-timeout-s",
        "2.5",
        "--body-timeout-s",
        "7",
    )
    assert seen["options"] == ServingOptions(
        api_key="k1",
        metrics_public=True,
        allowed_hosts=("a.example", "*.b.example", "c.example"),
        max_request_bytes=2048,
        header_timeout_s=2.5,
        body_timeout_s=7.0,
    )
    monkeypatch.setenv("PAGEDINFER_API_KEY", "from-env")
    assert captured_options(monkeypatch)["options"].api_key == "from-env"
    assert captured_options(monkeypatch, "--api-key", "flag")["options"].api_key == "flag"


def test_vllm_serve_spellings_reach_the_server(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("PAGEDINFER_API_KEY", raising=False)
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}\n")
    seen = captured_options(
        monkeypatch,
        "--chat-template",
        str(template),
        "--trust-request-chat-template",
        "--ignore-unknown-fields",
        "--enable-prompt-tokens-details",  # usage.prompt_tokens_details, as vLLM's
        "--uvicorn-log-level",
        "debug",
        "--no-enable-prefix-caching",
        "--block-size",
        "16",
        "-tp",
        "2",
        "--num-gpu-blocks-override",
        "64",
        model=("--model", "dir-by-flag"),
    )
    assert seen["model"] == "dir-by-flag"
    assert seen["options"] == ServingOptions(
        chat_template=template.read_text(),
        trust_request_chat_template=True,
        ignore_unknown_fields=True,
        enable_prompt_tokens_details=True,
    )
    assert seen["log_level"] == "debug"
    engine = seen["engine_kwargs"]
    assert engine["enable_prefix_caching"] is False
    assert (engine["kv_block_size"], engine["tensor_parallel_size"]) == (16, 2)
    assert engine["num_kv_blocks"] == 64
    # The template itself, with vLLM's escapes; the old spelling of the prefix-cache flag.
    inline = captured_options(
        monkeypatch, "--chat-template", "{{ messages[0]['content'] }}\\n", "--no-prefix-caching"
    )
    assert inline["options"].chat_template == "{{ messages[0]['content'] }}\n"
    assert inline["engine_kwargs"]["enable_prefix_caching"] is False
    assert captured_options(monkeypatch)["engine_kwargs"]["enable_prefix_caching"] is True
    same = captured_options(monkeypatch, model=("dir", "--model", "dir"))
    assert same["model"] == "dir"


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (("--model", "other"), {}, "two models given"),
        (("--chat-template", "/no/such/template"), {}, "looks like a file path"),
        ((), {"PAGEDINFER_API_KEY": ""}, "PAGEDINFER_API_KEY is set but empty"),
        (("--api-key", ""), {}, "api_key must be a non-empty string"),
        (("--max-request-bytes", "0"), {}, "--max-request-bytes"),
        (("--header-timeout-s", "inf"), {}, "--header-timeout-s"),
        (("--body-timeout-s", "-1"), {}, "--body-timeout-s"),
        (("--allowed-hosts", ","), {}, "--allowed-hosts"),
        (("--speculative-config", "{'k': 3}"), {}, "--speculative-config"),
        (("--speculative_config", '{"method": "eagle"}'), {}, "num_speculative_tokens"),
    ],
)
def test_bad_serve_options_are_user_errors(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: tuple[str, ...],
    env: dict[str, str],
    message: str,
) -> None:
    import pagedinfer.serving.server as server

    monkeypatch.delenv("PAGEDINFER_API_KEY", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(server, "run_server", lambda *a, **kw: pytest.fail("ran"))
    try:
        status = main(["serve", "model-dir", *args])
    except SystemExit as exit:  # argparse
        status = exit.code  # type: ignore[assignment]
    assert status == EXIT_USER_ERROR
    assert message in capsys.readouterr().err
