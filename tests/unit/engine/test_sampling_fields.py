"""vLLM's SamplingParams fields through the engine, against references (#12, #11.6).

logprobs / prompt_logprobs against transformers' log_softmax; repetition_penalty against
transformers' generate; presence / frequency penalties, min_tokens, logit_bias and
allowed_token_ids against a step-by-step transformers loop with the rule written out; n > 1
against single requests with the documented seed rule; chat() against generate() on the
template's ids; vLLM's prompt forms and construction.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_reference import hf_greedy, hf_model
from pagedinfer import Engine, SamplingParams
from pagedinfer.domain.sampling import FLOAT32_MAX
from pagedinfer.errors import CheckpointNotFoundError, InvalidRequestError

VOCAB = 512  # the tiny checkpoint's
LogitsRule = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny")


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Iterator[Engine]:
    # A 24-token step budget and 16-token blocks: longer prompts prefill in chunks, and the
    # prefix cache holds full blocks.
    with Engine(
        checkpoint,
        device="cpu",
        kv_block_size=16,
        max_model_len=96,
        max_num_batched_tokens=24,
        max_num_seqs=8,
    ) as engine:
        yield engine


def prompts_of(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(length)] for length in lengths]


@lru_cache(maxsize=256)
def _hf_log_softmax(path: str, tokens: tuple[int, ...]) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf_model(path)(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def hf_logprobs(checkpoint: Path, tokens: list[int]) -> torch.Tensor:
    """transformers' log_softmax at every position of ``tokens`` (row t predicts t + 1)."""
    return _hf_log_softmax(str(checkpoint), tuple(tokens))


def reference_greedy(
    checkpoint: Path, prompt: list[int], steps: int, rule: LogitsRule
) -> list[int]:
    """Greedy decoding with transformers' logits and ``rule(logits, prompt, output)``
    applied before each argmax."""
    model = hf_model(str(checkpoint))
    output: list[int] = []
    for _ in range(steps):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + output])).logits[0, -1].float()
        output.append(int(rule(logits.clone(), prompt, output).argmax()))
    return output


# --------------------------------------------------------------------------- logprobs
def check_entry(entry: dict[int, Any], reference: torch.Tensor, chosen: int, k: int) -> None:
    """One position's {token: Logprob} against transformers' log_softmax row."""
    top_values, _ = reference.topk(k) if k else (torch.empty(0), None)
    assert chosen in entry and len(entry) in (k, k + 1)
    for token_id, logprob in entry.items():
        assert abs(logprob.logprob - float(reference[token_id])) < 1e-4
    ranked = sorted(
        (lp for t, lp in entry.items() if lp.rank is not None and lp.rank <= k),
        key=lambda lp: lp.rank,
    )
    assert [lp.rank for lp in ranked] == list(range(1, k + 1))
    torch.testing.assert_close(
        torch.tensor([lp.logprob for lp in ranked]), top_values, rtol=0, atol=1e-4
    )
    expected_rank = int((reference >= reference[chosen]).sum())
    assert entry[chosen].rank == expected_rank or entry[chosen].rank <= k


@pytest.mark.parametrize(("lengths", "k"), [([5, 40], 3), ([17, 1, 33], 0), ([64], 20)])
def test_logprobs_and_prompt_logprobs_equal_transformers_log_softmax(
    engine: Engine, checkpoint: Path, lengths: list[int], k: int
) -> None:
    prompts = prompts_of(len(lengths) * 100 + k, lengths)
    engine.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)  # warm the cache
    params = SamplingParams(max_tokens=6, seed=k, logprobs=k, prompt_logprobs=k, ignore_eos=True)
    for prompt, output in zip(
        prompts, engine.generate(prompts, params, use_tqdm=False), strict=True
    ):
        (completion,) = output.outputs
        reference = hf_logprobs(checkpoint, prompt + completion.token_ids)
        # Prompt logprobs: None for the first token, then every prompt token given the rest.
        assert output.prompt_logprobs is not None
        assert len(output.prompt_logprobs) == len(prompt) and output.prompt_logprobs[0] is None
        for position in range(1, len(prompt)):
            entry = output.prompt_logprobs[position]
            assert entry is not None
            check_entry(entry, reference[position - 1], prompt[position], k)
        # Sample logprobs: one entry per generated token, of the model's distribution.
        assert completion.logprobs is not None and len(completion.logprobs) == 6
        total = 0.0
        for i, token in enumerate(completion.token_ids):
            row = reference[len(prompt) - 1 + i]
            check_entry(completion.logprobs[i], row, token, k)
            total += float(row[token])
        assert completion.cumulative_logprob is not None
        assert abs(completion.cumulative_logprob - total) < 1e-3


