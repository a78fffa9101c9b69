"""Heterogeneous batches through the real Engine on tiny *hybrid-attention* models (CPU).

The mixed-batch fuzz of ``test_mixed_batches.py`` on models with KV groups (issue 42): a
Gemma 3 (two sliding layers to one full, window 6), a GPT-OSS (a sliding and a full layer,
sinks, MoE) and a Mistral whose every layer slides (one sliding group), with 4-token blocks so
that prompts of up to 24 tokens and their completions span several windows. Hypothesis draws
a batch mixing every ``SamplingParams`` field (``mixed.py``: greedy and seeded sampling,
logprobs, prompt logprobs, ``n > 1`` forks, stop strings and ids, ``max_tokens``) and the
engine settings that cut it into steps: chunked prefill (a small token budget), preemption
(a pool barely above the least the groups accept), prefix caching (prompts sharing a prefix
several windows long), async scheduling, ngram and draft-model speculation. Checks, as for
plain models: a greedy or seeded completion equals its run alone on an engine nothing else
uses (16-token blocks, no preemption, no chunks), every completion keeps its constraints, the
engine ends idle; and for the groups: every block back in the pool but the null block,
``stats().kv_groups`` all zero and consistent with the scheduler's groups.

Size: ``PAGEDINFER_PROPERTY_PROFILE`` (``ci`` by default).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from pagedinfer import Engine
from pagedinfer.domain.kv_groups import min_blocks_for_one_sequence

from .mixed import Checker, Reference, assert_blocks_all_free, describe_vocab
from .profiles import sized
from .test_engine_machine import ENGINE_OPTIONS, Setup, machine_for
from .test_mixed_batches import Engines, batches, step_budget

MAX_MODEL_LEN = 32
BLOCK_SIZE = 4
WINDOW = 6
TINY = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "head_dim": 16}
HYBRID_SHAPES: dict[str, dict[str, Any]] = {
    "gemma3": {
        "architecture": "Gemma3ForCausalLM",
        "num_hidden_layers": 3,
        "layer_types": ("sliding_attention", "sliding_attention", "full_attention"),
        "sliding_window": WINDOW,
        "query_pre_attn_scalar": 24,
        "final_logit_softcapping": 5.0,
        "tie_word_embeddings": False,
        **TINY,
    },
    "gpt-oss": {
        "architecture": "GptOssForCausalLM",
        "layer_types": ("sliding_attention", "full_attention"),
        "sliding_window": WINDOW,
        "attention_bias": True,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": False,
        **{**TINY, "intermediate_size": 32},
    },
    "mistral-window": {"architecture": "MistralForCausalLM", "sliding_window": WINDOW, **TINY},
}
SETTINGS = sized(
    {"ci": {"max_examples": 10}, "quick": {"max_examples": 4}, "thorough": {"max_examples": 400}}
)


@st.composite
def hybrid_knobs(draw: st.DrawFn, engines: Engines) -> dict[str, Any]:
    """Engine settings that change batching; the pool barely above the least the model's
    groups accept (preemption) or roomy."""
    budget = draw(st.sampled_from([8, 16, 512]))
    groups = engines.reference.engine.scheduler.config.kv_groups
    least = min_blocks_for_one_sequence(groups, BLOCK_SIZE, MAX_MODEL_LEN, budget)
    return {
        "max_num_batched_tokens": budget,
        "num_kv_blocks": draw(st.sampled_from([least, least + 4, 8 * least])),
        "enable_prefix_caching": draw(st.booleans()),
        "max_num_seqs": draw(st.sampled_from([3, 16])),
        # Speculation refuses async scheduling (a clear ConfigurationError): one or the other.
        "speculation": (speculation := draw(st.sampled_from(["off", "off", "ngram", "draft"]))),
        "async_scheduling": speculation == "off" and draw(st.booleans()),
    }


@pytest.fixture(scope="module", params=sorted(HYBRID_SHAPES))
def hybrid_engines(
    request: pytest.FixtureRequest, make_checkpoint: Callable[..., Path]
) -> Iterator[Engines]:
    checkpoint = make_checkpoint("tiny", with_tokenizer=True, **HYBRID_SHAPES[request.param])
    reference = Engine(
        checkpoint, device="cpu", kv_block_size=16, max_model_len=64, attention_backend="torch"
    )
    engines = Engines(
        checkpoint,
        reference,
        attention_backend="torch",
        kv_block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
    )
    yield engines
    engines.close()


def run_hybrid_batch(engine: Engine, checker: Checker, batch: list[Any]) -> None:
    before = engine.scheduler.stats()
    with step_budget(engine, batch):
        outputs = engine.generate([p for p, _ in batch], [q for _, q in batch], use_tqdm=False)
    after = engine.scheduler.stats()
    event(f"preempted: {after.num_preemptions > before.num_preemptions}")
    event(f"prefix-cache hit: {any(o.num_cached_tokens for o in outputs)}")
    for (prompt, params), output in zip(batch, outputs, strict=True):
        checker.check_final(output, prompt, params)
    assert not engine.has_unfinished_requests()
    assert_blocks_all_free(engine)


@SETTINGS
@given(data=st.data())
def test_mixed_batch_on_hybrid_models(hybrid_engines: Engines, data: st.DataObject) -> None:
    settings = data.draw(hybrid_knobs(hybrid_engines), label="engine settings")
    engine, checker = hybrid_engines.get(settings)
    batch = data.draw(batches(hybrid_engines.vocab, max_size=6), label="batch")
    run_hybrid_batch(engine, checker, batch)


MACHINE_SETTINGS = sized(
    {
        "ci": {"max_examples": 4, "stateful_step_count": 15},
        "quick": {"max_examples": 3, "stateful_step_count": 10},
        "thorough": {"max_examples": 300, "stateful_step_count": 50},
    }
)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_engine_state_machine_on_gemma3(
    make_checkpoint: Callable[..., Path], async_scheduling: bool
) -> None:
    """The engine machine (streams, aborts mid-flight, ``generate``, prefix-cache resets) on
    the tiny Gemma 3: a pool two blocks above the least its three groups accept, chunks of 16
    tokens."""
    checkpoint = make_checkpoint("tiny", with_tokenizer=True, **HYBRID_SHAPES["gemma3"])
    with Engine(
        checkpoint, device="cpu", kv_block_size=16, max_model_len=64, attention_backend="torch"
    ) as fresh:
        groups = fresh.scheduler.config.kv_groups
        options = {
            **ENGINE_OPTIONS,
            "attention_backend": "torch",
            "num_kv_blocks": min_blocks_for_one_sequence(
                groups, BLOCK_SIZE, ENGINE_OPTIONS["max_model_len"], 16
            )
            + 2,
            "async_scheduling": async_scheduling,
        }
        setup = Setup(checkpoint, Reference(fresh), describe_vocab(fresh), options=options)
        try:
            run_state_machine_as_test(machine_for(setup), settings=MACHINE_SETTINGS)
        finally:
            if setup.engine is not None:
                setup.engine.close()
