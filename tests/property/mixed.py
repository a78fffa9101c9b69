"""Heterogeneous requests for the Engine's property tests, and what their outputs must satisfy.

Shared by ``test_mixed_batches.py`` (batches run together through ``generate``) and
``test_engine_machine.py`` (the same mixture through ``add_request`` / ``step`` / ``stream`` /
``abort``). Three parts:

* **Strategies** drawing prompts and :class:`SamplingParams` that mix every field: greedy and
  sampled rows, top-k (including k at and above the vocabulary), top-p, min-p, the three
  penalties, ``logit_bias``, ``allowed_token_ids``, ``min_tokens``, stop strings and stop ids,
  ``n``, ``logprobs``, ``prompt_logprobs``, seeds, ``ignore_eos``, ``max_tokens``. Stop ids,
  biases and allowed ids favour the tokens the model likes (``Vocab.hot``) and EOS, so that
  stops, EOS and ``min_tokens`` actually bind.
* **A reference** (:class:`Reference`) on an engine nothing else uses: each completion run
  alone (completion ``i`` of a seeded request is the request with ``n=1`` and seed
  ``completion_seed(seed, i)``), and the model's log-probabilities of a token sequence, read
  as prompt logprobs.
* **Checks** (:class:`Checker`): a greedy or seeded completion equals its run alone (tokens,
  text, finish and stop reason; logprobs close); every completion keeps every constraint,
  checked from the definitions, not from the engine's code: allowed ids only, no EOS or stop
  id before the last token (nor within ``min_tokens``), at least ``min_tokens`` tokens and at
  most ``max_tokens``, the finish reason and stop reason the last token implies (``stop``
  beats ``length`` on the last allowed token), the text equals the tokens' decoding (without a
  stop token that ended it, unless ``include_stop_str_in_output``) cut at the
  first stop string that ends after ``min_tokens`` (and only there), logprobs with the chosen
  token and the top ``k`` equal to the model's own log-softmax over the prompt and the
  completion (the reference's prompt logprobs: one prefill, not the decode path that made
  them), ``n`` completions, prompt logprobs likewise.

Prompts use only tokens that decode alone to printable ASCII, so a completion's text is the
decoding of its tokens on their own (no character spans the prompt and the completion).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hypothesis import event
from hypothesis import strategies as st

from pagedinfer import Engine, SamplingParams
from pagedinfer.domain.kv_groups import is_plain
from pagedinfer.domain.sampling import MAX_SEED
from pagedinfer.engine.engine import completion_seed
from pagedinfer.engine.outputs import CompletionOutput, Logprob, RequestOutput

MAX_TOKENS = 8
MAX_N = 3
MAX_LOGPROBS = 4  # the reference reads this many top tokens; requests ask for at most this
PREFIX_LEN = 20
# Logprobs of the same tokens computed in a different batch (other shapes, chunked or not)
# differ by float32 rounding; ranks may then swap between near-equal tokens.
LOGPROB_TOLERANCE = 2e-4
RANK_TOLERANCE = 1
# ASCII pieces frequent in the tiny tokenizer's decoded text: single characters bind often,
# longer ones across token boundaries.
STOP_STRINGS = ("t", "e", "in", "at", "9", " ", "\n", "\x01", "Ex", "tu", "the", "ing")


@dataclass(frozen=True)
class Vocab:
    """What the strategies need to know about the checkpoint's vocabulary."""

    size: int
    eos: int
    plain: tuple[int, ...]  # ids that decode alone to printable ASCII: prompt material
    hot: tuple[int, ...]  # ids the model often picks: stops, biases and allowed ids favour them
    prefix: tuple[int, ...]  # a prompt prefix many prompts share (prefix-cache hits)