def test_logprobs_from_prefix_cache_hits_and_forks(engine: Engine, checkpoint: Path) -> None:
    # A shared 32-token prefix (two full blocks) is served from the cache; n=2 forks.
    base = prompts_of(7, [32])[0]
    prompts = [[*base, 3, 4, 5], [*base, 9]]
    engine.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)
    params = SamplingParams(n=2, max_tokens=4, seed=1, logprobs=2, temperature=0.8)
    outputs = engine.generate(prompts, params, use_tqdm=False)
    assert outputs[0].num_cached_tokens == 32 and outputs[0].prompt_logprobs is None
    for prompt, output in zip(prompts, outputs, strict=True):
        for completion in output.outputs:
            reference = hf_logprobs(checkpoint, prompt + completion.token_ids)
            assert completion.logprobs is not None
            for i, token in enumerate(completion.token_ids):
                check_entry(completion.logprobs[i], reference[len(prompt) - 1 + i], token, 2)


def test_no_logprobs_unless_asked(engine: Engine) -> None:
    (output,) = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert output.prompt_logprobs is None
    assert output.outputs[0].logprobs is None and output.outputs[0].cumulative_logprob is None


# -------------------------------------------------------------------------- penalties
def test_greedy_repetition_penalty_equals_transformers_generate(
    engine: Engine, checkpoint: Path
) -> None:
    prompts = prompts_of(3, [6, 30])
    prompts[0] = [7, 7, 7, 8, 8, 9]  # repeated prompt tokens are penalised once each
    for penalty in (1.5, 0.7):
        params = SamplingParams(
            temperature=0.0, repetition_penalty=penalty, max_tokens=12, ignore_eos=True
        )
        for prompt, output in zip(
            prompts, engine.generate(prompts, params, use_tqdm=False), strict=True
        ):
            with torch.inference_mode():
                expected = (
                    hf_model(str(checkpoint))
                    .generate(
                        torch.tensor([prompt]),
                        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                        max_new_tokens=12,
                        min_new_tokens=12,
                        do_sample=False,
                        repetition_penalty=penalty,
                        pad_token_id=0,
                    )[0, len(prompt) :]
                    .tolist()
                )
            assert output.outputs[0].token_ids == expected, penalty
        # And the penalty changes what greedy decoding does on this model.
    plain = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] != [
        o.outputs[0].token_ids
        for o in engine.generate(
            prompts,
            SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.5),
            use_tqdm=False,
        )
    ]


def presence_frequency(presence: float, frequency: float) -> LogitsRule:
    """OpenAI's rule, token by token: subtract frequency x count + presence if it occurred."""

    def rule(logits: torch.Tensor, prompt: list[int], output: list[int]) -> torch.Tensor:
        for token in set(output):
            logits[token] -= frequency * output.count(token) + presence
        return logits

    return rule


@pytest.mark.parametrize(("presence", "frequency"), [(1.5, 0.0), (0.0, 2.0), (-0.5, 0.8)])
def test_greedy_presence_and_frequency_penalties_equal_a_reference(
    engine: Engine, checkpoint: Path, presence: float, frequency: float
) -> None:
    prompt = prompts_of(4, [9])[0]
    params = SamplingParams(
        temperature=0.0,
        presence_penalty=presence,
        frequency_penalty=frequency,
        max_tokens=10,
        ignore_eos=True,
    )
    (output,) = engine.generate([prompt], params, use_tqdm=False)
    expected = reference_greedy(checkpoint, prompt, 10, presence_frequency(presence, frequency))
    assert output.outputs[0].token_ids == expected


