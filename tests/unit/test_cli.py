"""The command line: user errors are one line on stderr with exit status 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pagedinfer import __version__
from pagedinfer.cli import EXIT_USER_ERROR, main


@pytest.fixture(autouse=True)
def restore_threads() -> Iterator[None]:
    """The commands set torch's (process-wide) threads: --num-threads auto by default."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> str:
    return str(make_checkpoint("tiny", with_tokenizer=True))


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        status = main(argv)
    except SystemExit as exit_:  # argparse's own exits (--help, --version, bad options)
        status = int(exit_.code or 0)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


STARTUP_LINE = "pagedinfer generate: model "


def _after_startup(err: str) -> str:
    """stderr without generate's start-up line (printed once the model has loaded)."""
    return "".join(line for line in err.splitlines(True) if not line.startswith(STARTUP_LINE))


def _assert_one_line_error(status: int, err: str, *needles: str) -> None:
    assert status == EXIT_USER_ERROR
    lines = _after_startup(err).strip().splitlines()
    assert len(lines) == 1, err
    assert "error:" in lines[0] and "Traceback" not in err
    for needle in needles:
        assert needle in lines[0]


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["generate", "--model", "/no/such/dir", "--prompt", "hi"], ["/no/such/dir"]),
        (["generate", "--model", "Qwen/Qwen3-0.6B", "--prompt", "hi"], ["Hub id"]),
        (["generate", "--prompt", "hi"], ["--model"]),
        (["generate", "--model", "CKPT", "--token-ids", "1,x,3"], ["--token-ids", "'1,x,3'"]),
        (["generate", "--model", "CKPT", "--token-ids", ","], ["--token-ids"]),
        (["generate", "--model", "CKPT", "--token-ids", "1,2,100000"], ["100000", "[0, 512)"]),
        (["generate", "--model", "CKPT", "--prompt", "hi", "--temperature", "-1"], ["temperature"]),
        (["generate", "--model", "CKPT", "--prompt", "hi", "--top-p", "0"], ["top_p"]),
        (["generate", "--model", "CKPT", "--prompt", "hi", "--max-tokens", "0"], ["max_tokens"]),
        (["generate", "--model", "CKPT", "--prompt", "hi", "--max-model-len", "x"], ["invalid"]),
        (["generate", "--model", "CKPT", "--prompt", "hi", "--device", "tpu"], ["device"]),
        (
            ["generate", "--model", "CKPT", "--prompt", "hi", "--max-model-len", "4097"],
            ["max_model_len=4097 exceeds the model's context of 4096 positions"],
        ),
        (["generate", "--model", "CKPT", "--prompt", "hi", "--num-threads", "0"], ["'0'"]),
        (["generate", "--model", "CKPT", "--prompt", "hi", "--num-threads", "x"], ["'x'"]),
        (["generate", "--model", "CKPT", "--prompt", "hi", "--kv-block-size", "0"], ["kv_block"]),
        (
            ["generate", "CKPT", "--prompt", "hi", "--speculative-config", "{method: ngram}"],
            ["--speculative-config", "JSON object", "'{method: ngram}'"],
        ),
        (
            ["generate", "CKPT", "--prompt", "hi", "--speculative_config", '{"method": "ngram"}'],
            ["--speculative-config", "num_speculative_tokens"],
        ),
        (
            ["generate", "CKPT", "--prompt", "hi", "--speculative-config", '"ngram"'],
            ["--speculative-config", "expected a dict"],
        ),
        (
            [
                *("generate", "CKPT", "--prompt", "hi", "--async-scheduling"),
                *("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'),
            ],
            ["speculative_config cannot run with async_scheduling=True"],
        ),
        (["generate", "--model", "CKPT"], ["--prompt"]),
        (["generate", "--model", "CKPT", "--prompt", "hi", "--no-such-flag"], ["--no-such-flag"]),
        (["no-such-command"], ["no-such-command"]),
    ],
)
def test_user_errors_are_one_line_with_status_2(
    argv: list[str], needles: list[str], checkpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [checkpoint if arg == "CKPT" else arg for arg in argv]
    status, out, err = _run(argv, capsys)
    _assert_one_line_error(status, err, *needles)
    assert out == ""


def test_a_checkpoint_without_config_is_a_user_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = _run(["generate", "--model", str(tmp_path), "--prompt", "hi"], capsys)
    _assert_one_line_error(status, err, "config.json")


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(["--version"], capsys)
    assert status == 0 and out.strip() == f"pagedinfer {__version__}"


@pytest.mark.parametrize("command", ["generate", "demo", "bench"])
def test_help_shows_defaults(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run([command, "--help"], capsys)
    assert status == 0
    out = " ".join(out.split())  # argparse wraps to the terminal's width
    assert "--model DIR" in out
    assert "(default: 4096, or the model's limit if lower)" in out  # --max-model-len
    assert "(default: auto)" in out  # --num-threads
    assert "(default: 256)" in out  # --kv-block-size
    if command != "bench":
        assert "(default: 64)" in out  # --max-tokens


def test_generate_prints_each_output(checkpoint: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--model", checkpoint, "--device", "cpu", "--kv-block-size", "16"]
    argv += ["--max-model-len", "64", "--token-ids", "1,2,3", "--prompt", "Hello"]
    status, out, _ = _run([*argv, "--max-tokens", "3", "--ignore-eos"], capsys)
    assert status == 0
    lines = out.strip().splitlines()
    assert [line.split()[:2] for line in lines] == [["[0]", "(length)"], ["[1]", "(length)"]]


def test_no_traceback_from_a_real_process(tmp_path: Path) -> None:
    """What a user sees in a terminal: python -m pagedinfer with a bad path."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedinfer",
            "generate",
            "--model",
            str(tmp_path / "x"),
            "--prompt",
            "hi",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == EXIT_USER_ERROR
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_ctrl_c_exits_130_without_a_traceback(
    checkpoint: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagedinfer import Engine

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "generate", interrupted)
    argv = ["generate", "--model", checkpoint, "--device", "cpu", "--kv-block-size", "16"]
    status, _, err = _run([*argv, "--max-model-len", "64", "--token-ids", "1,2"], capsys)
    assert status == 130 and _after_startup(err).strip() == "pagedinfer generate: interrupted"


# ----------------------------------------------------- vLLM's spellings (issue 22 item 11)
def test_generate_takes_the_model_as_serve_does(
    checkpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """MODEL_DIR or --model DIR, for generate as for serve; the start-up line on stderr."""
    common = ["--device", "cpu", "--kv-block-size", "16", "--max-model-len", "64"]
    common += ["--token-ids", "1,2,3", "--max-tokens", "2", "--ignore-eos"]
    outs = []
    for model in ([checkpoint], ["--model", checkpoint], [checkpoint, "--model", checkpoint]):
        status, out, err = _run(["generate", *model, *common], capsys)
        assert status == 0, err
        outs.append(out)
        (line,) = [line for line in err.splitlines() if line.startswith(STARTUP_LINE)]
        for needle in ("device cpu", "dtype float32", "KV blocks of 16 tokens", "max_model_len 64"):
            assert needle in line, line
    assert outs[0] == outs[1] == outs[2]
    status, _, err = _run(["generate", checkpoint, "--model", "/other", *common], capsys)
    _assert_one_line_error(status, err, "two models given")
    status, _, err = _run(["generate", *common], capsys)
    _assert_one_line_error(status, err, "MODEL_DIR", "--model")


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_help_has_vllms_flag_names_and_no_markup(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = _run([command, "--help"], capsys)
    assert status == 0
    for flag in (
        "--max-model-len",
        "--gpu-memory-utilization",
        "--tensor-parallel-size",
        "--max-num-seqs",
        "--dtype",
        "--enable-prefix-caching, --no-enable-prefix-caching",
        "--block-size",
        "MODEL_DIR",
        "--model DIR",
    ):
        assert flag in out, flag
    if command == "serve":
        assert "--served-model-name" in out and "--chat-template" in out
    _, top, _ = _run(["--help"], capsys)
    assert "``" not in out and "``" not in top


def test_prefix_caching_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedinfer import cli

    seen: list[object] = []
    monkeypatch.setitem(cli._COMMANDS, "generate", lambda args: seen.append(args) or 0)
    for flags, enabled in (
        ([], True),
        (["--no-enable-prefix-caching"], False),
        (["--no-prefix-caching"], False),  # the old spelling
        (["--no-prefix-caching", "--enable-prefix-caching"], True),
    ):
        assert main(["generate", "m", "--prompt", "x", *flags]) == 0
        assert cli._engine_kwargs(seen[-1])["enable_prefix_caching"] is enabled, flags


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_parallelism_flags_reach_the_engine(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedinfer import cli

    seen: list[object] = []
    monkeypatch.setitem(cli._COMMANDS, command, lambda args: seen.append(args) or 0)
    prompt = ["--prompt", "x"] if command == "generate" else []
    assert main([command, "m", *prompt]) == 0
    kwargs = cli._engine_kwargs(seen[-1])
    assert (kwargs["distributed_executor_backend"], kwargs["pipeline_parallel_size"]) == ("mp", 1)
    flags = ["--distributed-executor-backend", "ray", "-pp", "2", "-tp", "2"]
    assert main([command, "m", *prompt, *flags]) == 0
    kwargs = cli._engine_kwargs(seen[-1])
    assert kwargs["distributed_executor_backend"] == "ray"
    assert (kwargs["pipeline_parallel_size"], kwargs["tensor_parallel_size"]) == (2, 2)


def test_kv_cache_dtype_fp8_shows_its_capacity_in_the_startup_line(
    checkpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--kv-cache-dtype fp8: the same --kv-cache-memory-bytes hold four times the blocks of
    the float32 cache, and the start-up line names the float8 element type."""
    common = ["--device", "cpu", "--kv-block-size", "16", "--max-model-len", "64"]
    common += ["--kv-cache-memory-bytes", str(8 * 16384), "--token-ids", "1,2,3"]
    common += ["--max-tokens", "2", "--ignore-eos"]  # a float32 block of the tiny model: 16 KiB
    lines = {}
    for dtype in ("auto", "fp8"):
        status, _, err = _run(["generate", checkpoint, *common, "--kv-cache-dtype", dtype], capsys)
        assert status == 0, err
        (lines[dtype],) = [line for line in err.splitlines() if line.startswith(STARTUP_LINE)]
    assert "8 KV blocks of 16 tokens," in lines["auto"], lines
    assert "32 KV blocks of 16 tokens (float8_e4m3fn)" in lines["fp8"], lines


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}


@pytest.mark.parametrize("command", ["generate", "demo", "bench", "serve"])
def test_speculative_config_flag_reaches_the_engine(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's --speculative-config JSON (or --speculative_config): the dict, for every
    command that builds an engine; off by default."""
    import json

    from pagedinfer import cli

    seen: list[object] = []
    monkeypatch.setitem(cli._COMMANDS, command, lambda args: seen.append(args) or 0)
    model = ["m", "--prompt", "x"] if command == "generate" else ["m"] * (command == "serve")
    assert main([command, *model]) == 0
    assert cli._engine_kwargs(seen[-1])["speculative_config"] is None
    for flag in ("--speculative-config", "--speculative_config"):
        assert main([command, *model, flag, json.dumps(NGRAM)]) == 0
        assert cli._engine_kwargs(seen[-1])["speculative_config"] == NGRAM


def test_generate_with_speculation_prints_the_same_tokens(
    checkpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    argv = ["generate", checkpoint, "--device", "cpu", "--kv-block-size", "16"]
    argv += ["--max-model-len", "64", "--token-ids", "5,6,7,8", "--max-tokens", "16"]
    argv += ["--ignore-eos", "--skip-tokenizer-init"]  # the token ids are printed
    status, plain, err = _run(argv, capsys)
    assert status == 0, err
    status, speculative, err = _run([*argv, "--speculative-config", json.dumps(NGRAM)], capsys)
    assert status == 0, err
    assert speculative == plain and len(plain.split()) == 2 + 16


def test_demo_reports_the_acceptance(checkpoint: str, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    argv = ["demo", "--model", checkpoint, "--device", "cpu", "--kv-block-size", "16"]
    argv += ["--max-model-len", "128", "--max-tokens", "24", "--temperature", "0"]
    status, out, err = _run(argv, capsys)
    assert status == 0, err
    assert "speculative decoding" not in out
    status, out, err = _run([*argv, "--speculative-config", json.dumps(NGRAM)], capsys)
    assert status == 0, err
    (line,) = [line for line in out.splitlines() if line.startswith("speculative decoding: ")]
    assert "% of " in line and "drafts accepted" in line and "tokens per verify row" in line
