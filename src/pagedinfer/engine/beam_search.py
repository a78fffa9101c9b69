"""Beam search on the engine's public API, as vLLM's ``LLM.beam_search`` does it.

Each step asks the engine for one token of every live beam: the beam's tokens (prompt and
generated so far) are a prompt of token ids, with ``max_tokens=1`` and
``logprobs=2 * beam_width``, and all of them go through the engine together (one
``generate`` call, or one batch of ``AsyncEngine`` requests). Every top token of every beam
is a candidate, scored by its cumulative log-probability; a candidate ending in EOS is a
finished beam (unless ``ignore_eos``), and the best ``beam_width`` of the others live on.
After ``max_tokens`` steps (or once none is left) finished and live beams are ranked by
:func:`~pagedinfer.domain.beam_search.beam_score` (``length_penalty``) and the best
``beam_width`` returned.

The beams of a prompt share its KV blocks through the prefix cache: a step's prompt is the
previous step's plus one token, so every full block of it (the prompt's, and the generated
blocks beams have in common) is found in the cache, shared read-only by every beam that
holds it, and only each beam's last, partial block is written again: copy-on-write with the
copy a recompute of at most ``kv_block_size`` tokens per beam and step. Without prefix caching
(``enable_prefix_caching=False``) every step recomputes every beam whole: correct, slower.

:class:`BeamSearch` is the search itself (no engine: it is told each step's outputs);
:func:`beam_search` and :func:`beam_search_async` drive it with an ``Engine`` or an
``AsyncEngine``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedinfer.domain.beam_search import BeamSearchParams, beam_score
from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.engine.async_engine import AsyncEngine, AsyncRequestStream
from pagedinfer.engine.engine import Engine, Prompt
from pagedinfer.engine.outputs import Logprob, RequestOutput
from pagedinfer.engine.prompts import TokenizedPrompt, parse_prompts
from pagedinfer.errors import InvalidRequestError, StepFailedError

__all__ = [
    "BeamSearch",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "beam_search",
    "beam_search_async",
    "check_beam_width",
    "tokenize_prompts",
]


@dataclass(frozen=True, slots=True)
class BeamSearchSequence:
    """One sequence beam search found (vLLM's ``BeamSearchSequence``).

    ``tokens`` are the prompt's tokens followed by the generated ones (a finishing EOS
    included), ``logprobs`` one ``{token id: Logprob}`` per generated token (the top
    ``2 * beam_width`` of that step, the chosen one among them), ``cum_logprob`` the sum of
    the chosen tokens' log-probabilities. ``text`` is ``tokens`` decoded, prompt included
    (vLLM's), without the EOS's text unless ``include_stop_str_in_output``; empty without a
    tokenizer. ``finish_reason`` is ``"stop"`` (EOS) or ``"length"`` (``max_tokens`` or
    ``max_model_len``); ``stop_reason`` is ``None`` (EOS, as for ``generate``).
    ``num_prompt_tokens`` says where the generated tokens start.
    """

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float
    text: str
    finish_reason: str
    num_prompt_tokens: int
    stop_reason: int | str | None = None

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens (``tokens`` after the prompt)."""
        return self.tokens[self.num_prompt_tokens :]


@dataclass(frozen=True, slots=True)
class BeamSearchOutput:
    """What beam search found for one prompt (vLLM's ``BeamSearchOutput``): at most
    ``beam_width`` ``sequences``, best first. ``prompt`` is the prompt's text (``None`` for
    token ids), ``prompt_token_ids`` its tokens."""

    sequences: list[BeamSearchSequence]
    prompt: str | None
    prompt_token_ids: list[int]


@dataclass(slots=True)
class _Beam:
    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    finish_reason: str | None = None


@dataclass(slots=True)
class _PromptSearch:
    prompt: TokenizedPrompt
    live: list[_Beam]
    finished: list[_Beam] = field(default_factory=list)


class BeamSearch:
    """The beam search of several prompts, one step at a time; it runs nothing itself.

    ``pending()`` gives the token ids of every live beam (prompts in order, beams best
    first); the caller runs them with :attr:`step_params` and hands the outputs, in that
    order, to ``advance()``; ``done`` says when nothing is left to run, and ``results()``
    ranks what was found.
    """

    def __init__(
        self,
        prompts: Sequence[TokenizedPrompt],
        params: BeamSearchParams,
        *,
        eos_token_ids: Collection[int],
        max_model_len: int,
    ) -> None:
        if not isinstance(params, BeamSearchParams):
            raise InvalidRequestError(
                f"beam search takes a BeamSearchParams, not {type(params).__name__}: pass "
                "BeamSearchParams(beam_width=..., max_tokens=...)."
            )
        self.params = params
        self.step_params = SamplingParams(
            max_tokens=1, logprobs=params.num_candidates, temperature=params.temperature
        )
        self._eos = frozenset(eos_token_ids)
        self._max_model_len = max_model_len
        self._searches = [_PromptSearch(p, [_Beam(list(p.token_ids))]) for p in prompts]
        self._steps = 0  # every live beam has generated this many tokens
        self._running: list[tuple[_PromptSearch, _Beam]] = []

    @property
    def done(self) -> bool:
        return not any(search.live for search in self._searches)

    def pending(self) -> list[list[int]]:
        """The token ids of each beam to extend this step (empty once the search is over).
        Beams at ``max_tokens`` or ``max_model_len`` finish with ``"length"`` first."""
        self._running = []
        for search in self._searches:
            at_limit = (
                self._steps >= self.params.max_tokens
                or len(search.prompt.token_ids) + self._steps >= self._max_model_len
            )
            if at_limit:
                for beam in search.live:
                    beam.finish_reason = "length"
                search.finished.extend(search.live)
                search.live = []
            self._running.extend((search, beam) for beam in search.live)
        return [beam.tokens for _, beam in self._running]

    def advance(self, outputs: Sequence[RequestOutput]) -> None:
        """Take the outputs of the beams ``pending()`` gave (in its order): their
        candidates become the next beams. An output without logprobs (its request was
        aborted) ends its beam; one that failed raises ``StepFailedError``."""
        if len(outputs) != len(self._running):
            raise ValueError(
                f"advance() takes one output per pending beam: {len(self._running)} expected, "
                f"{len(outputs)} given."
            )
        ignore_eos = self.params.ignore_eos
        # Per prompt: (cum_logprob, beam, token id, that step's logprobs); the beams of a
        # prompt are consecutive in self._running.
        candidates: dict[int, list[tuple[float, _Beam, int, dict[int, Logprob]]]] = {}
        for (search, beam), output in zip(self._running, outputs, strict=True):
            completion = output.outputs[0]
            if completion.finish_reason == "error":
                raise StepFailedError(
                    f"beam search stopped: a beam's step failed ({completion.error}).",
                    (output.request_id,),
                )
            mine = candidates.setdefault(id(search), [])
            if not completion.logprobs:
                continue  # aborted before its token: the beam ends, as in vLLM
            step = completion.logprobs[0]
            for token_id, logprob in step.items():
                cum = beam.cum_logprob + logprob.logprob
                if token_id in self._eos and not ignore_eos:
                    search.finished.append(
                        _Beam([*beam.tokens, token_id], [*beam.logprobs, step], cum, "stop")
                    )
                else:
                    mine.append((cum, beam, token_id, step))
        width = self.params.beam_width
        for search in self._searches:
            if not search.live:
                continue
            # Stable: ties keep the beams' order, then the tokens' (their rank).
            best = sorted(candidates.get(id(search), []), key=lambda c: -c[0])[:width]
            search.live = [
                _Beam([*beam.tokens, token_id], [*beam.logprobs, step], cum)
                for cum, beam, token_id, step in best
            ]
        self._steps += 1
        self._running = []

    def results(
        self, decode: Callable[[list[int]], str] | None, *, include_prompt: bool = True
    ) -> list[BeamSearchOutput]:
        """The best ``beam_width`` sequences of each prompt, best first (by
        :func:`~pagedinfer.domain.beam_search.beam_score`). ``decode`` turns token ids into
        text (``None``: empty texts); ``include_prompt=False`` decodes the generated tokens
        only."""
        params = self.params
        outputs = []
        for search in self._searches:
            beams = search.finished + search.live
            beams.sort(key=self._score, reverse=True)
            num_prompt = len(search.prompt.token_ids)
            sequences = []
            for beam in beams[: params.beam_width]:
                shown = beam.tokens if include_prompt else beam.tokens[num_prompt:]
                if beam.finish_reason == "stop" and not params.include_stop_str_in_output:
                    shown = shown[:-1]
                sequences.append(
                    BeamSearchSequence(
                        tokens=beam.tokens,
                        logprobs=beam.logprobs,
                        cum_logprob=beam.cum_logprob,
                        text="" if decode is None else decode(shown),
                        finish_reason=beam.finish_reason or "length",
                        num_prompt_tokens=num_prompt,
                    )
                )
            outputs.append(
                BeamSearchOutput(
                    sequences=sequences,
                    prompt=search.prompt.text,
                    prompt_token_ids=list(search.prompt.token_ids),
                )
            )
        return outputs

    def _score(self, beam: _Beam) -> float:
        length = len(beam.tokens)
        if beam.tokens[-1] in self._eos:
            length -= 1  # vLLM's rule: a final EOS does not count
        return beam_score(beam.cum_logprob, length, self.params.length_penalty)


def check_beam_width(params: BeamSearchParams, max_logprobs: int, flag: str) -> None:
    """Refuse a beam width whose ``2 * beam_width`` candidates exceed the engine's
    ``max_logprobs`` (``flag``: how to raise it, the keyword or the command-line flag)."""
    if params.num_candidates > max_logprobs:
        raise InvalidRequestError(
            f"beam_width={params.beam_width} asks for {params.num_candidates} candidate "
            f"tokens per beam (2 * beam_width), more than max_logprobs={max_logprobs}: use "
            f"beam_width <= {max_logprobs // 2} or raise {flag}."
        )


def beam_search(
    engine: Engine,
    prompts: Prompt | Sequence[Prompt],
    params: BeamSearchParams,
    *,
    use_tqdm: bool = False,
) -> list[BeamSearchOutput]:
    """Beam search of each prompt on ``engine`` (vLLM's ``LLM.beam_search``); outputs in
    input order. Every prompt is tokenized and checked before the first step.
    ``use_tqdm``: a progress bar over the steps (``max_tokens`` at most; the search may end
    sooner)."""
    search = _start(engine, prompts, params)
    step_params = engine.check_sampling_params(search.step_params)
    bar: Any = None
    if use_tqdm:
        from tqdm.auto import tqdm

        bar = tqdm(total=params.max_tokens, desc="Beam search", unit="token", dynamic_ncols=True)
    try:
        while batch := search.pending():
            search.advance(engine.generate(batch, step_params, use_tqdm=False))
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return search.results(_decoder(engine.tokenizer))


async def beam_search_async(
    engine: AsyncEngine,
    prompts: Sequence[TokenizedPrompt],
    params: BeamSearchParams,
    *,
    include_prompt: bool = True,
) -> list[BeamSearchOutput]:
    """:func:`beam_search` on an ``AsyncEngine`` (a server): each step's one-token requests
    join the engine's running batch. Cancelling the awaiting task aborts the step's
    requests. ``include_prompt=False``: texts of the generated tokens only."""
    search = _start(engine.engine, prompts, params)
    step_params = engine.check_sampling_params(search.step_params)
    while batch := search.pending():
        streams: list[AsyncRequestStream] = []
        try:
            for token_ids in batch:
                streams.append(engine.generate(token_ids, step_params))
            outputs = await asyncio.gather(*(_last(stream) for stream in streams))
        finally:
            for stream in streams:
                stream.close()  # no-op once finished; aborts the rest
        search.advance(outputs)
    return search.results(_decoder(engine.tokenizer), include_prompt=include_prompt)


def _start(
    engine: Engine, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams
) -> BeamSearch:
    if isinstance(params, BeamSearchParams):
        check_beam_width(params, engine.request_limits.max_logprobs, "max_logprobs")
    return BeamSearch(
        tokenize_prompts(engine, prompts),
        params,
        eos_token_ids=engine.model_config.eos_token_ids,
        max_model_len=engine.max_model_len,
    )


def tokenize_prompts(engine: Engine, prompts: Prompt | Sequence[Prompt]) -> list[TokenizedPrompt]:
    """One prompt or a list of them (``generate``'s forms), each tokenized and checked."""
    return [
        engine.tokenize(
            item
            if isinstance(item, TokenizedPrompt)
            else item.token_ids
            if item.token_ids is not None
            else str(item.text)
        )
        for item in parse_prompts(prompts)
    ]


async def _last(stream: AsyncRequestStream) -> RequestOutput:
    last: RequestOutput | None = None
    async for output in stream:
        last = output
    assert last is not None and last.finished
    return last


def _decoder(tokenizer: Any) -> Callable[[list[int]], str] | None:
    if tokenizer is None:
        return None
    decode = tokenizer.decode

    def text(token_ids: list[int]) -> str:
        return str(decode(token_ids))

    return text