def test_penalised_and_plain_requests_in_one_batch(engine: Engine, checkpoint: Path) -> None:
    prompts = prompts_of(5, [8, 12, 3])
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    penalised = SamplingParams(
        temperature=0.0, frequency_penalty=1.0, max_tokens=8, ignore_eos=True
    )
    outputs = engine.generate(prompts, [plain, penalised, plain], use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == hf_greedy(checkpoint, prompts[0], 8)
    assert outputs[2].outputs[0].token_ids == hf_greedy(checkpoint, prompts[2], 8)
    assert outputs[1].outputs[0].token_ids == reference_greedy(
        checkpoint, prompts[1], 8, presence_frequency(0.0, 1.0)
    )


# ----------------------------------------------------- min_tokens, bias, allowed ids, min_p
def test_min_tokens_holds_back_stop_tokens(engine: Engine, checkpoint: Path) -> None:
    prompt = prompts_of(6, [10])[0]
    free = hf_greedy(checkpoint, prompt, 12)
    stop = free[1]
    (early,) = engine.generate(
        [prompt], SamplingParams(temperature=0.0, stop_token_ids=[stop]), use_tqdm=False
    )
    assert early.outputs[0].token_ids == free[:2] and early.outputs[0].stop_reason == stop

    def hold_back(logits: torch.Tensor, _: list[int], output: list[int]) -> torch.Tensor:
        if len(output) < 5:
            logits[stop] = -math.inf
        return logits

    expected = reference_greedy(checkpoint, prompt, 12, hold_back)
    params = SamplingParams(temperature=0.0, stop_token_ids=[stop], min_tokens=5, max_tokens=12)
    (held,) = engine.generate([prompt], params, use_tqdm=False)
    tokens = held.outputs[0].token_ids
    assert stop not in tokens[:5]
    cut = expected.index(stop) + 1 if stop in expected else 12
    assert tokens == expected[:cut]


def test_logit_bias_and_allowed_token_ids(engine: Engine, checkpoint: Path) -> None:
    prompt = prompts_of(8, [7])[0]
    params = SamplingParams(temperature=0.0, logit_bias={42: 100.0}, max_tokens=5)
    (biased,) = engine.generate([prompt], params, use_tqdm=False)
    assert biased.outputs[0].token_ids == [42] * 5

    def bias(logits: torch.Tensor, _: list[int], __: list[int]) -> torch.Tensor:
        logits[[3, 4]] += torch.tensor([2.5, -1.0])
        return logits

    params = SamplingParams(temperature=0.0, logit_bias={3: 2.5, 4: -1.0}, max_tokens=6)
    (small,) = engine.generate([prompt], params, use_tqdm=False)
    assert small.outputs[0].token_ids == reference_greedy(checkpoint, prompt, 6, bias)

    allowed = [5, 77, 300]
    params = SamplingParams(allowed_token_ids=allowed, max_tokens=16, seed=2, ignore_eos=True)
    (output,) = engine.generate([prompt], params, use_tqdm=False)
    assert set(output.outputs[0].token_ids) <= set(allowed)


def test_min_p_keeps_only_likely_tokens(engine: Engine, checkpoint: Path) -> None:
    prompt = prompts_of(9, [5])[0]
    params = SamplingParams(min_p=0.9, temperature=1.0, max_tokens=8, seed=3, ignore_eos=True)
    (output,) = engine.generate([prompt], params, use_tqdm=False)
    # min_p=0.9 keeps tokens within 10% of the top one: on this model that is greedy.
    tokens = output.outputs[0].token_ids
    reference = hf_logprobs(checkpoint, prompt + tokens)
    for i, token in enumerate(tokens):
        row = reference[len(prompt) - 1 + i]
        assert float(row[token]) >= float(row.max()) + math.log(0.9) - 1e-4


# ---------------------------------------------------------------------------------- n > 1
@pytest.mark.parametrize("prompt_len", [20, 32])  # a partial last block, and a full one
def test_n_completions_equal_single_requests_seeded_with_the_rule(
    engine: Engine, prompt_len: int
) -> None:
    prompt = prompts_of(prompt_len, [prompt_len])[0]
    engine.reset_prefix_cache()
    before = engine.stats().num_prompt_tokens
    params = SamplingParams(n=3, seed=11, max_tokens=10, ignore_eos=True)
    (output,) = engine.generate([prompt], params, use_tqdm=False)
    # The prompt was computed once for the three completions.
    assert engine.stats().num_prompt_tokens - before == prompt_len
    assert [c.index for c in output.outputs] == [0, 1, 2]
    engine.reset_prefix_cache()
    for completion in output.outputs:
        single = SamplingParams(seed=11 + completion.index, max_tokens=10, ignore_eos=True)
        (alone,) = engine.generate([prompt], single, use_tqdm=False)
        assert completion.token_ids == alone.outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in output.outputs}) == 3


