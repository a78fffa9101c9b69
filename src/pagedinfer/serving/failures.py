"""What a client hears when its request ended with ``finish_reason="error"``.

The engine ends a request alone when its own input fails it while it runs (its structured-output
constraint hit a grammar limit or a dead end; or its logits held no finite allowed token):
``CompletionOutput.error`` says why (``engine/failed_requests.py``). The server never passes
``"error"`` on as an OpenAI finish reason; it answers for that request only:

* non-streaming: an error response instead of the completion: 400 (``invalid_request_error``,
  code ``constraint_failed``) when the constraint failed, 500 (``server_error``, code
  ``generation_failed``) otherwise;
* streaming: the chunks sent so far stand, then one SSE error event with the same body, then
  ``[DONE]``.

Every other request, streaming or not, goes on untouched.
"""

from __future__ import annotations

from pagedinfer.engine.outputs import RequestOutput
from pagedinfer.serving.errors import OpenAIError

__all__ = ["raise_if_failed"]


def raise_if_failed(output: RequestOutput) -> None:
    """Raise the :class:`OpenAIError` of ``output`` if a completion ended with ``"error"``."""
    for completion in output.outputs:
        if completion.finish_reason != "error":
            continue
        reason = completion.error or "the request failed during generation"
        if "constraint" in reason:
            raise OpenAIError(
                400,
                f"the request's structured-output constraint failed during generation: "
                f"{reason}. Simplify the constraint (or ask the operator to raise the "
                "grammar limits).",
                code="constraint_failed",
            )
        raise OpenAIError(
            500,
            f"the request failed during generation: {reason}.",
            type="server_error",
            code="generation_failed",
        )
