"""Differential fuzzing of batches that mix structured-output rows with plain rows.

Hypothesis draws plain requests (every ``SamplingParams`` field, ``mixed.py``) and constrained
ones: valid constraints (a regex, a choice), hostile ones that blow up the grammar engine at
their first token (the engine runs without the submission probe, ``probe_tokens=0``, so they
fail at run time), and unsatisfiable ones (refused at submission, before the batch). The batch
runs together under settings that cut it into many steps (chunked prefill, preemption, ``n >
1``, async scheduling on or off). Every plain request must equal its solo run and keep every
constraint (``Checker``); a valid constrained completion matches its constraint; a hostile
one ends with ``"error"`` and a reason; the engine is idle, whole and alive after.

Size: ``PAGEDINFER_PROPERTY_PROFILE`` (``ci`` by default).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from pagedinfer import Engine, GrammarLimits, SamplingParams, StructuredOutputsParams
from pagedinfer.errors import InvalidStructuredOutputError

from .mixed import MAX_N, Checker, Reference, Vocab, describe_vocab, prompts, sampling_params
from .profiles import sized

pytest.importorskip("llguidance")

MAX_MODEL_LEN = 48
REGEX = r"[0-9]{2,4}"
CHOICES = ("yes", "no", "maybe")
VALID = {
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=list(CHOICES)),
}
HOSTILE = (
    StructuredOutputsParams(regex="a{1000000}"),
    StructuredOutputsParams(grammar="start: /c{1000000}/"),
)
UNSATISFIABLE = (
    StructuredOutputsParams(regex=r"[^\s\S]"),
    StructuredOutputsParams(json={"$ref": "#"}),
)
KNOBS = st.fixed_dictionaries(
    {
        "max_num_batched_tokens": st.sampled_from([8, 16, 512]),
        "num_kv_blocks": st.sampled_from([12, 64]),
        "async_scheduling": st.booleans(),
    }
)
SETTINGS = sized(
    {"ci": {"max_examples": 25}, "quick": {"max_examples": 5}, "thorough": {"max_examples": 800}}
)


class Engines:
    def __init__(self, checkpoint: Path) -> None:
        self.checkpoint = checkpoint
        reference = Engine(checkpoint, device="cpu", kv_block_size=16, max_model_len=64)
        self.reference = Reference(reference)
        self.vocab: Vocab = describe_vocab(reference)
        self._built: dict[tuple[Any, ...], tuple[Engine, Checker]] = {}

    def get(self, knobs: dict[str, Any]) -> tuple[Engine, Checker]:
        key = tuple(sorted(knobs.items()))
        if key not in self._built:
            engine = Engine(
                self.checkpoint,
                device="cpu",
                attention_backend="torch",
                kv_block_size=4,
                max_model_len=MAX_MODEL_LEN,
                max_num_seqs=16,
                grammar_limits=GrammarLimits(probe_tokens=0),
                **knobs,
            )
            self._built[key] = (engine, Checker(engine, self.reference))
        return self._built[key]

    def close(self) -> None:
        for engine, _ in self._built.values():
            engine.close()
        self.reference.engine.close()


@pytest.fixture(scope="module")
def engines(make_checkpoint: Callable[..., Path]) -> Iterator[Engines]:
    built = Engines(make_checkpoint("tiny", with_tokenizer=True))
    yield built
    built.close()


@st.composite
def constrained(draw: st.DrawFn) -> tuple[str, SamplingParams]:
    kind = draw(st.sampled_from(["regex", "choice", "hostile"]))
    constraint = draw(st.sampled_from(HOSTILE)) if kind == "hostile" else VALID[kind]
    greedy = draw(st.booleans())
    params = SamplingParams(
        structured_outputs=constraint,
        n=draw(st.integers(1, 2)),
        max_tokens=draw(st.integers(2, 8)),
        temperature=0.0 if greedy else 0.8,
        seed=draw(st.none() | st.integers(0, 2**16)),
    )
    return kind, params


@SETTINGS
@given(data=st.data())
def test_constrained_rows_never_disturb_plain_rows(engines: Engines, data: st.DataObject) -> None:
    engine, checker = engines.get(data.draw(KNOBS, label="engine settings"))
    vocab = engines.vocab
    plain = data.draw(
        st.lists(
            st.tuples(prompts(vocab, (0, 3, 8, 12)), sampling_params(vocab, max_n=MAX_N)),
            min_size=1,
            max_size=4,
        ),
        label="plain",
    )
    rows = data.draw(
        st.lists(st.tuples(prompts(vocab, (0, 3, 8)), constrained()), min_size=1, max_size=3),
        label="constrained",
    )
    refused = data.draw(st.sampled_from(UNSATISFIABLE), label="unsatisfiable")
    with pytest.raises(InvalidStructuredOutputError, match="accepts no string"):
        engine.check_sampling_params(SamplingParams(structured_outputs=refused))
    order = data.draw(st.permutations(range(len(plain) + len(rows))), label="order")
    batch: list[tuple[list[int], SamplingParams, str]] = [
        (prompt, params, "plain") for prompt, params in plain
    ] + [(prompt, params, kind) for prompt, (kind, params) in rows]
    batch = [batch[i] for i in order]
    outputs = engine.generate([p for p, _, _ in batch], [s for _, s, _ in batch], use_tqdm=False)
    for (prompt, params, kind), output in zip(batch, outputs, strict=True):
        event(f"row: {kind}")
        if kind == "plain":
            checker.check_final(output, prompt, params)
            continue
        assert len(output.outputs) == params.n
        for completion in output.outputs:
            if kind == "hostile":
                assert completion.finish_reason == "error", completion
                assert completion.error and "constraint" in completion.error
            elif completion.finish_reason == "stop":
                assert completion.error is None
                if kind == "regex":
                    assert re.fullmatch(REGEX, completion.text), completion
                else:
                    assert completion.text in CHOICES, completion
            else:  # cut by max_tokens: a prefix of a valid output
                assert completion.finish_reason == "length", completion
    assert not engine.is_dead
    assert not engine.has_unfinished_requests()
    pool = engine.scheduler.pool
    pool.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks, "KV blocks leaked"