def test_greedy_n_completions_all_equal_transformers(engine: Engine, checkpoint: Path) -> None:
    # Each fork decodes from its own copy of the prompt's last block: any stale or shared
    # K/V would change its greedy tokens.
    prompts = prompts_of(12, [19, 40])
    params = SamplingParams(n=3, temperature=0.0, max_tokens=8, ignore_eos=True)
    for prompt, output in zip(
        prompts, engine.generate(prompts, params, use_tqdm=False), strict=True
    ):
        expected = hf_greedy(checkpoint, prompt, 8)
        assert [c.token_ids for c in output.outputs] == [expected] * 3


def test_unseeded_n_completions_differ_and_all_finish(engine: Engine) -> None:
    params = SamplingParams(n=4, max_tokens=6, ignore_eos=True)
    outputs = engine.generate(prompts_of(13, [9, 9]), params, use_tqdm=False)
    for output in outputs:
        assert len(output.outputs) == 4
        assert all(c.finish_reason == "length" and len(c.token_ids) == 6 for c in output.outputs)
        assert len({tuple(c.token_ids) for c in output.outputs}) > 1


def test_streamed_deltas_of_n_completions_add_up(engine: Engine) -> None:
    prompt = prompts_of(14, [11])[0]
    params = SamplingParams(n=2, seed=5, max_tokens=5, logprobs=1, ignore_eos=True)
    (whole,) = engine.generate([prompt], params, use_tqdm=False)
    tokens: dict[int, list[int]] = {0: [], 1: []}
    logprobs: dict[int, list[Any]] = {0: [], 1: []}
    reasons: dict[int, str | None] = {}
    deltas = list(engine.stream(prompt, params))
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    for delta in deltas:
        for completion in delta.outputs:
            tokens[completion.index] += completion.token_ids
            logprobs[completion.index] += completion.logprobs or []
            reasons[completion.index] = completion.finish_reason or reasons.get(completion.index)
    for completion in whole.outputs:
        assert tokens[completion.index] == completion.token_ids
        assert logprobs[completion.index] == completion.logprobs
        assert reasons[completion.index] == "length"