def describe_vocab(engine: Engine) -> Vocab:
    """The checkpoint's vocabulary, and its hot tokens (most frequent in greedy outputs)."""
    tokenizer = engine.tokenizer
    assert tokenizer is not None, "the mixed-batch tests need a checkpoint with a tokenizer"
    (eos,) = engine.model_config.eos_token_ids
    size = engine.model_config.vocab_size
    plain = []
    for token_id in range(size):
        text = tokenizer.decode([token_id])
        if token_id != eos and text and text.isascii() and text.isprintable():
            plain.append(token_id)
    prefix = tuple(plain[(7 * i) % len(plain)] for i in range(PREFIX_LEN))
    prompts = [[*prefix[:cut], plain[i]] for i, cut in enumerate((0, 4, 9, 15, 20))]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    counts: Counter[int] = Counter()
    for output in engine.generate(prompts, greedy, use_tqdm=False):
        counts.update(output.outputs[0].token_ids)
    hot = tuple(token for token, _ in counts.most_common(6) if token != eos)
    return Vocab(size=size, eos=eos, plain=tuple(plain), hot=hot, prefix=prefix)


def assert_blocks_all_free(engine: Engine) -> None:
    """An idle engine's pool holds nothing: every block free but the null block a grouped
    allocator (hybrid models, issue 42: ``stats().kv_groups`` not empty) holds for life, and
    every KV group, one per scheduler group, reports no block held."""
    pool = engine.scheduler.pool
    pool.check_integrity()
    stats = engine.stats()
    assert stats.kv_cache_usage == 0.0
    reported = stats.kv_groups
    assert pool.num_free_blocks == pool.num_blocks - (1 if reported else 0), "KV blocks leaked"
    if reported:
        groups = engine.scheduler.config.kv_groups
        assert not is_plain(groups)
        assert [(g.window, g.num_layers) for g in reported] == [
            (g.window, len(g.layers)) for g in groups
        ]
        assert all(g.num_blocks_held == 0 for g in reported), reported


# --------------------------------------------------------------------------- strategies
def prompts(
    vocab: Vocab, cuts: Sequence[int] = (0, 3, 8, 12, PREFIX_LEN)
) -> st.SearchStrategy[list[int]]:
    """Prompts of 1..24 plain tokens: ``vocab.prefix[:cut]`` and 1..4 more."""
    return st.builds(
        lambda cut, tail: [*vocab.prefix[:cut], *tail],
        st.sampled_from(cuts),
        st.lists(st.sampled_from(vocab.plain), min_size=1, max_size=4),
    )


def token_ids(vocab: Vocab) -> st.SearchStrategy[int]:
    """Token ids for stops, biases and allowed ids: mostly the hot ones and EOS (so that
    they bind), sometimes any."""
    hot = st.sampled_from(vocab.hot)
    return st.one_of(hot, hot, st.just(vocab.eos), st.integers(0, vocab.size - 1))


_BIAS = st.one_of(
    st.floats(-10.0, 10.0, allow_nan=False, allow_infinity=False),
    st.sampled_from([-100.0, 100.0]),
)
_SEED = st.one_of(st.integers(0, 2**16), st.integers(0, MAX_SEED), st.just(MAX_SEED))


