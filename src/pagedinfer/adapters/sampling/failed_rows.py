"""Samples that fail their own request: which ones, and why.

A row fails when the sampler found no finite allowed token (``NO_TOKEN``: every token masked,
or NaN logits) or when its structured-output matcher failed (``GrammarStep.failed``). The
runner reports them in ``StepOutput.failed_samples`` with a placeholder token (0) in their
place; the engine ends those requests with ``finish_reason="error"`` and the rest of the step
goes on.
"""

from __future__ import annotations

from pagedinfer.adapters.sampling.sampler import NO_TOKEN

__all__ = ["NO_LOGITS_REASON", "failed_samples"]

NO_LOGITS_REASON = (
    "no token could be sampled: the model's logits for this request hold no finite value "
    "among the allowed tokens (NaN, or every token masked)"
)


def failed_samples(
    sampled: list[int], grammar_failed: dict[int, str] | None
) -> dict[int, str] | None:
    """The failed samples of a step by index (``None`` when none failed); ``sampled`` gets a
    placeholder 0 in place of each ``NO_TOKEN``. The grammar's reason wins for its rows."""
    failed: dict[int, str] | None = dict(grammar_failed) if grammar_failed else None
    if sampled and min(sampled) < 0:
        failed = failed or {}
        for index, token in enumerate(sampled):
            if token == NO_TOKEN:
                failed.setdefault(index, NO_LOGITS_REASON)
                sampled[index] = 0
    if failed:
        for index in failed:
            sampled[index] = max(sampled[index], 0)
    return failed or None