# ------------------------------------------------------------------------ stop reasons
def test_stop_reason_and_include_stop_str_in_output(
    make_checkpoint: Callable[..., Path],
) -> None:
    with Engine(
        make_checkpoint("tiny", with_tokenizer=True),
        device="cpu",
        kv_block_size=16,
        max_model_len=64,
    ) as engine:
        prompt = "The quick brown fox"
        free = engine.generate(
            prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False
        )[0]
        text = free.outputs[0].text
        stop = text[3:6]
        cut = text.index(stop)
        params = SamplingParams(temperature=0.0, max_tokens=16, stop=[stop], ignore_eos=True)
        (dropped,) = engine.generate(prompt, params, use_tqdm=False)
        assert dropped.outputs[0].text == text[:cut]
        assert dropped.outputs[0].stop_reason == stop
        kept_params = SamplingParams(
            temperature=0.0,
            max_tokens=16,
            stop=[stop],
            include_stop_str_in_output=True,
            ignore_eos=True,
        )
        (kept,) = engine.generate(prompt, kept_params, use_tqdm=False)
        assert kept.outputs[0].text == text[: cut + len(stop)]
        assert kept.outputs[0].token_ids == dropped.outputs[0].token_ids
        # No stop string may end within min_tokens: the text runs past it.
        late = SamplingParams(
            temperature=0.0, max_tokens=16, stop=[stop], min_tokens=16, ignore_eos=True
        )
        (held,) = engine.generate(prompt, late, use_tqdm=False)
        assert held.outputs[0].finish_reason == "length"
        # Special tokens: dropped from the text unless skip_special_tokens=False.
        special = engine.tokenizer.eos_token_id
        only = SamplingParams(allowed_token_ids=[special], max_tokens=2, ignore_eos=True)
        (skipped,) = engine.generate(prompt, only, use_tqdm=False)
        assert skipped.outputs[0].text == ""
        shown = SamplingParams(
            allowed_token_ids=[special], max_tokens=2, ignore_eos=True, skip_special_tokens=False
        )
        (output,) = engine.generate(prompt, shown, use_tqdm=False)
        assert output.outputs[0].text == engine.tokenizer.eos_token * 2
        # The token that ends a completion (EOS or a stop id) stays out of the text, special or
        # not, as in vLLM; include_stop_str_in_output keeps it. Streams agree with the final text.
        plain_ids = engine.tokenizer.encode(" world", add_special_tokens=False)
        for stop_params, kept_text in [
            (dict(allowed_token_ids=[special]), ""),
            (dict(allowed_token_ids=[special], include_stop_str_in_output=True), "eos"),
            (dict(allowed_token_ids=plain_ids[:1], stop_token_ids=plain_ids[:1]), ""),
            (
                dict(
                    allowed_token_ids=plain_ids[:1],
                    stop_token_ids=plain_ids[:1],
                    include_stop_str_in_output=True,
                ),
                "plain",
            ),
        ]:
            stop_run = SamplingParams(max_tokens=3, skip_special_tokens=False, **stop_params)
            for stop_text in (
                engine.generate(prompt, stop_run, use_tqdm=False)[0].outputs[0].text,
                "".join(
                    delta.outputs[0].text
                    for delta in engine.stream(prompt, stop_run)  # text built incrementally
                ),
            ):
                expected = {
                    "": "",
                    "eos": engine.tokenizer.eos_token,
                    "plain": engine.tokenizer.decode(plain_ids[:1]),
                }[kept_text]
                assert stop_text == expected, (stop_params, stop_text)
        # chat() is generate() on the template's token ids, with the rendered prompt.
        messages = [{"role": "user", "content": "Hello there"}]
        greedy = SamplingParams(temperature=0.0, max_tokens=6)
        (chat,) = engine.chat(messages, greedy, use_tqdm=False)
        ids = engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        (plain,) = engine.generate({"prompt_token_ids": list(ids)}, greedy, use_tqdm=False)
        assert chat.prompt_token_ids == list(ids) and chat.prompt == engine.tokenizer.decode(ids)
        assert chat.outputs[0].token_ids == plain.outputs[0].token_ids
        both = engine.chat([messages, messages], greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in both] == [plain.outputs[0].token_ids] * 2
        (by_dict,) = engine.generate({"prompt": prompt}, greedy, use_tqdm=False)
        assert by_dict.prompt == prompt and by_dict.prompt_token_ids == free.prompt_token_ids


# ------------------------------------------------------------------- vLLM's numerics
def test_max_tokens_none_generates_up_to_max_model_len(engine: Engine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    outputs = engine.generate([[5, 6, 7], [9] * 40], params, use_tqdm=False)
    assert [len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outputs] == [96, 96]
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)


