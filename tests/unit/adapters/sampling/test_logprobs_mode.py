"""``logprobs_mode`` (``adapters/sampling/logprobs_mode.py``): raw or processed logprobs or
logits of the sampled token and its top-k entries, through ``SamplingPipeline``, against the
definitions written out here."""

from __future__ import annotations

import pytest
import torch

from pagedinfer.adapters.host_transfers import HostUploads, Readbacks
from pagedinfer.adapters.sampling.logprobs_mode import (
    LOGPROBS_MODES,
    LogprobsMode,
    validate_logprobs_mode,
)
from pagedinfer.adapters.sampling.pipeline import SamplingPipeline
from pagedinfer.adapters.step_inputs import StepPacker
from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.engine.config import EngineConfig
from pagedinfer.errors import ConfigurationError

from .test_sampling_pipeline import _plan

CPU = torch.device("cpu")
VOCAB = 8
LOGITS = torch.tensor([0.5, 2.0, 1.6, 1.2, -0.3, 0.0, 0.7, -1.0])
TEMPERATURE = 0.7
TOP_K = 3


def _top_k_masked(values: torch.Tensor, k: int) -> torch.Tensor:
    threshold = values.topk(k).values[-1]
    return values.masked_fill(values < threshold, float("-inf"))


def _sample(mode: LogprobsMode, params: SamplingParams) -> tuple[int, list[int], list[float]]:
    """One decode step of one request under ``mode``: the sampled token, and its logprobs
    entry's token ids and values (the sampled token first, then the top ``params.logprobs``)."""
    pipeline = SamplingPipeline(
        max_running=4,
        vocab_size=VOCAB,
        eos_token_ids=(0,),
        device=CPU,
        seed=0,
        uploads=HostUploads(CPU),
        readbacks=Readbacks(CPU),
        logprobs_mode=mode,
    )
    plan = _plan(1, params=params)
    delta = pipeline.begin(plan)
    inputs = StepPacker(CPU, sampled=True, zero_copy=True).pack(plan, delta)
    assert inputs.table_rows is not None
    pipeline.table.write_rows(*inputs.table_rows)
    logits = LOGITS.clone().unsqueeze(0)
    sampled = pipeline.sample(plan, logits, inputs.sample_slots, inputs.sample_positions)()
    assert sampled.logprobs is not None
    (entry,) = sampled.logprobs
    assert entry is not None
    return sampled.token_ids[0], entry.token_ids, entry.logprobs


def _expected(mode: str, greedy: bool = False, bias: float = 0.0) -> torch.Tensor:
    """What ``mode`` reports for ``LOGITS`` (token 3 biased by ``bias``), from the definitions."""
    values = LOGITS.clone()
    if mode.startswith("processed"):
        values[3] += bias
        if not greedy:
            values = _top_k_masked(values / TEMPERATURE, TOP_K)
    return torch.log_softmax(values, 0) if mode.endswith("logprobs") else values


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
@pytest.mark.parametrize("greedy", [False, True])
def test_each_mode_reports_its_distribution(mode: LogprobsMode, greedy: bool) -> None:
    params = SamplingParams(
        temperature=0.0 if greedy else TEMPERATURE,
        top_k=TOP_K,
        logit_bias={3: 1.5},
        logprobs=4,
        seed=5,
    )
    token, ids, values = _sample(mode, params)
    expected = _expected(mode, greedy, bias=1.5)
    assert ids[0] == token and len(ids) == 5
    torch.testing.assert_close(torch.tensor(values), expected[ids], rtol=0, atol=1e-5)
    # The top entries are the top 4 of the reported values, in descending order.
    torch.testing.assert_close(torch.tensor(values[1:]), expected.topk(4).values)
    if greedy:
        assert token == 3  # the bias made token 3 the argmax (2.7 > 2.0)


def test_raw_ignores_the_sampling_parameters_processed_does_not() -> None:
    params = SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, logit_bias={3: 1.5}, logprobs=0)
    raw = _sample("raw_logprobs", params)[2][0]
    processed = _sample("processed_logprobs", params)[2][0]
    token = _sample("raw_logprobs", params)[0]
    assert raw == pytest.approx(float(torch.log_softmax(LOGITS, 0)[token]), abs=1e-6)
    assert processed != pytest.approx(raw, abs=1e-3)
    # raw_logits: the logit itself, which no softmax bounds above by 0.
    assert _sample("raw_logits", params)[2][0] == pytest.approx(float(LOGITS[token]), abs=1e-6)


def test_an_unknown_mode_is_refused_with_the_choices() -> None:
    assert validate_logprobs_mode("processed_logits") == "processed_logits"
    with pytest.raises(ConfigurationError) as error:
        EngineConfig(model_path="m", logprobs_mode="processed")
    message = str(error.value)
    assert "logprobs_mode='processed'" in message
    assert all(mode in message for mode in LOGPROBS_MODES)
    assert EngineConfig(model_path="m").logprobs_mode == "raw_logprobs"


def test_the_command_line_flag_reaches_the_engine(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pagedinfer import cli

    seen: list[object] = []
    monkeypatch.setitem(cli._COMMANDS, "generate", lambda args: seen.append(args) or 0)
    assert cli.main(["generate", "m", "--prompt", "x"]) == 0
    assert cli._engine_kwargs(seen[-1])["logprobs_mode"] == "raw_logprobs"
    assert cli.main(["generate", "m", "--prompt", "x", "--logprobs-mode", "raw_logits"]) == 0
    assert cli._engine_kwargs(seen[-1])["logprobs_mode"] == "raw_logits"
    with pytest.raises(SystemExit):
        cli.main(["generate", "m", "--prompt", "x", "--logprobs-mode", "logits"])
    assert "processed_logprobs" in capsys.readouterr().err
