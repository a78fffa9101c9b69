"""``pagedinfer quantize``: a dense checkpoint written as FP8 block-wise or 4-bit GPTQ loads,
the start-up line names the quantization, and what cannot be quantized is refused (issue 46)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pagedinfer import Engine, SamplingParams
from pagedinfer.cli import EXIT_USER_ERROR, main

OPTIONS = {"device": "cpu", "kv_block_size": 16, "max_model_len": 64, "num_kv_blocks": 16}


@pytest.fixture(autouse=True)
def restore_threads() -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def dense(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny", with_tokenizer=True)


@pytest.mark.parametrize(
    ("method", "named"), [("fp8", "fp8 (e4m3 weights, 32x32 blocks)"), ("gptq", "gptq")]
)
def test_a_quantized_checkpoint_loads_and_says_so(
    dense: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], method: str, named: str
) -> None:
    target = tmp_path / method
    sizes = ["--group-size", "32", "--block", "32"]
    argv = ["quantize", str(dense), str(target), "--method", method, *sizes]
    assert main(argv) == 0
    assert named in capsys.readouterr().out
    assert (target / "tokenizer.json").exists()
    with Engine(target, **OPTIONS) as engine:
        assert f"quantization {named}" in engine.describe()
        (output,) = engine.generate(
            ["Hello"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        )
        assert len(output.outputs[0].token_ids) == 4


def test_what_cannot_be_quantized_is_refused(
    dense: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "fp8"
    assert main(["quantize", str(dense), str(target), "--method", "fp8", "--block", "32"]) == 0
    capsys.readouterr()
    for argv, needle in (
        (["quantize", str(target), str(tmp_path / "again"), "--method", "fp8"], "already"),
        (["quantize", str(dense), str(target), "--method", "fp8"], "is not empty"),
        (["quantize", str(dense), str(tmp_path / "b"), "--method", "fp8"], "does not divide"),
        (["quantize", str(dense), str(tmp_path / "g"), "--method", "gptq", "--group-size", "7"],
         "does not divide"),
        (["quantize", "/no/such/dir", str(tmp_path / "x"), "--method", "fp8"], "/no/such/dir"),
    ):  # fmt: skip
        assert main(argv) == EXIT_USER_ERROR, argv
        assert needle in capsys.readouterr().err, argv