def test_top_k_minus_one_is_top_k_off(engine: Engine) -> None:
    prompts = [[5, 6, 7], [9, 10]]
    off = engine.generate(prompts, SamplingParams(top_k=0, seed=3, max_tokens=8), use_tqdm=False)
    minus_one = engine.generate(
        prompts, SamplingParams(top_k=-1, seed=3, max_tokens=8), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in off] == [o.outputs[0].token_ids for o in minus_one]


def test_tiny_temperatures_are_greedy(engine: Engine, checkpoint: Path) -> None:
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    for temperature in (1e-40, 1e-50, 9e-6):
        params = SamplingParams(temperature=temperature, max_tokens=6, ignore_eos=True)
        outputs = engine.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == [
            hf_greedy(checkpoint, p, 6) for p in prompts
        ], temperature


# ------------------------------------------------------- float32-extreme, valid values
EXTREMES: dict[str, dict[str, Any]] = {
    # A float32-finite temperature: the distribution flattens, nothing overflows.
    "hottest": {"temperature": FLOAT32_MAX},
    # The largest logits: +1e10 bias, divided by the smallest penalty, by the coldest
    # sampled temperature (about 1e21).
    "largest": {"temperature": 1e-5, "logit_bias": {7: 1e10}, "repetition_penalty": 1e-6},
    # The smallest: every allowed token biased -1e10, times the largest penalty.
    "smallest": {"logit_bias": {t: -1e10 for t in range(3, 9)}, "repetition_penalty": 1e6},
    "greedy": {"temperature": 0.0, "logit_bias": {5: -1e10, 8: 1e10}, "repetition_penalty": 1e6},
}


@pytest.mark.parametrize("extreme", list(EXTREMES))
def test_extreme_valid_values_keep_allowed_token_ids_and_min_tokens(
    engine: Engine, extreme: str
) -> None:
    """Issue 21, item 4: values that overflowed float32 became inf / NaN rows that sampled
    token 0 (outside allowed_token_ids, and EOS within min_tokens). The values that pass
    validation now cannot overflow: constraints hold at the bounds."""
    stop = 8  # held back by min_tokens (the checkpoint has no EOS)
    allowed = [3, 4, 5, 6, 7, stop]
    params = SamplingParams(
        allowed_token_ids=allowed,
        stop_token_ids=[stop],
        min_tokens=6,
        max_tokens=10,
        seed=1,
        **EXTREMES[extreme],
    )
    prompts = [[3, 4, 5, 6, 7, 8], [9, 10, 11], [stop, 5, 5]]  # penalised tokens in the prompts
    for output in engine.generate(prompts, params, use_tqdm=False):
        tokens = output.outputs[0].token_ids
        assert set(tokens) <= set(allowed), tokens
        assert stop not in tokens[:6] and len(tokens) >= 6, tokens


# ----------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stop_token_ids": [VOCAB]}, "token id 512"),
        ({"allowed_token_ids": [1, 600]}, "token id 600"),
        ({"logit_bias": {VOCAB + 5: 1.0}}, "token id 517"),
        ({"logprobs": VOCAB + 1}, "logprobs=513"),
        ({"prompt_logprobs": VOCAB + 1}, "prompt_logprobs=513"),
        ({"allowed_token_ids": [3], "stop_token_ids": [3], "min_tokens": 2}, "nothing could"),
        ({"n": 9}, "n=9"),  # more than max_num_seqs=8
    ],
)
def test_requests_the_model_cannot_serve_are_refused(
    engine: Engine, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request([1, 2], SamplingParams(**kwargs))
    assert not engine.has_unfinished_requests()


def test_model_keyword_and_hub_ids(checkpoint: Path) -> None:
    with Engine(model=str(checkpoint), device="cpu", kv_block_size=16, max_model_len=32) as e:
        assert e.generate([1, 2], SamplingParams(max_tokens=1), use_tqdm=False)[0].finished
    with pytest.raises(CheckpointNotFoundError, match=r"`hf download Qwen/Qwen3-0\.6B"):
        Engine(model="Qwen/Qwen3-0.6B", device="cpu")
