"""Sampling parameters are checked once per request, whichever way it comes in (Engine,
AsyncEngine, the server's check then AsyncEngine.generate), before any lock."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedinfer import AsyncEngine, Engine, SamplingParams
from pagedinfer.errors import InvalidRequestError

OPTIONS: dict[str, Any] = {"device": "cpu", "kv_block_size": 16, "max_model_len": 64}
PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny", with_tokenizer=True)


class Checks:
    """Counts the admission's real checks, and whether the engine's lock was held."""

    def __init__(self, engine: Engine) -> None:
        self.count = 0
        self.locked: list[bool] = []
        admission = engine._admission
        real = admission._check

        def counted(params: SamplingParams) -> SamplingParams:
            self.count += 1
            self.locked.append(engine._lock.locked())
            return real(params)

        admission._check = counted  # type: ignore[method-assign]


@pytest.fixture
def engine(checkpoint: Path) -> Iterator[Engine]:
    with Engine(checkpoint, **OPTIONS) as engine:
        yield engine


def test_each_engine_entry_checks_once(engine: Engine) -> None:
    checks = Checks(engine)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request([1, 2, 3], params)
    assert checks.count == 1
    checked = engine.check_sampling_params(params)  # the same object: accepted already
    engine.generate([[4, 5], [6, 7]], checked, use_tqdm=False)
    list(engine.stream([8, 9], checked))
    assert checks.count == 1
    assert checks.locked == [False]


def test_async_engine_and_the_server_path_check_once(checkpoint: Path) -> None:
    async_engine = AsyncEngine(checkpoint, **OPTIONS)
    try:
        checks = Checks(async_engine.engine)
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

        async def main() -> None:
            # The server's order: the parameters first, then the prompt, then generate.
            checked = async_engine.check_sampling_params(params)
            prompt = await async_engine.tokenize([1, 2, 3])
            async for _ in async_engine.generate(prompt, checked):
                pass
            async for _ in async_engine.generate([4, 5], SamplingParams(max_tokens=1)):
                pass

        asyncio.run(asyncio.wait_for(main(), 120))
        assert checks.count == 2 and checks.locked == [False, False]
    finally:
        async_engine.close()


def test_a_refused_request_is_refused_before_its_prompt_is_read(engine: Engine) -> None:
    with pytest.raises(InvalidRequestError, match="n=1000"):
        engine.add_request(object(), SamplingParams(n=1000))  # type: ignore[arg-type]
    assert not engine.has_unfinished_requests()
