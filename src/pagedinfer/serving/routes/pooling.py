"""The pooling routes (``pagedinfer serve DIR --runner pooling``): ``POST /v1/embeddings``,
``/score`` (and ``/v1/score``), ``/rerank`` (and ``/v1/rerank``, ``/v2/rerank``).

Prompts are tokenized in worker threads, queued as pooling requests and read to their
final output; the vectors are shaped by the engine's
:class:`~pagedinfer.engine.pooling.PoolingTasks` (normalization, ``dimensions``, heads). On a
generating model each route answers 400, as the generation routes do on a pooling model.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request

from pagedinfer.engine.outputs import RequestOutput
from pagedinfer.engine.pooling import PoolingTasks
from pagedinfer.engine.pooling_setup import POOLING_PARAMS
from pagedinfer.errors import InvalidRequestError
from pagedinfer.serving.errors import OpenAIError
from pagedinfer.serving.pooling_api import (
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    embedding_response,
    rerank_response,
    score_response,
)
from pagedinfer.serving.state import ServingState, State
from pagedinfer.serving.streaming import until_disconnected

__all__ = ["embeddings", "rerank", "score"]


async def embeddings(body: EmbeddingRequest, state: State, request: Request) -> dict[str, Any]:
    tasks = _tasks(state, request, "/v1/embeddings")
    state.check_model(body.model)
    dimensions = tasks.check_dimensions(body.dimensions)
    outputs = await until_disconnected(request, _pool(state, body.prompts()))
    vectors = [
        tasks.embedding(_pooled(output), dimensions, tasks.setup.normalize) for output in outputs
    ]
    return embedding_response(
        state.served_model_name, vectors, body.encoding_format, _num_tokens(outputs)
    )


async def score(body: ScoreRequest, state: State, request: Request) -> dict[str, Any]:
    first = body.text_1 if body.text_1 is not None else body.queries
    second = body.text_2 if body.text_2 is not None else body.documents
    if first is None or second is None:
        raise OpenAIError(400, "/score needs text_1 and text_2 (or queries and documents).")
    state.check_model(body.model)
    scores, tokens = await _scores(state, request, first, second, "/score")
    return score_response(state.served_model_name, scores, tokens)


async def rerank(body: RerankRequest, state: State, request: Request) -> dict[str, Any]:
    state.check_model(body.model)
    try:
        texts = body.texts()
    except ValueError as error:
        raise OpenAIError(400, str(error), param="documents") from None
    if not texts:
        raise OpenAIError(400, "documents is empty: pass at least one.", param="documents")
    scores, tokens = await _scores(state, request, body.query, texts, "/rerank")
    return rerank_response(state.served_model_name, body, scores, tokens)


async def _scores(
    state: ServingState,
    request: Request,
    first: str | list[str],
    second: str | list[str],
    route: str,
) -> tuple[list[float], int]:
    """Each pair's score (a cross-encoder's head, or the cosine of two embeddings) and the
    prompt tokens counted."""
    tasks = _tasks(state, request, route)
    queries = [first] if isinstance(first, str) else list(first)
    documents = [second] if isinstance(second, str) else list(second)
    if len(queries) == 1:
        queries = queries * len(documents)
    if len(queries) != len(documents) or not documents:
        raise OpenAIError(
            400,
            f"{len(queries)} queries for {len(documents)} documents: pass one query and any "
            "number of documents, or as many queries as documents (>= 1).",
        )
    if tasks.setup.head is not None:
        await asyncio.to_thread(tasks.head)  # read from the checkpoint once, off the loop
        pairs = [tasks.pair_tokens(q, d) for q, d in zip(queries, documents, strict=True)]
        outputs = await until_disconnected(request, _pool(state, pairs))
        return [tasks.relevance(_pooled(output)) for output in outputs], _num_tokens(outputs)
    outputs = await until_disconnected(request, _pool(state, [*queries, *documents]))
    half = len(queries)
    both = zip(outputs[:half], outputs[half:], strict=True)
    scores = [tasks.cosine(_pooled(query), _pooled(document)) for query, document in both]
    return scores, _num_tokens(outputs)


def _tasks(state: ServingState, request: Request, route: str) -> PoolingTasks:
    """The app's pooling tasks (made once, on the app's state), or a 400 on a generating
    model."""
    engine = state.engine.engine
    if engine.pooling is None:
        raise OpenAIError(
            400,
            f"{route} needs a pooling model: this server's model generates (start it with "
            "`pagedinfer serve DIR --runner pooling`).",
        )
    tasks: PoolingTasks | None = getattr(request.app.state, "pooling_tasks", None)
    if tasks is None:
        tasks = request.app.state.pooling_tasks = PoolingTasks(engine)
    return tasks


async def _pool(state: ServingState, prompts: list[Any]) -> list[RequestOutput]:
    """Every prompt's final output as a pooling request (all queued before any is read)."""
    if not prompts:
        raise InvalidRequestError("input is empty: pass at least one prompt.")
    engine = state.engine
    tokenized = [await engine.tokenize(prompt) for prompt in prompts]
    streams = [engine.generate(prompt, POOLING_PARAMS) for prompt in tokenized]
    try:
        outputs = []
        for stream in streams:
            final: RequestOutput | None = None
            async for output in stream:
                final = output
            assert final is not None
            outputs.append(final)
        return outputs
    finally:
        for stream in streams:
            stream.close()


def _pooled(output: RequestOutput) -> list[float]:
    if output.pooled is None:
        raise OpenAIError(500, f"request {output.request_id} ended before it was pooled.")
    return output.pooled


def _num_tokens(outputs: list[RequestOutput]) -> int:
    return sum(len(output.prompt_token_ids) for output in outputs)
