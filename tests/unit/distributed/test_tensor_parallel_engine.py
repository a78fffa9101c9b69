"""``Engine(tensor_parallel_size=2)`` on the CPU (gloo): parity, isolation, failure, cleanup.

Every TP engine spawns a worker process that imports torch, so engines are few: one GQA and
one MHA engine shared by the module, three short-lived ones for the failure and shutdown
tests, and one in a second process. Run them alone with ``pytest -m tensor_parallel``.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hf_reference import hf_greedy
from pagedinfer import Engine, SamplingParams
from pagedinfer.adapters.distributed import channel as channel_module
from pagedinfer.adapters.distributed import executor as executor_module
from pagedinfer.errors import ConfigurationError, EngineClosedError, WorkerDiedError

from .tp_helpers import (
    SHM,
    child_pids,
    existing_shm,
    is_running,
    shared_prefix_prompts,
    tracked_shm_names,
)

pytestmark = [pytest.mark.tensor_parallel, pytest.mark.slow]

MAX_TOKENS = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Small enough that the workload chunks its prompts (up to 82 tokens > 48 per step), shares
# cached prefix blocks and preempts (6 prompts need more than 12 blocks of 16 tokens).
SETTINGS: dict[str, Any] = {
    "device": "cpu",
    "kv_block_size": 16,
    "max_model_len": 128,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 48,
    "num_kv_blocks": 12,
    "enable_prefix_caching": True,
}
MHA = {"num_key_value_heads": 4, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def gqa_checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny")  # 4 query heads, 2 KV heads, tied embeddings


@pytest.fixture(scope="module")
def mha_checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny", **MHA)


# The gqa engine's control-channel segment when it started: {"gqa": (name, size)}.
CHANNEL_AT_START: dict[str, tuple[str, int]] = {}


@pytest.fixture(scope="module")
def gqa_engine(gqa_checkpoint: Path) -> Iterator[Engine]:
    """TP=2 with the smallest control channel: nearly every step's message must grow it."""
    with pytest.MonkeyPatch.context() as patch, tracked_shm_names() as names:
        patch.setattr(executor_module, "DEFAULT_CHANNEL_BYTES", channel_module.MIN_CAPACITY)
        engine = Engine(gqa_checkpoint, tensor_parallel_size=2, **SETTINGS)
    created = [name for name in names if name.startswith("pagedinfer-")]
    if len(created) == 1:
        CHANNEL_AT_START["gqa"] = (created[0], (SHM / created[0]).stat().st_size)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def mha_engine(mha_checkpoint: Path) -> Iterator[Engine]:
    engine = Engine(mha_checkpoint, tensor_parallel_size=2, **SETTINGS)
    yield engine
    engine.close()


def tokens(outputs: list[Any]) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


def single_rank_tokens(
    checkpoint: Path, prompts: list[list[int]], params: SamplingParams = GREEDY
) -> list[list[int]]:
    """The same workload on a TP=1 engine (checked against transformers by test_parity.py)."""
    with Engine(checkpoint, tensor_parallel_size=1, **SETTINGS) as engine:
        return tokens(engine.generate(prompts, params, use_tqdm=False))


def new_worker_pids(before: set[int]) -> list[int]:
    return sorted({child.pid for child in multiprocessing.active_children()} - before)


def active_pids() -> set[int]:
    return {child.pid for child in multiprocessing.active_children() if child.pid is not None}