def _mostly(off: Any, on: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``off`` two times in three: a feature is off in most rows, so most batches mix rows
    with and without it (the batched fast paths branch on "any row uses it")."""
    return st.one_of(st.just(off), st.just(off), on)


@st.composite
def sampling_params(
    draw: st.DrawFn, vocab: Vocab, *, max_tokens: int = MAX_TOKENS, max_n: int = MAX_N
) -> SamplingParams:
    """Any valid mixture of SamplingParams fields (the engine accepts every draw)."""
    greedy = draw(st.booleans())
    temperature = 0.0 if greedy else draw(st.sampled_from([0.25, 0.7, 1.0, 1.6]))
    tokens = token_ids(vocab)
    budget = draw(st.integers(1, max_tokens))
    min_tokens = draw(_mostly(0, st.integers(1, budget)))
    ignore_eos = draw(st.booleans())
    stop_token_ids = draw(_mostly((), st.lists(tokens, min_size=1, max_size=2, unique=True)))
    allowed = draw(_mostly(None, st.lists(tokens, min_size=1, max_size=6, unique=True)))
    if allowed is not None and min_tokens > 0:
        held = set(stop_token_ids) | (set() if ignore_eos else {vocab.eos})
        if held.issuperset(allowed):  # the engine refuses this: keep one token available
            allowed.append(next(t for t in (*vocab.hot, *vocab.plain) if t not in held))
    top_ks = [-1, 1, 2, 5, 20, vocab.size - 1, vocab.size, 1000]
    penalty = st.floats(-2.0, 2.0)
    return SamplingParams(
        temperature=temperature,
        top_k=draw(_mostly(0, st.sampled_from(top_ks))),
        top_p=draw(_mostly(1.0, st.floats(0.05, 1.0))),
        min_p=draw(_mostly(0.0, st.floats(0.0, 0.3))),
        presence_penalty=draw(_mostly(0.0, penalty)),
        frequency_penalty=draw(_mostly(0.0, penalty)),
        repetition_penalty=draw(_mostly(1.0, st.floats(0.5, 2.0))),
        logit_bias=draw(_mostly(None, st.dictionaries(tokens, _BIAS, min_size=1, max_size=4))),
        allowed_token_ids=allowed,
        max_tokens=budget,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        stop_token_ids=stop_token_ids,
        stop=draw(
            _mostly(
                (), st.lists(st.sampled_from(STOP_STRINGS), min_size=1, max_size=2, unique=True)
            )
        ),
        include_stop_str_in_output=draw(st.booleans()),
        skip_special_tokens=draw(st.booleans()),
        n=draw(_mostly(1, st.integers(1, max_n))),
        seed=draw(st.none() | _SEED),
        logprobs=draw(_mostly(None, st.integers(0, MAX_LOGPROBS))),
        prompt_logprobs=draw(_mostly(None, st.integers(0, 2))),
    )


def is_deterministic(params: SamplingParams) -> bool:
    """Greedy or seeded: the output must not depend on what else runs."""
    return params.is_greedy or params.seed is not None


# ---------------------------------------------------------------------------- reference
class Reference:
    """Runs requests alone on an engine nothing else uses (results cached)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._alone: dict[tuple[tuple[int, ...], SamplingParams], RequestOutput] = {}
        self._scores: dict[tuple[int, ...], RequestOutput] = {}

    def alone(self, prompt: Sequence[int], params: SamplingParams, index: int) -> CompletionOutput:
        """Completion ``index`` of the request, as a request of its own (n=1, its seed)."""
        seed = params.seed if params.is_greedy else completion_seed(params.seed, index)
        single = dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=None)
        key = (tuple(prompt), single)
        if key not in self._alone:
            (output,) = self.engine.generate([list(prompt)], single, use_tqdm=False)
            self._alone[key] = output
        return self._alone[key].outputs[0]

    def score(self, sequences: Sequence[Sequence[int]]) -> None:
        """Compute the :meth:`scores` of these token sequences not known yet, in one batch
        (prompt logprobs do not depend on the batch; one call saves steps)."""
        missing = list(dict.fromkeys(tuple(t) for t in sequences if tuple(t) not in self._scores))
        if not missing:
            return
        params = SamplingParams(
            temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=MAX_LOGPROBS
        )
        outputs = self.engine.generate([list(t) for t in missing], params, use_tqdm=False)
        for tokens, output in zip(missing, outputs, strict=True):
            self._scores[tokens] = output

    def scores(self, tokens: Sequence[int]) -> list[dict[int, Logprob] | None]:
        """The model's log-probabilities of ``tokens[j]`` after ``tokens[:j]`` (and the top
        ``MAX_LOGPROBS``), one entry per token (``None`` for the first)."""
        self.score([tokens])
        result = self._scores[tuple(tokens)].prompt_logprobs
        assert result is not None
        return result


