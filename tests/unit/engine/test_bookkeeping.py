"""A step's bookkeeping has two paths: the full one (every updated completion: stop strings,
logprobs, progress news) and, while no unfinished request needs every step's news, a short
one that looks only at the sequences that just finished. Both must give the same outputs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pagedinfer import Engine, RequestOutput, SamplingParams

# A third of the vocabulary stops a completion: siblings (n > 1) end at different steps,
# some in the same step, some on their first token.
STOPS = list(range(0, 512, 3))
PARAMS = [
    SamplingParams(n=3, seed=7, temperature=0.9, max_tokens=12, stop_token_ids=STOPS),
    SamplingParams(seed=8, temperature=0.9, max_tokens=5, ignore_eos=True),
    SamplingParams(n=2, seed=9, temperature=0.9, max_tokens=9, ignore_eos=True),
    SamplingParams(seed=10, temperature=0.9, max_tokens=12, stop_token_ids=STOPS),
]
PROMPTS = [[1 + i, 2 + i, 3 + i, 40 + 7 * i] for i in range(len(PARAMS))]


def _summary(outputs: list[RequestOutput]) -> list[list[tuple[list[int], str | None]]]:
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outputs]


def _by_step_loop(engine: Engine) -> list[RequestOutput]:
    """add_request + step(): the step sink shows progress, so the full path runs."""
    ids = [engine.add_request(p, params) for p, params in zip(PROMPTS, PARAMS, strict=True)]
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    return [final[request_id] for request_id in ids]


def test_generate_finishes_requests_as_the_step_loop_does(
    make_checkpoint: Callable[..., Path],
) -> None:
    checkpoint = make_checkpoint("tiny")
    options = {"device": "cpu", "kv_block_size": 4, "max_model_len": 32, "max_num_seqs": 8}
    with Engine(checkpoint, **options) as engine:
        expected = _summary(_by_step_loop(engine))
        assert engine._table.num_following == 0
        outputs = engine.generate(PROMPTS, PARAMS, use_tqdm=False)
        table = engine._table
        assert table.num_following == 0 and not table.requests and not table.completions
    assert _summary(outputs) == expected
    reasons = {c.finish_reason for o in outputs for c in o.outputs}
    assert reasons == {"stop", "length"}
    lengths = [len(c.token_ids) for c in outputs[0].outputs]
    assert len(set(lengths)) > 1  # the siblings did end at different steps


def test_a_following_request_switches_bookkeeping_to_the_full_path(
    make_checkpoint: Callable[..., Path],
) -> None:
    """A stream opened among generate's requests gets every step's news; once it is gone
    the short path resumes."""
    checkpoint = make_checkpoint("tiny")
    with Engine(checkpoint, device="cpu", kv_block_size=4, max_model_len=32) as engine:
        stream = engine.stream([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
        assert engine._table.num_following == 1
        first = next(stream)
        assert len(first.outputs[0].token_ids) == 1
        outputs = engine.generate(PROMPTS, PARAMS, use_tqdm=False)
        deltas = [first, *stream]
        assert engine._table.num_following == 0
    assert sum(len(d.outputs[0].token_ids) for d in deltas if d.outputs) == 6
    assert all(o.finished for o in outputs)
