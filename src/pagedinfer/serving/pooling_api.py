"""The bodies of the pooling routes and their responses: OpenAI's ``/v1/embeddings``,
vLLM's ``/score`` and the ``/rerank`` of vLLM, Jina and Cohere (``/v1/rerank``, ``/v2/rerank``).

Each body is checked here (pydantic, strict JSON types); the routes
(:mod:`pagedinfer.serving.routes.pooling`) tokenize, run the prompts through the engine as
pooling requests and shape what comes back with the functions below.
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "EmbeddingRequest",
    "RerankRequest",
    "ScoreRequest",
    "embedding_response",
    "rerank_response",
    "score_response",
]


class _Body(BaseModel):
    # Unknown fields (OpenAI's "user", Cohere's "max_chunks_per_doc", ...) are ignored.
    model_config = ConfigDict(extra="ignore", strict=True)


class EmbeddingRequest(_Body):
    """OpenAI's ``POST /v1/embeddings``: ``input`` is a string, a list of strings, a list
    of token ids or a list of token-id lists."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    def prompts(self) -> list[Any]:
        """One prompt per input: a string, or a list of token ids."""
        value = self.input
        if isinstance(value, str) or (value and all(isinstance(i, int) for i in value)):
            return [value]  # one text, or one prompt of token ids
        return list(value)


class ScoreRequest(_Body):
    """vLLM's ``POST /score``: ``text_1`` (one query, or one per document) against each of
    ``text_2`` (``queries`` / ``documents`` too)."""

    model: str | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None


class RerankRequest(_Body):
    """``POST /rerank`` (vLLM, Jina, Cohere): ``query``, ``documents`` (strings, or objects
    with ``text``), ``top_n`` (0 or absent: all), ``return_documents`` (default true)."""

    model: str | None = None
    query: str
    documents: list[str | dict[str, Any]]
    top_n: int | None = Field(default=None, ge=0)
    return_documents: bool = True

    def texts(self) -> list[str]:
        texts = []
        for index, document in enumerate(self.documents):
            text = document if isinstance(document, str) else document.get("text")
            if not isinstance(text, str):
                raise ValueError(f"documents[{index}] is neither a string nor {{'text': str}}")
            texts.append(text)
        return texts


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    # OpenAI's base64: the little-endian float32 array.
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def embedding_response(
    model: str, embeddings: list[list[float]], encoding_format: str, prompt_tokens: int
) -> dict[str, Any]:
    return {
        "id": f"embd-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [
            {"object": "embedding", "index": index, "embedding": _encode(vector, encoding_format)}
            for index, vector in enumerate(embeddings)
        ],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def score_response(model: str, scores: list[float], prompt_tokens: int) -> dict[str, Any]:
    return {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [
            {"object": "score", "index": index, "score": score}
            for index, score in enumerate(scores)
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens,
            "completion_tokens": 0,
        },
    }


def rerank_response(
    model: str, body: RerankRequest, scores: list[float], prompt_tokens: int
) -> dict[str, Any]:
    """The documents by relevance, highest first (the first ``top_n``)."""
    order = sorted(range(len(scores)), key=lambda index: -scores[index])
    if body.top_n:
        order = order[: body.top_n]
    texts = body.texts()
    results = []
    for index in order:
        result: dict[str, Any] = {"index": index, "relevance_score": scores[index]}
        if body.return_documents:
            result["document"] = {"text": texts[index]}
        results.append(result)
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        "results": results,
    }
