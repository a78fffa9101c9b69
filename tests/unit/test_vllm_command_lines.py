"""A ``vllm serve`` command line runs unchanged on ``pagedinfer serve`` (and vLLM's ``LLM``
keyword arguments on ``LLM``): flags that map are mapped, flags that change nothing are
accepted and named in one line, values pagedinfer cannot honour are refused with the reason,
settings that do not fit the CPU are warned about, and an unknown flag points at the
command's own ``--help`` (issue 46)."""

from __future__ import annotations

import json
import logging
import shlex
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedinfer import LLM
from pagedinfer.cli import EXIT_USER_ERROR, main
from pagedinfer.engine.config import EngineConfig

# A typical vLLM deployment's command line (vLLM's docs and recipes), model path aside.
VLLM_SERVE = (
    "serve {model} --host 127.0.0.1 --port 8000 --served-model-name qwen "
    "--trust-remote-code --dtype auto --max-model-len 256 --gpu-memory-utilization 0.9 "
    "--enable-prefix-caching --enable-chunked-prefill --max-num-seqs 64 "
    "--max-num-batched-tokens 2048 --tensor-parallel-size 1 --swap-space 4 "
    "--disable-log-stats --disable-log-requests --generation-config vllm --seed 0 "
    "--block-size 16 --kv-cache-dtype auto --enable-auto-tool-choice --tool-call-parser hermes "
    "--uvicorn-log-level info --max-log-len 100 --load-format safetensors --tokenizer-mode auto"
)


@pytest.fixture(autouse=True)
def restore_threads() -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> str:
    return str(make_checkpoint("tiny", with_tokenizer=True))


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """What ``pagedinfer serve`` would serve: run_server's arguments (no server starts)."""
    pytest.importorskip("fastapi")
    from pagedinfer.serving import server

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(server, "run_server", lambda model, **kwargs: calls.append(kwargs))
    return calls


def _serve(argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        status = main(shlex.split(argv))
    except SystemExit as exit_:
        status = int(exit_.code or 0)
    return status, capsys.readouterr().err


def test_a_typical_vllm_serve_command_line_runs_unchanged(
    checkpoint: str, served: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    status, err = _serve(VLLM_SERVE.format(model=checkpoint), capsys)
    assert status == 0, err
    (call,) = served
    assert (call["served_model_name"], call["port"], call["log_level"]) == ("qwen", 8000, "info")
    assert call["options"].tool_call_parser == "hermes"
    config = EngineConfig.from_options(checkpoint, call["engine_kwargs"])
    assert (config.kv_block_size, config.max_num_seqs, config.max_model_len) == (16, 64, 256)
    assert config.generation_config == "vllm" and config.enable_prefix_caching
    notes = [line for line in err.splitlines() if "changing nothing here" in line]
    assert len(notes) == 1, err  # one line for all of them, each with its reason
    for flag in ("--trust-remote-code", "--swap-space 4.0", "--disable-log-requests"):
        assert flag in notes[0]
    assert "warning" not in err  # nothing that does not fit the CPU


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        ("--quantization fp8", ["--quantization fp8", "unquantized checkpoint"]),
        ("--no-enable-chunked-prefill", ["--no-enable-chunked-prefill", "chunks"]),
        ("--revision main", ["--revision main", "never downloads"]),
        (
            "--no-such-flag 3",
            ["unrecognized arguments: --no-such-flag 3", "pagedinfer serve --help"],
        ),
    ],
)
def test_what_cannot_be_honoured_is_refused_with_the_reason(
    checkpoint: str,
    served: list[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    flags: str,
    needles: list[str],
) -> None:
    status, err = _serve(f"serve {checkpoint} {flags}", capsys)
    assert status == EXIT_USER_ERROR and not served
    (line,) = err.strip().splitlines()
    for needle in needles:
        assert needle in line, line


def test_quantization_that_matches_the_checkpoint_is_accepted(
    checkpoint: str,
    tmp_path: Path,
    served: list[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = tmp_path / "fp8"
    shutil.copytree(checkpoint, model)
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (model / "config.json").write_text(json.dumps(config))
    status, err = _serve(f"serve {model} --quantization fp8", capsys)
    assert status == 0 and served, err
    assert "--quantization fp8 (the checkpoint's own quantization" in err


def test_gpu_settings_on_the_cpu_are_warned_about_with_the_reason(
    checkpoint: str, served: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    flags = "--device cpu --tensor-parallel-size 2 --dtype float16 --gpu-memory-utilization 0.5"
    status, err = _serve(f"serve {checkpoint} {flags}", capsys)
    assert status == 0, err
    warnings = [line for line in err.splitlines() if "warning:" in line]
    assert len(warnings) == 3, err
    assert "--tensor-parallel-size 2 on the CPU" in warnings[0]
    assert "--dtype float16 on the CPU" in warnings[1]
    assert "--gpu-memory-utilization 0.5 sizes nothing on the CPU" in warnings[2]


def test_typical_vllm_llm_keyword_arguments_run_unchanged(
    checkpoint: str, caplog: pytest.LogCaptureFixture
) -> None:
    vllm_kwargs: dict[str, Any] = {
        "model": checkpoint,
        "trust_remote_code": True,
        "dtype": "auto",
        "max_model_len": 256,
        "gpu_memory_utilization": 0.5,
        "enable_prefix_caching": True,
        "enable_chunked_prefill": True,
        "swap_space": 4,
        "disable_log_stats": True,
        "seed": 0,
        "block_size": 16,
        "generation_config": "vllm",
        "tensor_parallel_size": 1,
        "device": "cpu",
    }
    with (
        caplog.at_level(logging.WARNING, logger="pagedinfer.engine.llm"),
        LLM(**vllm_kwargs) as llm,
    ):
        assert llm.config.kv_block_size == 16 and llm.max_model_len == 256
    (record,) = caplog.records
    assert "gpu_memory_utilization=0.5 sizes nothing on the CPU" in record.getMessage()
