"""Between a Ray Data batch and the Engine: prompts in, output columns out.

A batch is what ``Dataset.map_batches`` hands its callable: a dict of column name to numpy
array (Ray's default batch format) or a pandas DataFrame (``batch_format="pandas"``). Nothing
here imports Ray, numpy or pandas: values are read through ``tolist()`` and ``item()``, so
the same code serves both formats and can be tested without a cluster.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pagedinfer.errors import InvalidRequestError

if TYPE_CHECKING:
    from pagedinfer.engine.outputs import RequestOutput

__all__ = [
    "MESSAGES_COLUMN",
    "OUTPUT_COLUMNS",
    "PROMPT_COLUMN",
    "batch_prompts",
    "chat_prompt_token_ids",
    "completion_of",
    "output_columns",
    "with_columns",
]

PROMPT_COLUMN = "prompt"
MESSAGES_COLUMN = "messages"
OUTPUT_COLUMNS = (
    "generated_text",
    "generated_token_ids",
    "finish_reason",
    "num_prompt_tokens",
    "num_cached_tokens",
)

Prompt = str | list[int]
Messages = list[dict[str, Any]]


def batch_prompts(
    batch: Mapping[str, Any],
    tokenizer: Any,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[Prompt]:
    """One prompt per row: the ``prompt`` column (text or token ids), else ``messages``.

    A row whose ``prompt`` is missing (None) falls back to its ``messages``, which go through
    the tokenizer's chat template. Raises ``InvalidRequestError`` naming the row otherwise.
    """
    prompts = _column(batch, PROMPT_COLUMN)
    conversations = _column(batch, MESSAGES_COLUMN)
    if prompts is None and conversations is None:
        raise InvalidRequestError(
            f"a batch needs a {PROMPT_COLUMN!r} column (text or token ids) or a "
            f"{MESSAGES_COLUMN!r} column (chat messages); this one has the columns "
            f"{sorted(map(str, batch.keys()))}. Rename your input column."
        )
    num_rows = len(prompts if prompts is not None else conversations or [])
    result: list[Prompt] = []
    for row in range(num_rows):
        prompt = prompts[row] if prompts is not None else None
        if prompt is not None:
            result.append(_as_prompt(prompt, row))
            continue
        messages = conversations[row] if conversations is not None else None
        if messages is None:
            raise InvalidRequestError(
                f"row {row} of the batch has neither a {PROMPT_COLUMN!r} nor "
                f"{MESSAGES_COLUMN!r} value."
            )
        result.append(
            chat_prompt_token_ids(tokenizer, _as_messages(messages, row), chat_template_kwargs)
        )
    return result


def chat_prompt_token_ids(
    tokenizer: Any, messages: Messages, chat_template_kwargs: Mapping[str, Any] | None = None
) -> list[int]:
    """The token ids of ``messages`` rendered by the tokenizer's chat template, ready for the
    assistant's reply (``add_generation_prompt=True``).

    Token ids, not text, so that the template's special tokens are not tokenized a second
    time. ``chat_template_kwargs`` reach the template (Qwen3: ``{"enable_thinking": False}``).
    """
    if tokenizer is None:
        raise InvalidRequestError(
            "a 'messages' row needs the checkpoint's tokenizer, and this checkpoint has no "
            "tokenizer files: pass token-id prompts in the 'prompt' column instead."
        )
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            "the checkpoint's tokenizer has no chat template, so 'messages' rows cannot be "
            "rendered: add a chat_template to tokenizer_config.json, or render the prompts "
            "yourself and pass them in the 'prompt' column."
        )
    token_ids = tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        **dict(chat_template_kwargs or {}),
    )
    return [int(token_id) for token_id in token_ids]


def completion_of(output: RequestOutput) -> tuple[str, list[int], str | None]:
    """``(text, token_ids, finish_reason)`` of a finished request's (first) completion.

    The one place that knows where a ``RequestOutput`` keeps its completion, so the switch to
    vLLM's shape (``output.outputs[0].text``, issue 12) is one edit here.
    """
    completion = output.outputs[0]
    return completion.text, list(completion.token_ids), completion.finish_reason


def output_columns(outputs: Sequence[RequestOutput]) -> dict[str, list[Any]]:
    """The columns the predictor adds, one value per output, in the outputs' order."""
    columns: dict[str, list[Any]] = {name: [] for name in OUTPUT_COLUMNS}
    for output in outputs:
        text, token_ids, finish_reason = completion_of(output)
        columns["generated_text"].append(text)
        columns["generated_token_ids"].append(token_ids)
        columns["finish_reason"].append(finish_reason)
        columns["num_prompt_tokens"].append(len(output.prompt_token_ids))
        columns["num_cached_tokens"].append(output.num_cached_tokens)
    return columns


def with_columns(batch: Mapping[str, Any], columns: Mapping[str, list[Any]]) -> Any:
    """``batch`` with ``columns`` added (replacing any of the same name), in its own format."""
    assign = getattr(batch, "assign", None)
    if callable(assign):  # a pandas DataFrame
        return assign(**columns)
    return {**batch, **columns}


def _column(batch: Mapping[str, Any], name: str) -> list[Any] | None:
    # list() reads a pandas Series by position and a numpy array row by row.
    return list(batch[name]) if name in batch else None


def _as_prompt(value: Any, row: int) -> Prompt:
    if isinstance(value, str):  # also numpy.str_
        return str(value)
    items = value.tolist() if hasattr(value, "tolist") else value
    if isinstance(items, (list, tuple)):
        # Python ints for the engine's checks; a float stays a float and is rejected there.
        return [item.item() if hasattr(item, "item") else item for item in items]
    raise InvalidRequestError(
        f"row {row}: a {PROMPT_COLUMN!r} value must be text or a list of token ids, not "
        f"{type(value).__name__}."
    )


def _as_messages(value: Any, row: int) -> Messages:
    items = value.tolist() if hasattr(value, "tolist") else value
    if isinstance(items, (list, tuple)) and all(isinstance(item, Mapping) for item in items):
        return [dict(item) for item in items]
    raise InvalidRequestError(
        f"row {row}: a {MESSAGES_COLUMN!r} value must be a list of messages such as "
        f"{{'role': 'user', 'content': '...'}}, not {type(value).__name__}."
    )
