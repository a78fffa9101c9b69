"""``LLM.beam_search`` (vLLM's): the same beams and cumulative log-probabilities as the beam
algorithm run directly on transformers' float32 log-probabilities, EOS and length penalties
included; the prefix cache shares the prompt's blocks between beams and steps; bad
parameters are refused by name."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import pagedinfer
from hf_reference import hf_model
from pagedinfer import LLM, BeamSearchParams
from pagedinfer.domain.beam_search import beam_score
from pagedinfer.errors import InvalidRequestError, InvalidSamplingParamsError

SMALL: dict[str, Any] = {"device": "cpu", "max_model_len": 64, "kv_block_size": 4}
PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 300, 12], [400, 2, 61]]


def reference(
    path: Path,
    prompt: list[int],
    width: int,
    max_tokens: int,
    eos: set[int],
    *,
    ignore_eos: bool = False,
    length_penalty: float = 1.0,
) -> list[tuple[list[int], float, bool]]:
    """Beam search as vLLM's LLM.beam_search defines it, on transformers' log-softmax: every
    live beam's top 2*width tokens are candidates; EOS ones finish, the best ``width`` others
    live on; at the end finished and live beams are ranked by cum / length**penalty (length
    without a final EOS). Returns (tokens, cum_logprob, ended_in_eos), best first."""
    model = hf_model(str(path))
    live: list[tuple[list[int], float]] = [(list(prompt), 0.0)]
    finished: list[tuple[list[int], float, bool]] = []
    for _ in range(max_tokens):
        if not live:
            break
        with torch.inference_mode():
            logits = model(torch.tensor([tokens for tokens, _ in live])).logits[:, -1]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        candidates = []
        for (tokens, cum), row in zip(live, logprobs, strict=True):
            top = torch.topk(row, 2 * width)
            for value, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                if token in eos and not ignore_eos:
                    finished.append(([*tokens, token], cum + value, True))
                else:
                    candidates.append(([*tokens, token], cum + value))
        candidates.sort(key=lambda c: -c[1])
        live = candidates[:width]
    beams = finished + [(tokens, cum, False) for tokens, cum in live]

    def score(beam: tuple[list[int], float, bool]) -> float:
        tokens, cum, _ = beam
        length = len(tokens) - (1 if tokens[-1] in eos else 0)
        return cum / length**length_penalty

    return sorted(beams, key=score, reverse=True)[:width]


@pytest.fixture(scope="module")
def eos_token(make_checkpoint: Callable[..., Path]) -> int:
    """A token that is the second most likely first token of PROMPTS[0]: with it as EOS,
    beams finish at the first step already."""
    model = hf_model(str(make_checkpoint("tiny")))
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPTS[0]])).logits[0, -1]
    return int(torch.topk(logits, 2).indices[1])


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path], eos_token: int) -> Path:
    # The same weights as "tiny" (same seed); only config.json's eos_token_id differs.
    return make_checkpoint("tiny", eos_token_id=eos_token)


@pytest.fixture(scope="module")
def llm(checkpoint: Path) -> Iterator[LLM]:
    with LLM(model=str(checkpoint), **SMALL) as llm:
        yield llm


def _check_against_reference(
    output: pagedinfer.BeamSearchOutput,
    expected: list[tuple[list[int], float, bool]],
    prompt: list[int],
) -> None:
    assert [s.tokens for s in output.sequences] == [tokens for tokens, _, _ in expected]
    for sequence, (_, cum, ended) in zip(output.sequences, expected, strict=True):
        assert sequence.cum_logprob == pytest.approx(cum, abs=1e-4)
        assert sequence.finish_reason == ("stop" if ended else "length")
        assert sequence.num_prompt_tokens == len(prompt)
        assert sequence.tokens[: len(prompt)] == prompt
        generated = sequence.output_token_ids
        # One logprobs dict per generated token, holding it; their sum is cum_logprob.
        assert len(sequence.logprobs) == len(generated)
        steps = zip(sequence.logprobs, generated, strict=True)
        chosen = [step[token].logprob for step, token in steps]
        assert math.fsum(chosen) == pytest.approx(sequence.cum_logprob, abs=1e-9)
        assert sequence.text == ""  # no tokenizer


@pytest.mark.parametrize("length_penalty", [1.0, 0.3, 3.0])
def test_beams_match_transformers_brute_force(
    llm: LLM, checkpoint: Path, eos_token: int, length_penalty: float
) -> None:
    params = BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=length_penalty)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert len(outputs) == len(PROMPTS)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        expected = reference(checkpoint, prompt, 3, 5, {eos_token}, length_penalty=length_penalty)
        _check_against_reference(output, expected, prompt)
        assert output.prompt_token_ids == prompt and output.prompt is None
    # EOS ended some beam of the first prompt at step one (how the checkpoint was chosen).
    finished = [s for s in outputs[0].sequences if s.finish_reason == "stop"]
    assert finished and all(s.tokens[-1] == eos_token for s in finished)


def test_ignore_eos_and_a_wider_beam_match_the_reference(
    llm: LLM, checkpoint: Path, eos_token: int
) -> None:
    params = BeamSearchParams(beam_width=4, max_tokens=4, ignore_eos=True)
    (output,) = llm.beam_search(PROMPTS[0], params)
    expected = reference(checkpoint, PROMPTS[0], 4, 4, {eos_token}, ignore_eos=True)
    _check_against_reference(output, expected, PROMPTS[0])
    assert all(
        s.finish_reason == "length" and len(s.output_token_ids) == 4 for s in output.sequences
    )


def test_scores_order_the_sequences(llm: LLM, eos_token: int) -> None:
    params = BeamSearchParams(beam_width=3, max_tokens=4, length_penalty=0.5)
    (output,) = llm.beam_search([PROMPTS[0]], params)
    scores = [
        beam_score(s.cum_logprob, len(s.tokens) - (s.tokens[-1] == eos_token), 0.5)
        for s in output.sequences
    ]
    assert scores == sorted(scores, reverse=True)


def test_beams_stop_at_max_model_len(checkpoint: Path, eos_token: int) -> None:
    prompt = PROMPTS[1]
    with LLM(model=str(checkpoint), **{**SMALL, "max_model_len": len(prompt) + 2}) as llm:
        (output,) = llm.beam_search(
            [prompt], BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True)
        )
    expected = reference(checkpoint, prompt, 2, 2, {eos_token}, ignore_eos=True)
    _check_against_reference(output, expected, prompt)
    assert {len(s.tokens) for s in output.sequences} == {len(prompt) + 2}


def test_beams_share_the_prompts_blocks_through_the_prefix_cache(
    checkpoint: Path, eos_token: int
) -> None:
    prompt = list(range(10, 34))  # six full blocks of 4
    params = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    with LLM(model=str(checkpoint), **SMALL) as llm:
        (cached,) = llm.beam_search([prompt], params)
        stats = llm.stats()
    # Step 1 computes the prompt once; every later one-token request finds its full blocks.
    assert stats.num_requests_finished == 1 + 2 + 2
    assert stats.prefix_cache_hit_rate > 0.7
    with LLM(model=str(checkpoint), enable_prefix_caching=False, **SMALL) as llm:
        (uncached,) = llm.beam_search([prompt], params)
        assert llm.stats().prefix_cache_hit_rate == 0.0
    assert [s.tokens for s in cached.sequences] == [s.tokens for s in uncached.sequences]
    for a, b in zip(cached.sequences, uncached.sequences, strict=True):
        assert a.cum_logprob == pytest.approx(b.cum_logprob, abs=1e-4)


def test_texts_concurrency_limit_and_progress_bar(
    make_checkpoint: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    path = make_checkpoint("tiny", with_tokenizer=True)
    with LLM(model=str(path), **SMALL) as llm:
        tokenizer = llm.get_tokenizer()
        prompts = ["Hello, my name is", "The capital of France is", "0 1 2"]
        params = BeamSearchParams(beam_width=2, max_tokens=3)
        together = llm.beam_search(prompts, params)
        assert "Beam search" not in capsys.readouterr().err
        apart = llm.beam_search(prompts, params, use_tqdm=True, concurrency_limit=1)
        assert capsys.readouterr().err.count("Beam search") >= len(prompts)  # a bar each
    assert [[s.tokens for s in o.sequences] for o in together] == [
        [s.tokens for s in o.sequences] for o in apart
    ]
    for prompt, output in zip(prompts, together, strict=True):
        assert output.prompt == prompt
        for sequence in output.sequences:
            shown = sequence.tokens
            if sequence.finish_reason == "stop":
                shown = shown[:-1]  # the EOS's text is left out by default
            assert sequence.text == tokenizer.decode(shown)
            assert sequence.text.startswith(prompt)


def test_bad_parameters_are_refused_by_name(llm: LLM) -> None:
    for fields, name in [
        ({"beam_width": 0, "max_tokens": 2}, "beam_width"),
        ({"beam_width": 2.0, "max_tokens": 2}, "beam_width"),
        ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
        ({"beam_width": 2, "max_tokens": True}, "max_tokens"),
        ({"beam_width": 2, "max_tokens": 2, "temperature": -1.0}, "temperature"),
        ({"beam_width": 2, "max_tokens": 2, "length_penalty": math.nan}, "length_penalty"),
        ({"beam_width": 2, "max_tokens": 2, "ignore_eos": 1}, "ignore_eos"),
    ]:
        with pytest.raises(InvalidSamplingParamsError, match=f"BeamSearchParams.{name}="):
            BeamSearchParams(**fields)
    with pytest.raises(InvalidRequestError, match=r"beam_width=11 .* max_logprobs=20"):
        llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(InvalidRequestError, match="BeamSearchParams"):
        llm.beam_search([PROMPTS[0]], pagedinfer.SamplingParams())  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="lora_request"):
        llm.beam_search([PROMPTS[0]], BeamSearchParams(2, 2), lora_request=object())
    with pytest.raises(InvalidRequestError, match="concurrency_limit=0"):
        llm.beam_search([PROMPTS[0]], BeamSearchParams(2, 2), concurrency_limit=0)
    with pytest.raises(InvalidRequestError, match="out of vocabulary"):
        llm.beam_search([PROMPTS[0], [10**6]], BeamSearchParams(2, 2))
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        llm.beam_search("a text", BeamSearchParams(2, 2))
    assert not llm.has_unfinished_requests()  # nothing was queued


def test_extreme_length_penalties_rank_without_raising() -> None:
    assert beam_score(-3.0, 4, 1.0) == -0.75
    assert beam_score(-3.0, 4, 1e6) == -0.0
    assert beam_score(-3.0, 4, -1e6) == -math.inf
    assert beam_score(0.0, 4, -1e6) == 0.0