def wait_until(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


# --------------------------------------------------------------------------- parity
def test_sampling_features_match_one_rank(gqa_engine: Engine, gqa_checkpoint: Path) -> None:
    """Only rank 0 samples, but every rank runs the LM head for prompt logprobs, and block
    copies for forks run on every rank's KV shard."""
    prompts = shared_prefix_prompts(seed=12, count=2)
    params = SamplingParams(
        n=2,
        seed=3,
        max_tokens=8,
        logprobs=2,
        prompt_logprobs=1,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        ignore_eos=True,
    )
    outputs = gqa_engine.generate(prompts, params, use_tqdm=False)
    with Engine(gqa_checkpoint, tensor_parallel_size=1, **SETTINGS) as single:
        expected = single.generate(prompts, params, use_tqdm=False)
    for got, want in zip(outputs, expected, strict=True):
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
        assert got.prompt_logprobs is not None and want.prompt_logprobs is not None
        for mine, theirs in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
            assert mine is not None and theirs is not None and mine.keys() == theirs.keys()
            for token_id, logprob in mine.items():
                assert logprob.logprob == pytest.approx(theirs[token_id].logprob, abs=1e-4)
        for mine_c, theirs_c in zip(got.outputs, want.outputs, strict=True):
            assert mine_c.cumulative_logprob == pytest.approx(theirs_c.cumulative_logprob, abs=1e-3)


@pytest.mark.parametrize("shape", ["gqa", "mha"])
def test_greedy_tokens_match_one_rank_and_transformers(
    shape: str, request: pytest.FixtureRequest
) -> None:
    engine: Engine = request.getfixturevalue(f"{shape}_engine")
    checkpoint: Path = request.getfixturevalue(f"{shape}_checkpoint")
    prompts = shared_prefix_prompts(seed=11, count=6)
    assert max(len(prompt) for prompt in prompts) > SETTINGS["max_num_batched_tokens"]

    preemptions_before = engine.stats().num_preemptions
    outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
    expected = single_rank_tokens(checkpoint, prompts)

    assert tokens(outputs) == expected
    # transformers is slow here (~1.5 s a prompt); three prompts pin the reference.
    assert expected[:3] == [hf_greedy(checkpoint, prompt, MAX_TOKENS) for prompt in prompts[:3]]
    # The features were really in play: prefix-cache hits and preemption under TP.
    assert any(output.num_cached_tokens >= 16 for output in outputs)
    assert engine.stats().num_preemptions > preemptions_before


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm on this system")
def test_messages_larger_than_the_channel_grow_it(gqa_engine: Engine, gqa_checkpoint: Path) -> None:
    name, size = CHANNEL_AT_START["gqa"]
    assert size == channel_module.MIN_CAPACITY  # a prefill plan of 40+ tokens does not fit
    prompt = shared_prefix_prompts(seed=5, count=1)[0]
    (output,) = gqa_engine.generate([prompt], GREEDY, use_tqdm=False)
    assert output.outputs[0].token_ids == hf_greedy(gqa_checkpoint, prompt, MAX_TOKENS)
    assert not (SHM / name).exists(), "the outgrown segment was not unlinked"


# ----------------------------------------------------------------- configuration
@pytest.mark.parametrize(
    ("world_size", "dimension"), [(3, "num_attention_heads"), (4, "num_key_value_heads")]
)
def test_heads_not_divisible_by_the_tp_size_are_refused_before_spawning(
    gqa_checkpoint: Path, world_size: int, dimension: str
) -> None:
    before = active_pids()
    with pytest.raises(ConfigurationError, match=rf"{dimension}=\d+ is not divisible"):
        Engine(gqa_checkpoint, tensor_parallel_size=world_size, **SETTINGS)
    assert active_pids() == before
    assert issubclass(ConfigurationError, ValueError)


def test_an_error_found_after_the_workers_started_still_stops_them(gqa_checkpoint: Path) -> None:
    children_before = child_pids()
    too_small = {**SETTINGS, "num_kv_blocks": 4}  # 64 tokens < max_model_len = 128
    with tracked_shm_names() as created, pytest.raises(ConfigurationError, match="max_model_len"):
        Engine(gqa_checkpoint, tensor_parallel_size=2, **too_small)
    assert child_pids() <= children_before
    assert created, "the workers were not started"
    assert not existing_shm(created)


# ------------------------------------------------------------------- isolation
def test_two_engines_in_one_process_run_at_the_same_time(
    gqa_engine: Engine, mha_engine: Engine, gqa_checkpoint: Path, mha_checkpoint: Path
) -> None:
    jobs = {
        "gqa": (gqa_engine, gqa_checkpoint, shared_prefix_prompts(seed=21, count=5)),
        "mha": (mha_engine, mha_checkpoint, shared_prefix_prompts(seed=22, count=5)),
    }
    results: dict[str, list[list[int]]] = {}
    errors: list[BaseException] = []

    def run(name: str) -> None:
        engine, _, prompts = jobs[name]
        try:
            results[name] = tokens(engine.generate(prompts, GREEDY, use_tqdm=False))
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(name,)) for name in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    for name, (_, checkpoint, prompts) in jobs.items():
        assert results[name] == single_rank_tokens(checkpoint, prompts)


