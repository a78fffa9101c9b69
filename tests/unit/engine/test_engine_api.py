"""The public Engine API: generate, step loop, streaming, stop rules, stats, lifecycle."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from pagedinfer import Engine, RequestOutput, SamplingParams
from pagedinfer.errors import EngineClosedError

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny", with_tokenizer=True)


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Iterator[Engine]:
    with Engine(checkpoint, device="cpu", kv_block_size=16, max_model_len=128) as engine:
        yield engine


def test_generate_text_prompts_in_input_order(engine: Engine) -> None:
    prompts = ["Hello, world!", "The quick brown fox", "paged attention", "a"]
    outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    # vLLM's ids: strings, the engine's counter in order.
    assert [o.request_id for o in outputs] == [str(i) for i in range(len(prompts))]
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.prompt_token_ids == engine.tokenizer.encode(prompt)
        assert len(output.outputs[0].token_ids) == 16 and output.finished
        assert output.outputs[0].text == engine.tokenizer.decode(
            output.outputs[0].token_ids, skip_special_tokens=True
        )
    # Order does not depend on which request finishes first.
    short_last = engine.generate(
        ["one", "two"],
        [SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True), GREEDY],
        use_tqdm=False,
    )
    assert [len(o.outputs[0].token_ids) for o in short_last] == [9, 16]


def test_single_prompt_forms(engine: Engine) -> None:
    (by_text,) = engine.generate("Hello", GREEDY, use_tqdm=False)
    (by_ids,) = engine.generate(by_text.prompt_token_ids, GREEDY, use_tqdm=False)
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids
    assert engine.generate([], GREEDY, use_tqdm=False) == []


def test_dtype_auto_is_float32_on_cpu(engine: Engine) -> None:
    assert engine.dtype == torch.float32
    assert engine.device.type == "cpu"
    assert engine.attention_backend == "torch"


def test_stop_token_ids_and_eos(engine: Engine, checkpoint: Path) -> None:
    (free,) = engine.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    stop_at = free.outputs[0].token_ids[4]
    first = free.outputs[0].token_ids.index(stop_at)
    params = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop_at])
    (stopped,) = engine.generate([[5, 6, 7]], params, use_tqdm=False)
    assert stopped.outputs[0].finish_reason == "stop"
    assert (
        stopped.outputs[0].token_ids == free.outputs[0].token_ids[: first + 1]
    )  # the stop token is kept


def test_eos_stops_unless_ignored(checkpoint: Path, tmp_path: Path) -> None:
    with Engine(checkpoint, device="cpu", kv_block_size=16, max_model_len=128) as engine:
        assert engine.model_config.eos_token_ids, "the tokenizer checkpoint declares an EOS"
        (free,) = engine.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    # Declare the 3rd generated token as EOS in a copy: the same greedy run must stop there.
    eos = free.outputs[0].token_ids[2]
    copy = tmp_path / "eos"
    shutil.copytree(checkpoint, copy)
    for name in ("config.json", "generation_config.json"):
        if (copy / name).exists():
            config = json.loads((copy / name).read_text())
            config["eos_token_id"] = eos
            (copy / name).write_text(json.dumps(config))
    with Engine(copy, device="cpu", kv_block_size=16, max_model_len=128) as engine:
        assert eos in engine.model_config.eos_token_ids
        (stopped,) = engine.generate(
            [[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False
        )
        assert stopped.outputs[0].finish_reason == "stop"
        assert (
            stopped.outputs[0].token_ids
            == free.outputs[0].token_ids[: free.outputs[0].token_ids.index(eos) + 1]
        )
        (ignored,) = engine.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
        assert ignored.outputs[0].token_ids == free.outputs[0].token_ids


def test_stop_strings_cut_the_text(engine: Engine) -> None:
    (free,) = engine.generate(["Once upon a time"], GREEDY, use_tqdm=False)
    assert len(free.outputs[0].text) > 8
    stop = free.outputs[0].text[4:7]
    cut = free.outputs[0].text.index(stop)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop])
    (stopped,) = engine.generate(["Once upon a time"], params, use_tqdm=False)
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].text == free.outputs[0].text[:cut]
    assert (
        stopped.outputs[0].token_ids
        == free.outputs[0].token_ids[: len(stopped.outputs[0].token_ids)]
    )
    assert len(stopped.outputs[0].token_ids) < len(free.outputs[0].token_ids)


def test_max_model_len_finishes_with_length(checkpoint: Path) -> None:
    with Engine(checkpoint, device="cpu", kv_block_size=16, max_model_len=20) as engine:
        (output,) = engine.generate([[1] * 15], SamplingParams(max_tokens=100), use_tqdm=False)
        assert output.outputs[0].finish_reason == "length"
        assert len(output.prompt_token_ids) + len(output.outputs[0].token_ids) == 20


def test_step_loop_and_abort(engine: Engine) -> None:
    keep = engine.add_request([1, 2, 3], GREEDY)
    drop = engine.add_request([4, 5, 6], GREEDY)
    outputs: list[RequestOutput] = engine.step()
    assert {o.request_id for o in outputs} == {keep, drop}
    assert all(not o.finished and len(o.outputs[0].token_ids) == 1 for o in outputs)
    assert engine.abort(drop)
    assert not engine.abort(drop)  # already gone
    assert not engine.abort(str(10**9))
    for unknown in ("", "x", f"0{keep}", f" {keep}", f"+{keep}", "1" * 400, "\u0663"):
        assert not engine.abort(unknown)  # no request has such a name
    with pytest.raises(TypeError, match="request ids are strings"):
        engine.abort(int(keep))  # type: ignore[arg-type]
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                assert output.request_id not in finished  # a final output comes once
                finished[output.request_id] = output
            else:
                assert output.request_id == keep
    assert len(finished[keep].outputs[0].token_ids) == 16
    # The abort's final output reaches step(), with the token generated before it.
    assert (
        finished[drop].outputs[0].finish_reason == "abort"
        and len(finished[drop].outputs[0].token_ids) == 1
    )
    assert engine.stats().kv_cache_usage == 0.0


def test_stream_yields_every_token(engine: Engine) -> None:
    (reference,) = engine.generate(["Hello, world!"], GREEDY, use_tqdm=False)
    deltas: list[RequestOutput] = list(engine.stream("Hello, world!", GREEDY))
    assert [t for d in deltas for t in d.outputs[0].token_ids] == reference.outputs[0].token_ids
    assert "".join(d.outputs[0].text for d in deltas) == reference.outputs[0].text
    assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "length"
    assert all(not d.finished for d in deltas[:-1])


def test_stream_closed_early_aborts(engine: Engine) -> None:
    stream = engine.stream([1, 2, 3], GREEDY)
    next(stream)
    stream.close()
    assert not engine.has_unfinished_requests()
    assert engine.stats().kv_cache_usage == 0.0


def test_requests_added_before_generate_are_not_lost(engine: Engine) -> None:
    earlier = engine.add_request([9, 9, 9], SamplingParams(temperature=0.0, max_tokens=40))
    engine.generate([[1, 2]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    collected: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests() or not collected:
        for output in engine.step():
            if output.finished:
                collected[output.request_id] = output
    assert len(collected[earlier].outputs[0].token_ids) == 40


def test_seeded_sampling_is_reproducible(engine: Engine) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234, ignore_eos=True)
    (alone,) = engine.generate([[3, 1, 4, 1, 5]], seeded, use_tqdm=False)
    batch = engine.generate(
        [[2, 7, 1], [3, 1, 4, 1, 5], [8, 2, 8]],
        [SamplingParams(temperature=1.0, max_tokens=12), seeded, SamplingParams(max_tokens=3)],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=99, ignore_eos=True)
    (other,) = engine.generate([[3, 1, 4, 1, 5]], other_seed, use_tqdm=False)
    assert other.outputs[0].token_ids != alone.outputs[0].token_ids


def test_stats_add_up(checkpoint: Path) -> None:
    with Engine(checkpoint, device="cpu", kv_block_size=16, max_model_len=128) as engine:
        prompts = [[1] * 40 + [i] for i in range(4)]
        engine.generate(prompts[:1], GREEDY, use_tqdm=False)  # caches the shared prefix
        engine.generate(prompts[1:], GREEDY, use_tqdm=False)
        stats = engine.stats()
        assert stats.num_requests_finished == 4
        assert stats.num_generated_tokens == 4 * 16
        assert stats.num_waiting == stats.num_running == 0
        assert stats.prefill_throughput > 0 and stats.decode_throughput > 0
        # The last three requests each found the shared prefix's two full blocks (32 of
        # their 41 prompt tokens); the first found nothing.
        assert stats.prefix_cache_hit_rate == 3 * 32 / (4 * 41)
        assert stats.kv_cache_usage == 0.0
        assert stats.num_kv_blocks == engine.scheduler.pool.num_blocks > 0


def test_close_and_context_manager(checkpoint: Path) -> None:
    engine = Engine(checkpoint, device="cpu", kv_block_size=16, max_model_len=64)
    with engine:
        engine.generate([[1, 2]], GREEDY, use_tqdm=False)
    with pytest.raises(EngineClosedError, match="the engine is closed; create a new Engine"):
        engine.generate([[1, 2]], GREEDY, use_tqdm=False)
    engine.close()  # idempotent


def test_progress_bar_reports_rates(
    checkpoint: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagedinfer.engine import progress

    monkeypatch.setattr(progress, "_stderr_is_terminal", lambda: True)  # drawn on a terminal
    with Engine(checkpoint, device="cpu", kv_block_size=16, max_model_len=64) as engine:
        engine.generate([[1, 2, 3], [4, 5]], GREEDY, use_tqdm=True)
    err = capsys.readouterr().err
    assert "prefill=" in err and "decode=" in err and "tok/s" in err
