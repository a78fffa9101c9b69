"""``Engine.update_weights`` / ``update_weights_from_path`` / ``collective_rpc`` in one
process (issue 40): an updated engine generates what a fresh engine on the new checkpoint
generates, token for token; a refused update leaves every weight as it was; the prefix cache
is not reused across an update; unfinished requests refuse it."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedinfer import LLM, AsyncEngine, Engine, SamplingParams
from pagedinfer.errors import ConfigurationError, RequestsInFlightError, WeightUpdateError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SETTINGS: dict[str, Any] = {
    "device": "cpu",
    "dtype": "float32",
    "kv_block_size": 16,
    "max_model_len": 96,
    "num_kv_blocks": 24,
    "num_threads": 1,
}
# The second prompt is three full blocks, so a repeat of it hits the prefix cache.
PROMPTS = [[5, 17, 300, 41, 9], [(7 * i) % 500 + 1 for i in range(48)]]


def _tokens(engine: Engine, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]


def _tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / "model.safetensors"))


def with_random_norms(source: Path, target: Path) -> Path:
    """``source`` with random norm weights (a random checkpoint's are all ones, so a norm
    the engine failed to update would go unnoticed)."""
    target.mkdir()
    shutil.copy(source / "config.json", target / "config.json")
    tensors = _tensors(source)
    generator = torch.Generator().manual_seed(40)
    for name, tensor in tensors.items():
        if name.endswith("norm.weight"):
            noise = torch.rand(tensor.shape, generator=generator) + 0.5
            tensors[name] = (tensor.float() * noise).to(tensor.dtype)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


@pytest.fixture(scope="module")
def checkpoints(
    make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    new = with_random_norms(make_checkpoint("tiny", seed=1), tmp_path_factory.mktemp("n") / "b")
    return make_checkpoint("tiny", seed=0), new


@pytest.fixture(scope="module")
def expected(checkpoints: tuple[Path, Path]) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens of fresh engines on the two checkpoints."""
    results = []
    for checkpoint in checkpoints:
        with Engine(checkpoint, **SETTINGS) as engine:
            results.append(_tokens(engine))
    assert results[0] != results[1], "the two random checkpoints must generate differently"
    return results[0], results[1]


@pytest.fixture
def engine(checkpoints: tuple[Path, Path]) -> Iterator[Engine]:
    with Engine(checkpoints[0], **SETTINGS) as engine:
        yield engine


def _param(engine: Engine, name: str) -> torch.Tensor:
    (value,) = engine.collective_rpc(lambda runner: runner.model.get_parameter(name).clone())
    tensor: torch.Tensor = value
    return tensor


def test_update_equals_a_fresh_engine_on_the_new_checkpoint_and_back_from_path(
    engine: Engine,
    checkpoints: tuple[Path, Path],
    expected: tuple[list[list[int]], list[list[int]]],
) -> None:
    old, new = expected
    assert _tokens(engine) == old
    engine.update_weights(_tensors(checkpoints[1]))  # a mapping, bfloat16 into float32
    assert _tokens(engine) == new
    engine.update_weights_from_path(checkpoints[0])
    assert _tokens(engine) == old
    # (name, tensor) pairs from a generator, in the engine's dtype, work the same.
    engine.update_weights((name, t.float()) for name, t in _tensors(checkpoints[1]).items())
    assert _tokens(engine) == new


def test_a_subset_fills_its_packed_shards_only(
    engine: Engine, checkpoints: tuple[Path, Path]
) -> None:
    new = _tensors(checkpoints[1])
    before = _param(engine, "model.layers.0.self_attn.qkv_proj.weight")
    q_rows = new["model.layers.0.self_attn.q_proj.weight"].shape[0]
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    engine.update_weights([(q_proj, new[q_proj])])
    after = _param(engine, "model.layers.0.self_attn.qkv_proj.weight")
    assert torch.equal(after[:q_rows], new["model.layers.0.self_attn.q_proj.weight"].float())
    assert torch.equal(after[q_rows:], before[q_rows:])  # k and v untouched
    # Tied embeddings: the LM head is the embedding, and a tied lm_head.weight is ignored.
    engine.update_weights(
        {
            "model.embed_tokens.weight": new["model.embed_tokens.weight"],
            "lm_head.weight": torch.zeros_like(new["model.embed_tokens.weight"]),
        }
    )
    assert torch.equal(_param(engine, "lm_head.weight"), new["model.embed_tokens.weight"].float())


NORM, DOWN = "model.norm.weight", "model.layers.1.mlp.down_proj.weight"
# case -> (the tensor's name, its bad value made from the good tensors, the message).
BAD_UPDATES: dict[str, tuple[str, Callable[[dict[str, torch.Tensor]], Any], str]] = {
    "unknown name": ("model.layers.9.mlp.up_proj.weight", lambda t: t[NORM], "matches no param"),
    "wrong shape": (NORM, lambda t: torch.ones(7), "shape \\[7\\] does not match"),
    "wrong dtype": (DOWN, lambda t: t[DOWN].int(), "dtype I32 is not a floating-point type"),
    "twice": (NORM, lambda t: t[NORM], "given twice"),
    "NaN in a norm": (NORM, lambda t: torch.full_like(t[NORM], torch.nan), "NaN"),
    "not a pair": (NORM, lambda t: None, "expected \\(name, torch.Tensor\\) pairs"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_UPDATES))
