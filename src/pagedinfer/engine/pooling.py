"""A pooling model's public results (vLLM's shapes) and how they are made from the engine's.

A pooling engine (``runner="pooling"``) runs each prompt's prefill through the scheduler and
returns, per request, the pooled hidden state (``RequestOutput.pooled``; how it is pooled:
``engine/pooling_setup.py``). :class:`PoolingTasks` turns those into embeddings (normalized,
Matryoshka-truncated), classification probabilities (a checkpoint's head) and scores
(a cross-encoder's head, or the cosine of two embeddings), as ``LLM.embed``,
``LLM.classify`` and ``LLM.score`` return them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedinfer.adapters.pooling.heads import read_head_rows
from pagedinfer.engine.outputs import RequestOutput
from pagedinfer.engine.pooling_setup import POOLING_PARAMS, PoolingSetup
from pagedinfer.engine.prompts import Prompt, TokenizedPrompt, parse_prompts
from pagedinfer.errors import ConfigurationError, InvalidRequestError

if TYPE_CHECKING:
    from pagedinfer.engine.engine import Engine

__all__ = [
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "PoolingParams",
    "PoolingTasks",
    "ScoringOutput",
    "ScoringRequestOutput",
]


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """vLLM's ``PoolingParams``: ``dimensions`` (Matryoshka truncation of an embedding),
    ``normalize`` (embeddings; ``None``: the model's), ``activation`` (classification:
    sigmoid / softmax; ``None``: on)."""

    dimensions: int | None = None
    normalize: bool | None = None
    activation: bool | None = None


@dataclass(frozen=True, slots=True)
class EmbeddingOutput:
    """One embedding (vLLM's ``EmbeddingOutput``)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(frozen=True, slots=True)
class EmbeddingRequestOutput:
    """vLLM's ``EmbeddingRequestOutput``: ``outputs.embedding`` is the prompt's embedding."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass(frozen=True, slots=True)
class ClassificationOutput:
    """vLLM's ``ClassificationOutput``: one probability per label."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(frozen=True, slots=True)
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass(frozen=True, slots=True)
class ScoringOutput:
    """vLLM's ``ScoringOutput``: the pair's relevance (a classifier's probability, or the
    cosine similarity of two embeddings)."""

    score: float


@dataclass(frozen=True, slots=True)
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


class PoolingTasks:
    """``embed``, ``classify`` and ``score`` on a pooling engine."""

    def __init__(self, engine: Engine) -> None:
        if engine.pooling is None:
            raise InvalidRequestError(
                "this engine generates: embed, classify and score need a pooling model; "
                "start it with runner='pooling' (docs/pooling.md)."
            )
        self.engine = engine
        self.setup: PoolingSetup = engine.pooling
        self._head: torch.Tensor | None = None

    # ------------------------------------------------------------------ tasks
    def pooled(
        self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = False
    ) -> list[RequestOutput]:
        """Each prompt's engine output, its pooled hidden state in ``pooled``."""
        return self.engine.generate(prompts, POOLING_PARAMS, use_tqdm=use_tqdm)

    def truncated(
        self, prompts: Prompt | Sequence[Prompt], keep: int | None
    ) -> Prompt | Sequence[Prompt]:
        """vLLM's ``truncate_prompt_tokens``: each prompt's last ``keep`` tokens (``None``: as
        it is; -1: up to ``max_model_len``)."""
        if keep is None:
            return prompts
        limit = self.engine.max_model_len if keep == -1 else keep
        if not isinstance(limit, int) or limit < 1:
            raise InvalidRequestError(
                f"truncate_prompt_tokens={keep!r}: expected None, -1 or an integer >= 1."
            )
        ids = []
        for prompt in parse_prompts(prompts):
            if isinstance(prompt, TokenizedPrompt):
                ids.append(list(prompt.token_ids))
            elif prompt.token_ids is not None:
                ids.append(prompt.token_ids)
            else:
                assert prompt.text is not None  # before the length check: truncated first
                ids.append(list(self.engine.tokenizer.encode(prompt.text)))
        return [tokens[-limit:] for tokens in ids]

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: PoolingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[EmbeddingRequestOutput]:
        params = params or PoolingParams()
        dimensions = self.check_dimensions(params.dimensions)
        normalize = self.setup.normalize if params.normalize is None else params.normalize
        return [
            EmbeddingRequestOutput(
                output.request_id,
                EmbeddingOutput(self.embedding(_pooled(output), dimensions, normalize)),
                output.prompt_token_ids,
            )
            for output in self.pooled(prompts, use_tqdm)
        ]

    def check_dimensions(self, dimensions: int | None) -> int | None:
        """``dimensions`` checked against what the model allows (``InvalidRequestError``)."""
        try:
            return self.setup.check_dimensions(dimensions, self.engine.model_config.hidden_size)
        except ConfigurationError as error:
            raise InvalidRequestError(str(error)) from None

    @staticmethod
    def embedding(pooled: list[float], dimensions: int | None, normalize: bool) -> list[float]:
        """A pooled vector as an embedding: truncated to ``dimensions``, then L2-normalized."""
        vector = pooled[:dimensions] if dimensions is not None else pooled
        if not normalize:
            return vector
        norm = max(math.sqrt(math.fsum(x * x for x in vector)), 1e-12)
        return [x / norm for x in vector]

    def classify(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: PoolingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[ClassificationRequestOutput]:
        activation = (
            self.setup.activation
            if params is None or params.activation is None
            else (params.activation)
        )
        return [
            ClassificationRequestOutput(
                output.request_id,
                ClassificationOutput(self.probabilities(_pooled(output), activation)),
                output.prompt_token_ids,
            )
            for output in self.pooled(prompts, use_tqdm)
        ]

    def probabilities(self, pooled: list[float], activation: bool = True) -> list[float]:
        """The classification head over a pooled vector: sigmoid for one label, softmax for
        more (``activation=False``: the raw logits)."""
        logits = self.head() @ torch.tensor(pooled, dtype=torch.float32)
        if not activation:
            return [float(x) for x in logits.tolist()]
        probs = torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, dim=0)
        return [float(x) for x in probs.tolist()]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        use_tqdm: bool = False,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score``: one query against each document (or pairs, element by
        element). A classifier scores each pair in one prompt (query then document); an
        embedder scores the cosine of their embeddings."""
        queries = [data_1] if isinstance(data_1, str) else list(data_1)
        documents = [data_2] if isinstance(data_2, str) else list(data_2)
        if len(queries) == 1:
            queries = queries * len(documents)
        if len(queries) != len(documents) or not documents:
            raise InvalidRequestError(
                f"score got {len(queries)} queries for {len(documents)} documents: pass one "
                "query and any number of documents, or as many queries as documents (>= 1)."
            )
        if self.setup.head is not None:
            pairs = [self.pair_tokens(q, d) for q, d in zip(queries, documents, strict=True)]
            prompts = self.truncated(pairs, truncate_prompt_tokens)
            return [
                ScoringRequestOutput(
                    output.request_id,
                    ScoringOutput(self.relevance(_pooled(output))),
                    output.prompt_token_ids,
                )
                for output in self.pooled(prompts, use_tqdm)
            ]
        both = self.truncated([*queries, *documents], truncate_prompt_tokens)
        outputs = self.pooled(both, use_tqdm)
        half = len(queries)
        return [
            ScoringRequestOutput(
                document.request_id,
                ScoringOutput(self.cosine(_pooled(query), _pooled(document))),
                query.prompt_token_ids + document.prompt_token_ids,
            )
            for query, document in zip(outputs[:half], outputs[half:], strict=True)
        ]

    def cosine(self, first: list[float], second: list[float]) -> float:
        """An embedder's score of a pair: the cosine similarity of the pooled vectors."""
        a = self.embedding(first, None, True)
        b = self.embedding(second, None, True)
        return math.fsum(x * y for x, y in zip(a, b, strict=True))

    def relevance(self, pooled: list[float]) -> float:
        """A cross-encoder's score of one pair: the probability of its one label (sigmoid),
        or of the last label (softmax: Qwen3-Reranker's ``yes`` after ``no``)."""
        return self.probabilities(pooled)[-1]

    def pair_tokens(self, query: str, document: str) -> list[int]:
        """A query and a document as one cross-encoder prompt (the tokenizer's pair form)."""
        tokenizer = self.engine.tokenizer
        ids: list[int] = tokenizer(query, document)["input_ids"]
        return ids

    # ------------------------------------------------------------------ head
    def head(self) -> torch.Tensor:
        """The classification head, ``[num_labels, hidden]`` float32 (read once)."""
        if self._head is not None:
            return self._head
        setup = self.setup
        path = self.engine.config.model_path
        if setup.head == "score":
            head = read_head_rows(path, ("score.weight",), None)
        elif setup.head == "tokens":
            ids = [self._token_id(token) for token in setup.head_tokens]
            head = read_head_rows(path, ("lm_head.weight", "model.embed_tokens.weight"), ids)
            if setup.qwen3_reranker:
                if len(ids) != 2:
                    raise ConfigurationError(
                        "is_original_qwen3_reranker needs classifier_from_token of two tokens "
                        f'(["no", "yes"]), got {list(setup.head_tokens)}.'
                    )
                head = (head[1] - head[0]).unsqueeze(0)
        else:
            raise InvalidRequestError(
                "this model has no classification head (it is an embedder): classify needs "
                "a *ForSequenceClassification checkpoint, or pooler_config / hf_overrides "
                "with classifier_from_token (docs/pooling.md)."
            )
        self._head = head
        return head

    def _token_id(self, token: str) -> int:
        tokenizer = self.engine.tokenizer
        token_id = tokenizer.convert_tokens_to_ids(token)
        if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
            raise ConfigurationError(
                f"classifier_from_token {token!r} is not a token of the model's tokenizer."
            )
        return token_id


def _pooled(output: RequestOutput) -> list[float]:
    if output.pooled is None:  # aborted before its prompt was computed
        raise InvalidRequestError(f"request {output.request_id} ended before it was pooled.")
    return output.pooled