# ------------------------------------------------------------------------------- checks
def _strip_unfinished(text: str) -> str:
    """Text the engine treats as final: a trailing U+FFFD may still become a character."""
    return text[:-1] if text.endswith("\ufffd") else text


class Checker:
    """Checks of outputs against the definitions and against :class:`Reference`."""

    def __init__(self, engine: Engine, reference: Reference) -> None:
        self.tokenizer: Any = engine.tokenizer
        self.eos_ids = frozenset(engine.model_config.eos_token_ids)
        self.max_model_len = engine.max_model_len
        self.prefix_caching = engine.config.enable_prefix_caching
        self.reference = reference

    def decode(self, tokens: Sequence[int], params: SamplingParams) -> str:
        text: str = self.tokenizer.decode(
            list(tokens), skip_special_tokens=params.skip_special_tokens
        )
        return text

    # ---------------------------------------------------------------- request level
    def check_final(
        self, output: RequestOutput, prompt: Sequence[int], params: SamplingParams
    ) -> None:
        """A finished request: every completion and the prompt logprobs (aborted
        completions only as far as they got)."""
        assert output.finished
        assert output.prompt_token_ids == list(prompt)
        assert [c.index for c in output.outputs] == list(range(params.n)), "n completions"
        assert 0 <= output.num_cached_tokens <= len(prompt)
        if not self.prefix_caching or params.prompt_logprobs is not None:
            assert output.num_cached_tokens == 0, "a prefix-cache hit that must not happen"
        wanted = [list(prompt)] if params.prompt_logprobs is not None else []
        if params.logprobs is not None:
            wanted += [[*prompt, *c.token_ids] for c in output.outputs if c.token_ids]
        self.reference.score(wanted)
        self.check_prompt_logprobs(output, prompt, params)
        for completion in output.outputs:
            if completion.finish_reason == "abort":
                event("finished by abort")
                self.check_aborted(prompt, params, completion)
            else:
                self.check_completion(prompt, params, completion)

    def check_prompt_logprobs(
        self, output: RequestOutput, prompt: Sequence[int], params: SamplingParams
    ) -> None:
        k = params.prompt_logprobs
        if k is None:
            assert output.prompt_logprobs is None
            return
        entries = output.prompt_logprobs
        assert entries is not None and len(entries) == len(prompt)
        assert entries[0] is None
        reference = self.reference.scores(prompt)
        # An abort may come before the prefill reached every position: those stay None.
        aborted = any(c.finish_reason == "abort" for c in output.outputs)
        for position in range(1, len(prompt)):
            entry, expected = entries[position], reference[position]
            assert expected is not None
            if entry is None and aborted:
                continue
            assert entry is not None, f"no prompt logprobs at position {position}"
            self.check_logprob_entry(entry, prompt[position], k, expected)

    # ------------------------------------------------------------- completion level
    def check_completion(
        self, prompt: Sequence[int], params: SamplingParams, completion: CompletionOutput
    ) -> None:
        """A completion that finished by itself (stop or length)."""
        self.check_constraints(prompt, params, completion)
        event(f"finished by {_finish_kind(completion, params, self.eos_ids)}")
        self.check_logprobs(prompt, params, completion)
        if is_deterministic(params):
            expected = self.reference.alone(prompt, params, completion.index)
            got = (completion.token_ids, completion.finish_reason, completion.stop_reason)
            assert got == (expected.token_ids, expected.finish_reason, expected.stop_reason), (
                f"completion {completion.index} differs from its run alone"
            )
            assert completion.text == expected.text
            if params.logprobs is not None:
                assert expected.cumulative_logprob is not None
                assert completion.cumulative_logprob is not None
                assert math.isclose(
                    completion.cumulative_logprob,
                    expected.cumulative_logprob,
                    abs_tol=LOGPROB_TOLERANCE * len(completion.token_ids),
                )

    def check_aborted(
        self, prompt: Sequence[int], params: SamplingParams, completion: CompletionOutput
    ) -> None:
        """A completion cut by abort: what it got so far keeps the rules, and a greedy or
        seeded one is a prefix of its run alone."""
        tokens = completion.token_ids
        assert completion.stop_reason is None
        assert params.max_tokens is None or len(tokens) <= params.max_tokens
        if params.allowed_token_ids is not None:
            assert set(tokens) <= set(params.allowed_token_ids), "a token outside allowed ids"
        ends = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        assert not ends & set(tokens), "an EOS or stop id did not end the completion"
        if not params.stop:
            assert completion.text == self.decode(tokens, params)
        self.check_logprobs(prompt, params, completion)
        if is_deterministic(params):
            expected = self.reference.alone(prompt, params, completion.index)
            assert tokens == expected.token_ids[: len(tokens)]

    def check_constraints(
        self, prompt: Sequence[int], params: SamplingParams, completion: CompletionOutput
    ) -> None:
        tokens = completion.token_ids
        count = len(tokens)
        reason = completion.finish_reason
        assert reason in ("stop", "length"), reason
        assert count >= 1
        hit_model_len = len(prompt) + count >= self.max_model_len
        if params.max_tokens is not None:
            assert count <= params.max_tokens, "more tokens than max_tokens"
        assert len(prompt) + count <= self.max_model_len
        assert count >= params.min_tokens or hit_model_len, "fewer tokens than min_tokens"
        if params.allowed_token_ids is not None:
            assert set(tokens) <= set(params.allowed_token_ids), "a token outside allowed ids"
        # EOS and stop ids: never within min_tokens (held back), and only as the last token.
        eos = set() if params.ignore_eos else set(self.eos_ids)
        ends = eos | set(params.stop_token_ids)
        for index, token in enumerate(tokens[:-1]):
            assert token not in ends, f"token {index} ({token}) should have ended the completion"
        assert not ends & set(tokens[: params.min_tokens]), "an EOS / stop id within min_tokens"
        last = tokens[-1]
        last_ends = last in ends and count > params.min_tokens
        # Stop strings, from the definition: the text is the decoding of the tokens, cut at
        # the first stop string that ends after the first min_tokens tokens' text. The text
        # of an EOS or stop id that ended the completion is not part of it (as in vLLM)
        # unless include_stop_str_in_output.
        hides_last = last_ends and not params.include_stop_str_in_output
        full = self.decode(tokens[:-1] if hides_last else tokens, params)
        held = len(_strip_unfinished(self.decode(tokens[: params.min_tokens], params)))
        before_last = len(_strip_unfinished(self.decode(tokens[:-1], params)))
        order = {stop: rank for rank, stop in enumerate(params.stop)}
        matches = sorted(  # (start, rank in params.stop, string): earliest first, then listed
            (start, order[stop], stop)
            for stop in params.stop
            for start in _occurrences(full, stop)
            if start + len(stop) > held
        )
        text = completion.text
        if isinstance(completion.stop_reason, str):
            stop = completion.stop_reason
            assert reason == "stop", "a stop string on the last token must report stop"
            assert stop in params.stop
            if params.include_stop_str_in_output:
                assert text.endswith(stop)
                cut = len(text) - len(stop)
            else:
                cut = len(text)
            assert full.startswith(text if params.include_stop_str_in_output else text + stop)
            earlier = [m for m in matches if m[0] + len(m[2]) <= before_last]
            assert not earlier, f"stop string {earlier[0][2]!r} should have ended it earlier"
            assert matches, f"stop string {stop!r} matched where none may (within min_tokens)"
            assert (cut, order[stop], stop) == matches[0], "not the first stop string"
            return
        # No stop string matched: none occurs (after min_tokens) and the text is all of it.
        assert not matches, f"stop string {matches[0][2]!r} in {full!r} did not stop it"
        assert text == full, "the text is not the decoding of the tokens (but a stop token)"
        if reason == "stop":
            assert last_ends, "finish_reason stop without EOS, stop id or stop string"
            if last in eos:
                assert completion.stop_reason is None
            else:
                assert completion.stop_reason == last
        else:
            assert not last_ends, "the last token was a stop but finish_reason is length"
            assert completion.stop_reason is None
            assert count == params.max_tokens or hit_model_len, "length before max_tokens"

    def check_logprobs(
        self, prompt: Sequence[int], params: SamplingParams, completion: CompletionOutput
    ) -> None:
        """k top tokens plus the chosen one per token, equal to the model's own logprobs."""
        k = params.logprobs
        tokens = completion.token_ids
        if k is None:
            assert completion.logprobs is None and completion.cumulative_logprob is None
            return
        assert completion.logprobs is not None and completion.cumulative_logprob is not None
        assert len(completion.logprobs) == len(tokens)
        chosen = [
            entry[token].logprob for entry, token in zip(completion.logprobs, tokens, strict=True)
        ]
        assert math.isclose(
            completion.cumulative_logprob, math.fsum(chosen), rel_tol=1e-5, abs_tol=1e-4
        )
        if not tokens:
            return
        reference = self.reference.scores([*prompt, *tokens])
        for index, (entry, token) in enumerate(zip(completion.logprobs, tokens, strict=True)):
            expected = reference[len(prompt) + index]
            assert expected is not None
            self.check_logprob_entry(entry, token, k, expected)

    def check_logprob_entry(
        self,
        entry: dict[int, Logprob],
        chosen: int,
        k: int,
        expected: dict[int, Logprob],
    ) -> None:
        """One ``{token id: Logprob}``: the top ``k`` (ranks 1..k, descending) and the
        chosen token; values equal to the reference's (which holds at least the top k)."""
        assert chosen in entry, "the chosen token's logprob is missing"
        assert len(entry) in (k, k + 1)
        top = sorted(
            (lp for token, lp in entry.items() if len(entry) == k or token != chosen),
            key=lambda lp: lp.rank or 0,
        )
        assert [lp.rank for lp in top] == list(range(1, k + 1))
        values = [lp.logprob for lp in top]
        assert all(a >= b - 1e-6 for a, b in itertools.pairwise(values)), "top not descending"
        assert all(v <= 1e-6 for v in (lp.logprob for lp in entry.values()))
        for token, lp in entry.items():
            assert lp.decoded_token == self.tokenizer.decode([token])
        reference_top = sorted(
            (lp for lp in expected.values() if lp.rank is not None and lp.rank <= MAX_LOGPROBS),
            key=lambda lp: lp.rank or 0,
        )[:k]
        for got, want in zip(values, [lp.logprob for lp in reference_top], strict=True):
            assert math.isclose(got, want, abs_tol=LOGPROB_TOLERANCE), (got, want)
        mine, theirs = entry[chosen], expected[chosen]
        assert math.isclose(mine.logprob, theirs.logprob, abs_tol=LOGPROB_TOLERANCE)
        assert mine.rank is not None and theirs.rank is not None
        assert abs(mine.rank - theirs.rank) <= RANK_TOLERANCE, (mine.rank, theirs.rank)


def _finish_kind(
    completion: CompletionOutput, params: SamplingParams, eos_ids: frozenset[int]
) -> str:
    """What ended a completion, for Hypothesis' statistics (how often each rule binds)."""
    if completion.finish_reason == "length":
        return "length"
    if isinstance(completion.stop_reason, str):
        return "a stop string"
    if completion.stop_reason is not None:
        return "a stop id"
    return "EOS"


def _occurrences(text: str, needle: str) -> list[int]:
    starts = []
    start = text.find(needle)
    while start != -1:
        starts.append(start)
        start = text.find(needle, start + 1)
    return starts
