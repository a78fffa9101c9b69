"""``use_beam_search`` on ``POST /v1/completions`` (vLLM's extension): ``n`` beams per prompt,
answered whole (a streamed beam search is a 400: its best beams are known only at the end).

The body maps onto :class:`~pagedinfer.BeamSearchParams` as vLLM maps it: ``n`` is the beam
width, ``max_tokens``, ``ignore_eos``, ``temperature`` (default 0), ``length_penalty`` and
``include_stop_str_in_output`` as given. Each prompt's ``n`` best beams become its ``n``
choices, best first, in the usual completion shape (``logprobs``, ``echo``,
``return_token_ids`` and ``usage`` as for any completion). Fields that choose tokens
differently (``top_p``, ``stop``, the penalties, structured outputs, ...) do not apply to beam
search: a value that asks for something is a 400 naming the field, as is ``length_penalty``
without ``use_beam_search``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from pagedinfer.domain.beam_search import BeamSearchParams
from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.engine.beam_search import BeamSearchOutput, beam_search_async, check_beam_width
from pagedinfer.engine.outputs import CompletionOutput, RequestOutput
from pagedinfer.serving.fields import RequestFieldError
from pagedinfer.serving.prompts import Truncation, encode_prompt
from pagedinfer.serving.protocol import (
    CompletionRequest,
    completion_prompts,
    echoes_prompt_only,
    truncation_limit,
)
from pagedinfer.serving.responses import completion_response
from pagedinfer.serving.state import State
from pagedinfer.serving.streaming import finish_reason, observe, until_disconnected
from pagedinfer.serving.structured import structured_request

__all__ = ["beam_search_completions", "beam_search_params"]

# Fields beam search does not apply, and the values that ask for nothing.
_NOT_APPLIED: dict[str, tuple[Any, ...]] = {
    "top_p": (None, 1.0),
    "top_k": (None, 0, -1),
    "min_p": (None, 0.0),
    "presence_penalty": (None, 0.0),
    "frequency_penalty": (None, 0.0),
    "repetition_penalty": (None, 1.0),
    "logit_bias": (None, {}),
    "stop": (None, [], ""),
    "stop_token_ids": (None, []),
    "allowed_token_ids": (None,),
    "min_tokens": (0,),
    "seed": (None, -1),
    "prompt_logprobs": (None,),
}


def beam_search_params(body: CompletionRequest, max_model_len: int) -> BeamSearchParams | None:
    """The body's :class:`BeamSearchParams` (``None`` without ``use_beam_search``), or a
    400 (``RequestFieldError``) naming the field beam search cannot serve."""
    if not body.use_beam_search:
        if body.length_penalty != 1.0:
            raise _bad(
                "length_penalty",
                "length_penalty applies to beam search only: send "
                "use_beam_search=true with it, or leave it out",
            )
        return None
    if body.stream:
        raise _bad(
            "stream",
            "use_beam_search cannot be streamed: the best beams are known only when the "
            "search ends. Send stream=false",
        )
    for name, neutral in _NOT_APPLIED.items():
        value = getattr(body, name)
        if not any(type(value) is type(n) and value == n for n in neutral) and value is not None:
            raise _bad(
                name, f"{name} does not apply to beam search (use_beam_search): leave it out"
            )
    if body.best_of is not None and body.best_of != body.n:
        raise _bad("best_of", "best_of must equal n (the beam width) or be left out")
    structured = structured_request(body)
    if structured is not None:
        raise _bad(
            "response_format",
            "structured outputs do not apply to beam search (use_beam_search): leave out "
            "response_format, structured_outputs and the guided_* fields",
        )
    max_tokens = body.output_tokens
    return BeamSearchParams(  # its own checks: InvalidSamplingParamsError, a 400
        beam_width=body.n,
        max_tokens=max_model_len if max_tokens is None else max_tokens,
        ignore_eos=body.ignore_eos,
        temperature=0.0 if body.temperature is None else body.temperature,
        length_penalty=body.length_penalty,
        include_stop_str_in_output=body.include_stop_str_in_output,
    )


async def beam_search_completions(
    body: CompletionRequest, request: Request, state: State, params: BeamSearchParams
) -> Response:
    """Answer a completion request with ``use_beam_search`` (its sizes already checked)."""
    engine = state.engine
    check_beam_width(params, engine.request_limits.max_logprobs, "--max-logprobs")
    truncation = Truncation(truncation_limit(body, engine.max_model_len), body.truncation_side)
    prompts = await asyncio.gather(
        *(
            asyncio.to_thread(
                encode_prompt,
                engine.engine,
                prompt,
                add_special_tokens=body.add_special_tokens,
                truncation=truncation,
            )
            for prompt in completion_prompts(body)
        )
    )
    timers = [state.metrics.timer() for _ in prompts]
    try:
        found = await until_disconnected(
            request, beam_search_async(engine, prompts, params, include_prompt=False)
        )
    except asyncio.CancelledError:
        for timer in timers:
            timer.finished("abort")
        raise
    except Exception:
        for timer in timers:
            timer.finished("error")
        raise
    outputs = [_request_output(result) for result in found]
    for timer, output in zip(timers, outputs, strict=True):
        observe(timer, output)
        timer.finished(finish_reason(output))
    # The response's logprobs: as many top tokens per token as the body asked for.
    shown = SamplingParams(logprobs=body.logprobs)
    ctx = state.context("cmpl", shown, body, echo=body.echo, echo_only=echoes_prompt_only(body))
    return JSONResponse(completion_response(ctx, outputs, params.beam_width))


def _request_output(result: BeamSearchOutput) -> RequestOutput:
    """One prompt's beams as the engine's output shape (the response code reads that)."""
    completions: Sequence[CompletionOutput] = [
        CompletionOutput(
            index=index,
            text=sequence.text,
            token_ids=sequence.output_token_ids,
            cumulative_logprob=sequence.cum_logprob,
            logprobs=sequence.logprobs,
            finish_reason=sequence.finish_reason,
            stop_reason=sequence.stop_reason,
        )
        for index, sequence in enumerate(result.sequences)
    ]
    return RequestOutput(
        request_id="",
        prompt=result.prompt,
        prompt_token_ids=result.prompt_token_ids,
        prompt_logprobs=None,
        outputs=list(completions),
        finished=True,
        num_cached_tokens=0,
    )


def _bad(param: str, message: str) -> RequestFieldError:
    return RequestFieldError(param, message + ".")
