"""Multi-LoRA end to end on the CPU: greedy tokens equal transformers' with the adapter merged
(PEFT's ``merge_and_unload``), alone and mixed with the base model and other adapters in one
batch; bad adapters are refused with a clear error and the engine keeps serving."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from pagedinfer import Engine, LoRARequest, SamplingParams
from pagedinfer.errors import InvalidLoRAAdapterError, InvalidRequestError
from peft_reference import ATTENTION, MLP, make_adapter, merged_greedy

MAX_TOKENS = 8
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def base(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny")


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("loras")
    specs = {
        "attn": (ATTENTION, 8, 16, False),
        "mlp": (MLP, 4, 8, True),  # rsLoRA scaling
        "all": (ATTENTION + MLP, 16, 16, False),
    }
    loras = {}
    for index, (name, (targets, rank, alpha, rslora)) in enumerate(specs.items(), start=1):
        path = make_adapter(
            base, root / name, targets, rank=rank, alpha=alpha, seed=index, use_rslora=rslora
        )
        loras[name] = LoRARequest(name, index, str(path))
    return loras


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(512) for _ in range(20)]
    return [shared + [rng.randrange(512) for _ in range(rng.randint(1, 12))] for _ in range(4)]


@pytest.fixture(scope="module")
def references(
    base: Path, adapters: dict[str, LoRARequest], prompts: list[list[int]]
) -> dict[str | None, list[list[int]]]:
    refs: dict[str | None, list[list[int]]] = {None: merged_greedy(base, None, prompts, MAX_TOKENS)}
    for name, lora in adapters.items():
        refs[name] = merged_greedy(base, Path(lora.lora_path), prompts, MAX_TOKENS)
    return refs


@pytest.fixture(scope="module")
def engine(base: Path) -> Engine:
    # Two device slots for three adapters: slots are reused, the scheduler holds adapters back.
    with Engine(
        base,
        device="cpu",
        dtype="float32",
        kv_block_size=8,
        max_model_len=128,
        max_num_batched_tokens=64,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
    ) as engine:
        yield engine


def test_adapters_change_the_reference(references: dict[str | None, list[list[int]]]) -> None:
    for name in ("attn", "mlp", "all"):
        assert references[name] != references[None], f"adapter {name} changes nothing"


@pytest.mark.parametrize("name", ["attn", "mlp", "all"])
def test_each_adapter_matches_merged_peft(
    engine: Engine,
    adapters: dict[str, LoRARequest],
    prompts: list[list[int]],
    references: dict[str | None, list[list[int]]],
    name: str,
) -> None:
    outputs = engine.generate(prompts, PARAMS, use_tqdm=False, lora_request=adapters[name])
    assert [out.outputs[0].token_ids for out in outputs] == references[name]


def test_one_batch_mixes_base_and_three_adapters(
    engine: Engine,
    adapters: dict[str, LoRARequest],
    prompts: list[list[int]],
    references: dict[str | None, list[list[int]]],
) -> None:
    names: list[str | None] = [None, "attn", "mlp", "all", "attn", None, "all", "mlp"]
    batch = [prompts[index % len(prompts)] for index in range(len(names))]
    loras = [None if name is None else adapters[name] for name in names]
    outputs = engine.generate(batch, PARAMS, use_tqdm=False, lora_request=loras)
    for index, (name, output) in enumerate(zip(names, outputs, strict=True)):
        want = references[name][index % len(prompts)]
        assert output.outputs[0].token_ids == want, f"row {index} ({name})"


def test_prefix_cache_is_per_adapter(
    engine: Engine, adapters: dict[str, LoRARequest], references: dict[str | None, list[list[int]]]
) -> None:
    rng = random.Random(9)
    prompt = [rng.randrange(512) for _ in range(33)]  # four full blocks of 8
    base_out = engine.generate([prompt], PARAMS, use_tqdm=False)[0]
    lora_out = engine.generate([prompt], PARAMS, use_tqdm=False, lora_request=adapters["attn"])[0]
    again = engine.generate([prompt], PARAMS, use_tqdm=False, lora_request=adapters["attn"])[0]
    assert base_out.num_cached_tokens == 0
    assert lora_out.num_cached_tokens == 0  # the base model's blocks are not reused
    assert again.num_cached_tokens == 32  # the adapter's own are
    assert again.outputs[0].token_ids == lora_out.outputs[0].token_ids


def _copy(adapter: LoRARequest, target: Path) -> Path:
    shutil.copytree(adapter.lora_path, target)
    return target


def test_bad_adapters_are_refused_and_the_engine_serves_on(
    engine: Engine,
    adapters: dict[str, LoRARequest],
    prompts: list[list[int]],
    references: dict[str | None, list[list[int]]],
    make_checkpoint: Callable[..., Path],
    tmp_path: Path,
) -> None:
    good = adapters["attn"]
    missing_weights = _copy(good, tmp_path / "no-weights")
    (missing_weights / "adapter_model.safetensors").unlink()
    high_rank = _copy(adapters["all"], tmp_path / "rank")
    config = json.loads((high_rank / "adapter_config.json").read_text())
    config["r"] = 32
    (high_rank / "adapter_config.json").write_text(json.dumps(config))
    other_model = make_checkpoint("tiny", hidden_size=48, num_attention_heads=2, head_dim=24)
    shape = make_adapter(other_model, tmp_path / "shape", ATTENTION, rank=4, alpha=4, seed=5)
    embed = make_adapter(
        make_checkpoint("tiny"), tmp_path / "embed", ("embed_tokens",), rank=4, alpha=4, seed=6
    )
    cases = {
        tmp_path / "nowhere": "no such directory",
        missing_weights: "adapter_model.safetensors is missing",
        high_rank: "exceeds max_lora_rank=16",
        shape: "has shape",
        embed: "'embed_tokens' is not supported",
    }
    for index, (path, message) in enumerate(cases.items(), start=10):
        with pytest.raises(InvalidLoRAAdapterError, match=message):
            engine.generate(
                prompts[:1],
                PARAMS,
                use_tqdm=False,
                lora_request=LoRARequest(f"b{index}", index, str(path)),
            )
    with pytest.raises(InvalidLoRAAdapterError, match="already names adapter"):
        engine.add_lora(LoRARequest("other", good.lora_int_id, str(shape)))
    outputs = engine.generate(prompts, PARAMS, use_tqdm=False, lora_request=good)
    assert [out.outputs[0].token_ids for out in outputs] == references["attn"]


def test_lora_requests_need_enable_lora(base: Path, adapters: dict[str, LoRARequest]) -> None:
    with Engine(base, device="cpu", num_kv_blocks=16, kv_block_size=8, max_model_len=64) as plain:
        with pytest.raises(InvalidRequestError, match="enable_lora=True"):
            plain.add_request([1, 2, 3], PARAMS, lora_request=adapters["attn"])
        assert not plain.has_unfinished_requests()


def test_remove_lora_refuses_an_adapter_in_use(
    engine: Engine, adapters: dict[str, LoRARequest]
) -> None:
    lora = adapters["mlp"]
    engine.add_lora(lora)
    assert lora.lora_int_id in engine.list_loras()
    request_id = engine.add_request([5, 6, 7], PARAMS, lora_request=lora)
    with pytest.raises(InvalidRequestError, match="in use"):
        engine.remove_lora(lora.lora_int_id)
    engine.abort(request_id)
    engine.step()
    assert engine.remove_lora(lora.lora_int_id)
    assert lora.lora_int_id not in engine.list_loras()
    assert not engine.remove_lora(lora.lora_int_id)