def test_an_engine_in_another_process_on_the_same_host(
    gqa_engine: Engine, gqa_checkpoint: Path
) -> None:
    """Both engines work side by side; killing the other process's rank 0 ends its worker
    and its shared memory too."""
    prompts = shared_prefix_prompts(seed=31, count=2)
    short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = single_rank_tokens(gqa_checkpoint, prompts, short)
    script = Path(__file__).with_name("tp_subprocess.py")
    other = subprocess.Popen(
        [sys.executable, str(script), str(gqa_checkpoint), json.dumps(prompts), "8"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert other.stdin is not None and other.stdout is not None
        first = json.loads(other.stdout.readline())
        assert first["tokens"] == expected
        # This process's engine runs while the other one is up, and vice versa.
        assert tokens(gqa_engine.generate(prompts, short, use_tqdm=False)) == expected
        other.stdin.write("again\n")
        other.stdin.flush()
        assert json.loads(other.stdout.readline())["tokens"] == expected

        (worker_pid,) = first["worker_pids"]
        (segment,) = first["segments"]
        assert (SHM / segment).exists()
        other.send_signal(signal.SIGKILL)
        other.wait(10)
        assert wait_until(lambda: not is_running(worker_pid), 15), "orphaned worker lives on"
        assert wait_until(lambda: not (SHM / segment).exists(), 15)
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()


# --------------------------------------------------------------------- failure
def test_a_killed_worker_makes_the_next_call_raise_quickly(gqa_checkpoint: Path) -> None:
    with tracked_shm_names() as created:
        _a_killed_worker_makes_the_next_call_raise_quickly(gqa_checkpoint, created)


def _a_killed_worker_makes_the_next_call_raise_quickly(
    gqa_checkpoint: Path, created: set[str]
) -> None:
    children_before, active_before = child_pids(), active_pids()
    engine = Engine(gqa_checkpoint, tensor_parallel_size=2, **SETTINGS)
    prompts = shared_prefix_prompts(seed=41, count=2)
    assert len(engine.generate(prompts, GREEDY, use_tqdm=False)) == 2
    (worker,) = new_worker_pids(active_before)

    os.kill(worker, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"rank 1 .* killed by signal SIGKILL"):
        engine.generate(prompts, GREEDY, use_tqdm=False)
    assert time.monotonic() - started < 10
    # And it stays failed, without waiting.
    with pytest.raises(WorkerDiedError, match=r"rank 1 .* killed by signal SIGKILL"):
        engine.generate(prompts, GREEDY, use_tqdm=False)

    engine.close()
    assert child_pids() <= children_before
    assert not existing_shm(created)


# -------------------------------------------------------------------- shutdown
def test_close_stops_the_worker_and_frees_the_shared_memory(gqa_checkpoint: Path) -> None:
    children_before, active_before = child_pids(), active_pids()
    with tracked_shm_names() as created:
        engine = Engine(gqa_checkpoint, tensor_parallel_size=2, **SETTINGS)
        (worker,) = new_worker_pids(active_before)
        assert existing_shm(created), "the engine made no shared-memory segment"
        engine.generate(shared_prefix_prompts(seed=51, count=1), GREEDY, use_tqdm=False)

    engine.close()
    assert not is_running(worker)
    assert child_pids() <= children_before
    assert not existing_shm(created)
    engine.close()  # idempotent
    with pytest.raises(EngineClosedError, match="engine is closed"):
        engine.generate([[1, 2, 3]], GREEDY, use_tqdm=False)


def test_garbage_collection_stops_the_worker_and_frees_the_shared_memory(
    gqa_checkpoint: Path,
) -> None:
    children_before, active_before = child_pids(), active_pids()
    with tracked_shm_names() as created:
        engine = Engine(gqa_checkpoint, tensor_parallel_size=2, **SETTINGS)
        (worker,) = new_worker_pids(active_before)
        engine.generate(shared_prefix_prompts(seed=61, count=1), GREEDY, use_tqdm=False)

    del engine
    gc.collect()
    assert not is_running(worker)
    assert child_pids() <= children_before
    assert created and not existing_shm(created)
