"""A completion's final text equals its streamed text, whatever the tokenizer.

SentencePiece tokenizers (Llama, Mistral, Gemma) decode a first word without its leading
space: ``decode(["▁Hello"]) == "Hello"`` but after the prompt it is ``" Hello"``. The stream
(decoded incrementally after the prompt) sent ``" Hello"``, and the final output used to be
``decode(completion)``, one character shorter: a server slicing the final text at what it had
sent lost the last character. Now every path decodes the completion after the prompt (as
vLLM does), so streamed, cumulative and offline texts agree. The model is scripted.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.unit.engine.test_stop_strings import ScriptedExecutor

from pagedinfer import AsyncEngine, Engine, SamplingParams
from pagedinfer.engine.detokenizer import decode_completion

HI, HELLO, WORLD, BANG = 2, 3, 4, 5  # token ids


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "▁Hi": HI, "▁Hello": HELLO, "▁world": WORLD, "!": BANG}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.decoder = decoders.Metaspace(prepend_scheme="first")
    fast: Any = PreTrainedTokenizerFast
    return fast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>")


def test_the_tokenizer_drops_a_first_words_space(tokenizer: Any) -> None:
    assert tokenizer.decode([HELLO, WORLD]) == "Hello world"
    assert tokenizer.decode([HI, HELLO, WORLD]) == "Hi Hello world"
    assert decode_completion(tokenizer, [HI], [HELLO, WORLD, BANG]) == " Hello world!"


@pytest.fixture
def engine(
    tokenizer: Any, make_checkpoint: Callable[..., Path], tmp_path: Path
) -> Iterator[Engine]:
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(make_checkpoint("tiny"), checkpoint)
    tokenizer.save_pretrained(str(checkpoint))
    with Engine(checkpoint, device="cpu", kv_block_size=16, max_model_len=64) as engine:
        real = engine._executor
        engine._executor = ScriptedExecutor(engine, [HELLO, WORLD, BANG, WORLD, BANG])  # type: ignore[assignment]
        yield engine
        if engine._executor is None:  # an AsyncEngine closed it (with the scripted executor)
            real.close()
        else:
            engine._executor = real


@pytest.mark.parametrize("stop", [(), ("zz",)])
def test_generate_stream_and_step_give_the_same_text(engine: Engine, stop: tuple[str]) -> None:
    params = SamplingParams(max_tokens=3, ignore_eos=True, stop=stop)
    (whole,) = engine.generate([[HI]], params, use_tqdm=False)
    assert whole.outputs[0].text == " Hello world!"
    deltas = list(engine.stream([HI], params))
    assert "".join(d.outputs[0].text for d in deltas) == " Hello world!"
    request_id = engine.add_request([HI], params, stream=True)
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step() if o.request_id == request_id]
    assert texts[-1] == " Hello world!"
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(texts))


def test_async_engine_text_only_grows_up_to_the_final_text(engine: Engine) -> None:
    params = SamplingParams(max_tokens=5, ignore_eos=True, n=2)

    async def main() -> list[Any]:
        async with AsyncEngine.from_engine(engine) as wrapped:
            return [output async for output in wrapped.generate([HI], params)]

    outputs = asyncio.run(asyncio.wait_for(main(), 60))
    for index in range(2):
        texts = [output.outputs[index].text for output in outputs]
        assert texts[-1] == " Hello world! world!"
        assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(texts))
