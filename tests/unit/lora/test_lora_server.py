"""LoRA over HTTP, in process: ``--lora-modules`` adapters selected by the request's
``model`` and listed by ``/v1/models`` with their parent; vLLM's load/unload routes behind
the API key; an adapter in use is not unloaded (409)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagedinfer import AsyncEngine, SamplingParams
from pagedinfer.engine.lora import LoRAAdapterInUseError
from pagedinfer.errors import ConfigurationError
from pagedinfer.serving import build_app
from pagedinfer.serving.lora import parse_lora_module, runtime_lora_updating
from pagedinfer.serving.options import ServingOptions
from peft_reference import ATTENTION, MLP, make_adapter

pytest.importorskip("fastapi")

KEY = {"Authorization": "Bearer secret"}
PROMPT = [3, 14, 15, 92, 65, 35]


@pytest.fixture(scope="module")
def base(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny")


@pytest.fixture(scope="module")
def adapter_paths(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("served-loras")
    return {
        "sql": make_adapter(base, root / "sql", ATTENTION, rank=8, alpha=16, seed=21),
        "chat": make_adapter(base, root / "chat", MLP, rank=4, alpha=8, seed=22),
    }


@pytest.fixture(scope="module")
def engine(base: Path) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(
        base, device="cpu", kv_block_size=8, num_kv_blocks=64, max_model_len=128,
        enable_lora=True, max_loras=2,
    )  # fmt: skip
    try:
        yield engine
    finally:
        engine.close()


def _requests(
    app: Any, calls: list[tuple[str, str, dict[str, Any] | None, bool]]
) -> list[httpx.Response]:
    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            out = []
            for method, path, body, keyed in calls:
                headers = KEY if keyed else {}
                out.append(await client.request(method, path, json=body, headers=headers))
            return out

    return asyncio.run(asyncio.wait_for(main(), 120))


def _completion(model: str) -> tuple[str, str, dict[str, Any], bool]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0}
    return ("POST", "/v1/completions", {**body, "ignore_eos": True, "return_token_ids": True}, True)


def test_adapters_are_models_and_can_be_loaded_and_unloaded(
    engine: AsyncEngine, adapter_paths: dict[str, Path], tmp_path: Path
) -> None:
    options = ServingOptions(
        api_key="secret",
        lora_modules=(("sql", str(adapter_paths["sql"])),),
        allow_runtime_lora_updating=True,
    )
    app = build_app(engine, served_model_name="base", options=options)
    state = app.state.serving
    listed, base_out, sql_out, missing = _requests(
        app,
        [
            ("GET", "/v1/models", None, True),
            _completion("base"),
            _completion("sql"),
            _completion("nope"),
        ],
    )
    cards = {card["id"]: card for card in listed.json()["data"]}
    assert cards["base"]["parent"] is None
    assert cards["sql"]["parent"] == "base" and cards["sql"]["root"] == str(adapter_paths["sql"])
    sql = state.loras.get("sql")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    (want,) = engine.engine.generate([PROMPT], params, use_tqdm=False, lora_request=sql)
    assert sql_out.status_code == 200, sql_out.text
    assert sql_out.json()["model"] == "sql"
    assert sql_out.json()["choices"][0]["token_ids"] == want.outputs[0].token_ids
    assert base_out.json()["choices"][0]["token_ids"] != want.outputs[0].token_ids
    assert missing.status_code == 404

    chat = {"lora_name": "chat", "lora_path": str(adapter_paths["chat"])}
    bad = {"lora_name": "bad", "lora_path": str(tmp_path / "nowhere")}
    unkeyed, loaded, again, refused, used = _requests(
        app,
        [
            ("POST", "/v1/load_lora_adapter", chat, False),
            ("POST", "/v1/load_lora_adapter", chat, True),
            ("POST", "/v1/load_lora_adapter", chat, True),
            ("POST", "/v1/load_lora_adapter", bad, True),
            _completion("chat"),
        ],
    )
    assert unkeyed.status_code == 401
    assert loaded.status_code == 200 and "added successfully" in loaded.text
    assert again.status_code == 400 and "already been loaded" in again.text
    assert refused.status_code == 400 and "no such directory" in refused.text
    assert used.status_code == 200 and used.json()["model"] == "chat"
    assert state.loras.get("bad") is None

    real_remove = engine.engine.remove_lora

    def busy(lora_id: int) -> bool:
        raise LoRAAdapterInUseError("LoRA adapter 'chat' is in use by unfinished requests")

    engine.engine.remove_lora = busy  # type: ignore[method-assign]
    try:
        (in_use,) = _requests(
            app, [("POST", "/v1/unload_lora_adapter", {"lora_name": "chat"}, True)]
        )
    finally:
        engine.engine.remove_lora = real_remove  # type: ignore[method-assign]
    assert in_use.status_code == 409 and "in use" in in_use.text
    unloaded, gone, unknown, listed = _requests(
        app,
        [
            ("POST", "/v1/unload_lora_adapter", {"lora_name": "chat"}, True),
            _completion("chat"),
            ("POST", "/v1/unload_lora_adapter", {"lora_name": "chat"}, True),
            ("GET", "/v1/models", None, True),
        ],
    )
    assert unloaded.status_code == 200 and "removed successfully" in unloaded.text
    assert gone.status_code == 404 and unknown.status_code == 404
    assert [card["id"] for card in listed.json()["data"]] == ["base", "sql"]


def test_the_routes_need_the_switch_and_modules_need_enable_lora(
    engine: AsyncEngine, base: Path, adapter_paths: dict[str, Path]
) -> None:
    app = build_app(engine, served_model_name="base")
    body = {"lora_name": "x", "lora_path": str(adapter_paths["sql"])}
    (answer,) = _requests(app, [("POST", "/v1/load_lora_adapter", body, False)])
    assert answer.status_code == 404
    plain = AsyncEngine(base, device="cpu", kv_block_size=8, num_kv_blocks=32, max_model_len=64)
    try:
        options = ServingOptions(lora_modules=(("sql", str(adapter_paths["sql"])),))
        with pytest.raises(ConfigurationError, match="enable_lora=True"):
            build_app(plain, served_model_name="base", options=options)
    finally:
        plain.close()


def test_lora_modules_syntax() -> None:
    assert parse_lora_module("sql=/a/b") == ("sql", "/a/b")
    assert parse_lora_module('{"name": "sql", "path": "/a/b", "base_model_name": "m"}') == (
        "sql",
        "/a/b",
    )
    for bad in ("sql", "=/a", '{"name": "sql"}', "{oops"):
        with pytest.raises(ValueError, match="lora-modules"):
            parse_lora_module(bad)
    assert runtime_lora_updating(False, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    assert not runtime_lora_updating(False, {})