def test_a_refused_update_writes_nothing(
    case: str,
    engine: Engine,
    checkpoints: tuple[Path, Path],
    expected: tuple[list[list[int]], list[list[int]]],
) -> None:
    name, bad, message = BAD_UPDATES[case]
    tensors = _tensors(checkpoints[1])
    # Every good tensor of the new checkpoint first, the bad one last.
    pairs: list[Any] = [(n, t) for n, t in tensors.items() if n != name or case == "twice"]
    pairs.append(name if case == "not a pair" else (name, bad(tensors)))
    with pytest.raises(WeightUpdateError, match=message):
        engine.update_weights(pairs)
    assert _tokens(engine) == expected[0]


def test_the_prefix_cache_is_not_reused_after_an_update(
    engine: Engine,
    checkpoints: tuple[Path, Path],
    expected: tuple[list[list[int]], list[list[int]]],
) -> None:
    long_prompt = [PROMPTS[1]]
    _tokens(engine, long_prompt)
    (again,) = engine.generate(long_prompt, GREEDY, use_tqdm=False)
    assert again.num_cached_tokens >= 32  # cached before the update
    engine.update_weights(_tensors(checkpoints[1]))
    (after,) = engine.generate(long_prompt, GREEDY, use_tqdm=False)
    assert after.num_cached_tokens == 0
    assert after.outputs[0].token_ids == expected[1][1]


def test_unfinished_requests_refuse_an_update(
    engine: Engine,
    checkpoints: tuple[Path, Path],
    expected: tuple[list[list[int]], list[list[int]]],
) -> None:
    request = engine.add_request(PROMPTS[0], GREEDY)
    engine.step()
    with pytest.raises(RequestsInFlightError, match="1 unfinished request"):
        engine.update_weights(_tensors(checkpoints[1]))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (final,) = [output for output in outputs if output.request_id == request and output.finished]
    assert final.outputs[0].token_ids == expected[0][0]  # finished on the old weights
    engine.update_weights(_tensors(checkpoints[1]))
    assert _tokens(engine) == expected[1]


def _rank_and_scaled(runner: Any, factor: int, *, offset: int = 0) -> tuple[int, int]:
    return runner.parallel.rank, factor * 2 + offset


def test_collective_rpc_runs_on_the_worker(engine: Engine) -> None:
    assert engine.collective_rpc(_rank_and_scaled, args=(3,), kwargs={"offset": 1}) == [(0, 7)]
    assert engine.collective_rpc("collective_rpc", args=(_rank_and_scaled, None, (2,))) == [
        [(0, 4)]
    ]
    with pytest.raises(ConfigurationError, match="has no method 'no_such_method'"):
        engine.collective_rpc("no_such_method")


def test_update_weights_from_path_refuses_a_checkpoint_that_does_not_fit(
    engine: Engine,
    make_checkpoint: Callable[..., Path],
    expected: tuple[list[list[int]], list[list[int]]],
) -> None:
    other = make_checkpoint("tiny", seed=1, intermediate_size=64)
    with pytest.raises(WeightUpdateError, match="does not match the shape"):
        engine.update_weights_from_path(other)
    assert _tokens(engine) == expected[0]


def test_a_quantized_layer_is_refused(checkpoints: tuple[Path, Path], tmp_path: Path) -> None:
    from pagedinfer.adapters.models.quantized_checkpoint import write_quantized_checkpoint

    fp8 = write_quantized_checkpoint(checkpoints[0], tmp_path / "fp8", "fp8", block=(32, 32))
    with Engine(fp8, **SETTINGS) as engine:
        before = _tokens(engine)
        quantized = _tensors(fp8)
        with pytest.raises(WeightUpdateError, match="quantized layer"):
            engine.update_weights(quantized)
        with pytest.raises(WeightUpdateError, match="quantized layer"):
            engine.update_weights_from_path(fp8)
        norm = "model.norm.weight"  # an unquantized tensor of the same checkpoint is fine
        engine.update_weights({norm: quantized[norm]})
        assert _tokens(engine) == before


def test_async_engine_updates_weights_and_runs_collective_rpc(
    checkpoints: tuple[Path, Path], expected: tuple[list[list[int]], list[list[int]]]
) -> None:
    async def main() -> list[list[int]]:
        async with AsyncEngine(checkpoints[0], **SETTINGS) as engine:
            await engine.update_weights(_tensors(checkpoints[1]))
            assert await engine.collective_rpc(_rank_and_scaled, args=(1,)) == [(0, 2)]
            tokens = []
            for prompt in PROMPTS:
                outputs = [output async for output in engine.generate(prompt, GREEDY)]
                tokens.append(outputs[-1].outputs[0].token_ids)
            return tokens

    assert asyncio.run(main()) == expected[1]


def test_llm_takes_weight_updates_as_vllm_does(
    checkpoints: tuple[Path, Path], expected: tuple[list[list[int]], list[list[int]]]
) -> None:
    with LLM(model=str(checkpoints[0]), **SETTINGS) as llm:
        llm.update_weights(_tensors(checkpoints[1]).items())
        assert llm.collective_rpc("collective_rpc", args=(_rank_and_scaled, None, (0,))) == [
            [(0, 0)]
        ]
        llm.reset_prefix_cache()
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert [output.outputs[0].token_ids for output in outputs] == expected[1]


def test_asleep_weights_refuse_an_update_until_woken(
    engine: Engine,
    checkpoints: tuple[Path, Path],
    expected: tuple[list[list[int]], list[list[int]]],
) -> None:
    """vLLM's RL order: sleep, wake the weights, push new ones, wake the cache."""
    engine.sleep(level=1)
    with pytest.raises(WeightUpdateError, match="asleep"):
        engine.update_weights(_tensors(checkpoints[1]))
    engine.wake_up(tags=["weights"])
    engine.update_weights(_tensors(checkpoints[1]))
    engine.wake_up(tags=["kv_cache"])
    assert _tokens(engine) == expected[1]
