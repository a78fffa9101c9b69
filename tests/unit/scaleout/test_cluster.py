"""pagedinfer.ray on a local Ray cluster started by the tests (``ray.init(num_cpus=2)``).

Replicas must produce exactly one Engine's greedy outputs, in input order; a replica killed
mid-run must cost no row and double none; a replica may be tensor-parallel; Parquet goes in
and out; and when the cluster is shut down no process it started may be left running.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray
import ray.data

from pagedinfer import Engine, RequestOutput, SamplingParams
from pagedinfer.ray import generate
from pagedinfer.ray.columns import chat_prompt_token_ids, completion_of

from .conftest import ENGINE_KWARGS

pytestmark = pytest.mark.ray

UNIT_TESTS = Path(__file__).resolve().parents[1]  # actors import scaleout.ray_helpers from it
GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
# Set in the environment of every process the cluster starts (and of their children), so the
# teardown can find them all, wherever they were reparented.
CLUSTER_MARKER = "PAGEDINFER_RAY_TEST_CLUSTER"
WORDS = ["paged", "attention", "stores", "keys", "and", "values", "in", "blocks", "like", "pages"]


def _prompts(count: int) -> list[str]:
    """Distinct prompts of 1 to 12 words (so prompts differ in length and content)."""
    return [" ".join(WORDS[i % 7 : i % 7 + 1 + i % 12]) + f" {i}" for i in range(count)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    assert not ray.is_initialized(), "another test left a Ray connection open"
    marker = uuid.uuid4().hex
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CLUSTER_MARKER, marker)
        patch.setenv(
            "PYTHONPATH", os.pathsep.join(filter(None, [str(UNIT_TESTS), os.getenv("PYTHONPATH")]))
        )
        ray.init(
            num_cpus=2,
            object_store_memory=200 * 1024**2,  # the data is tiny; share the machine politely
            include_dashboard=False,
            log_to_driver=False,
        )
    try:
        # The check below must see the cluster's processes, or it would prove nothing.
        assert _wait_until_gone(marker, timeout_s=0.0), "the cluster's processes lack the marker"
        yield
    finally:
        ray.shutdown()
        # Generous: raylet and workers take a while to exit on a loaded machine.
        leftover = _wait_until_gone(marker, timeout_s=90.0)
        assert not leftover, f"processes of the Ray cluster still running: {leftover}"


def _wait_until_gone(marker: str, timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        running = []
        for process in psutil.process_iter(["pid", "name", "status"]):
            if process.pid == os.getpid() or process.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            try:
                if process.environ().get(CLUSTER_MARKER) == marker:
                    running.append(f"{process.info['pid']} {process.info['name']}")
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.2)


@pytest.fixture(scope="module")
def reference(chat_checkpoint: Path) -> Iterator[Engine]:
    """One Engine in this process: what every replica must reproduce."""
    with Engine(chat_checkpoint, **ENGINE_KWARGS) as engine:
        yield engine


def _reference(engine: Engine, prompts: list[Any]) -> list[RequestOutput]:
    return engine.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)


def test_generate_equals_one_engine_in_input_order(
    cluster: None, chat_checkpoint: Path, reference: Engine
) -> None:
    prompts = _prompts(48)
    results = generate(
        prompts,
        chat_checkpoint,
        GREEDY,
        num_replicas=2,
        engine_kwargs=ENGINE_KWARGS,
        batch_size=6,
    )
    expected = _reference(reference, prompts)
    assert len(results) == len(prompts)
    for result, output in zip(results, expected, strict=True):
        text, token_ids, finish_reason = completion_of(output)
        assert result.generated_token_ids == token_ids
        assert result.generated_text == text
        assert result.finish_reason == finish_reason == "length"
        assert result.num_prompt_tokens == len(output.prompt_token_ids)
        assert 0 <= result.num_cached_tokens <= result.num_prompt_tokens


def test_killed_replica_is_retried_without_losing_or_doubling_rows(
    cluster: None, chat_checkpoint: Path, reference: Engine, tmp_path: Path
) -> None:
    from scaleout.ray_helpers import KillOncePredictor  # the module the actors import

    prompts = [reference.tokenizer.encode(text) for text in _prompts(40)]
    killed = tmp_path / "killed"
    dataset = ray.data.from_items(
        [{"id": index, "prompt": prompt} for index, prompt in enumerate(prompts)]
    ).map_batches(
        KillOncePredictor,
        fn_constructor_kwargs={
            "marker": str(killed),
            "model": str(chat_checkpoint),
            "sampling_params": GREEDY,
            "engine_kwargs": ENGINE_KWARGS,
        },
        concurrency=2,
        batch_size=4,
    )
    rows = dataset.take_all()
    assert killed.exists(), "no replica was killed: the test did not test anything"
    ids = sorted(int(row["id"]) for row in rows)
    assert ids == list(range(len(prompts))), "a row was lost or delivered twice"
    by_id = {int(row["id"]): row for row in rows}
    for index, output in enumerate(_reference(reference, prompts)):
        _, token_ids, finish_reason = completion_of(output)
        assert list(by_id[index]["generated_token_ids"]) == token_ids, index
        assert by_id[index]["finish_reason"] == finish_reason


def test_tensor_parallel_replica_from_parquet_to_parquet(
    cluster: None, chat_checkpoint: Path, reference: Engine, tmp_path: Path
) -> None:
    import pandas

    conversations = [
        [
            {"role": "system", "content": "Answer with random words."},
            {"role": "user", "content": " ".join(WORDS[: 1 + i])},
        ]
        for i in range(6)
    ]
    source, sink = tmp_path / "prompts", tmp_path / "generations"
    source.mkdir()
    frame = pandas.DataFrame({"id": range(len(conversations)), "messages": conversations})
    frame.to_parquet(source / "part-0.parquet")

    generations = generate(
        ray.data.read_parquet(str(source)),
        chat_checkpoint,
        GREEDY,
        num_replicas=1,
        engine_kwargs={**ENGINE_KWARGS, "tensor_parallel_size": 2},
    )
    generations.write_parquet(str(sink))

    written = pandas.read_parquet(sink).sort_values("id")
    assert list(written["id"]) == list(range(len(conversations)))
    rendered = [chat_prompt_token_ids(reference.tokenizer, c) for c in conversations]
    for (_, row), output in zip(written.iterrows(), _reference(reference, rendered), strict=True):
        text, token_ids, _ = completion_of(output)
        assert list(row["generated_token_ids"]) == token_ids
        assert row["generated_text"] == text
        assert row["num_prompt_tokens"] == len(output.prompt_token_ids)
