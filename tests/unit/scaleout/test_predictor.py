"""EnginePredictor and generate()'s argument checks, in this process: no Ray cluster needed.

The predictor is called the way Ray Data calls it, with a dict of numpy arrays (Ray's default
batch format) or a pandas DataFrame; its columns must equal one Engine's outputs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedinfer import Engine, SamplingParams
from pagedinfer.errors import (
    ConfigurationError,
    InvalidRequestError,
    InvalidSamplingParamsError,
)
from pagedinfer.ray import EnginePredictor
from pagedinfer.ray.columns import OUTPUT_COLUMNS, chat_prompt_token_ids, completion_of

from .conftest import ENGINE_KWARGS

SRC = Path(__file__).resolve().parents[3] / "src"
GREEDY = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
TEXTS = ["Hello, world!", "The quick brown fox", "paged attention", "a", "What is the capital"]
CONVERSATIONS = [
    [{"role": "user", "content": "Hello, world!"}],
    [
        {"role": "system", "content": "Answer with random words."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
]


@pytest.fixture(scope="module")
def predictor(chat_checkpoint: Path) -> Iterator[EnginePredictor]:
    predictor = EnginePredictor(chat_checkpoint, GREEDY, ENGINE_KWARGS)
    yield predictor
    predictor.close()


@pytest.fixture(scope="module")
def reference(chat_checkpoint: Path) -> Iterator[Engine]:
    with Engine(chat_checkpoint, **ENGINE_KWARGS) as engine:
        yield engine


def _expected(engine: Engine, prompts: list[Any]) -> dict[str, list[Any]]:
    outputs = engine.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)
    completions = [completion_of(output) for output in outputs]
    return {
        "generated_text": [text for text, _, _ in completions],
        "generated_token_ids": [token_ids for _, token_ids, _ in completions],
        "finish_reason": [reason for _, _, reason in completions],
        "num_prompt_tokens": [len(output.prompt_token_ids) for output in outputs],
    }


def _assert_columns(result: Any, expected: dict[str, list[Any]]) -> None:
    for name, values in expected.items():
        got = list(result[name])
        assert got == values, name
    cached = zip(result["num_cached_tokens"], result["num_prompt_tokens"], strict=True)
    assert all(0 <= hits <= length for hits, length in cached)


def test_text_prompts_keep_input_columns_and_add_outputs(
    predictor: EnginePredictor, reference: Engine
) -> None:
    batch = {"id": np.arange(len(TEXTS)), "prompt": np.array(TEXTS, dtype=object)}
    result = predictor(batch)
    assert set(result) == {"id", "prompt", *OUTPUT_COLUMNS}
    assert list(result["id"]) == list(range(len(TEXTS)))
    assert list(result["prompt"]) == TEXTS
    _assert_columns(result, _expected(reference, TEXTS))
    assert set(result["finish_reason"]) == {"length"}
    assert all(len(ids) == GREEDY["max_tokens"] for ids in result["generated_token_ids"])


def test_token_id_prompts_ragged_and_rectangular(
    predictor: EnginePredictor, reference: Engine
) -> None:
    token_ids = [reference.tokenizer.encode(text) for text in TEXTS]
    # Ray hands lists of different lengths as an object array of int64 arrays...
    ragged = np.empty(len(token_ids), dtype=object)
    ragged[:] = [np.array(ids, dtype=np.int64) for ids in token_ids]
    expected = _expected(reference, token_ids)
    _assert_columns(predictor({"prompt": ragged}), expected)
    # ...and lists of one length as a 2-D array.
    square = [[*ids, 7, 8][:2] for ids in token_ids]
    rectangular = np.array(square, dtype=np.int64)
    _assert_columns(predictor({"prompt": rectangular}), _expected(reference, square))


def test_messages_go_through_the_chat_template(
    predictor: EnginePredictor, reference: Engine
) -> None:
    messages = np.empty(len(CONVERSATIONS), dtype=object)
    messages[:] = [np.array(conversation, dtype=object) for conversation in CONVERSATIONS]
    result = predictor({"messages": messages})
    rendered = [chat_prompt_token_ids(reference.tokenizer, c) for c in CONVERSATIONS]
    assert reference.tokenizer.decode(rendered[1]).endswith(
        "<user>What is the capital of France?\n<assistant>"
    )
    _assert_columns(result, _expected(reference, rendered))
    # A batch may carry both columns: a row without a prompt uses its messages.
    mixed = predictor(
        {
            "prompt": np.array([None, TEXTS[0]], dtype=object),
            "messages": np.array([CONVERSATIONS[0], None], dtype=object),
        }
    )
    _assert_columns(mixed, _expected(reference, [rendered[0], TEXTS[0]]))


def test_chat_template_kwargs_reach_the_template(chat_checkpoint: Path) -> None:
    predictor = EnginePredictor(
        chat_checkpoint,
        {"temperature": 0.0, "max_tokens": 2},
        ENGINE_KWARGS,
        chat_template_kwargs={"enable_thinking": False},
    )
    try:
        messages = np.empty(1, dtype=object)
        messages[:] = [CONVERSATIONS[0]]
        result = predictor({"messages": messages})
        tokenizer = predictor.engine.tokenizer
        plain = chat_prompt_token_ids(tokenizer, CONVERSATIONS[0])
        assert tokenizer.decode(plain).endswith("<assistant>")
        assert result["num_prompt_tokens"][0] > len(plain)  # "<nothink>" was appended
    finally:
        predictor.close()


def test_pandas_batches(predictor: EnginePredictor, reference: Engine) -> None:
    pandas = pytest.importorskip("pandas")
    frame = pandas.DataFrame({"prompt": TEXTS[:3]}, index=[10, 11, 12])
    result = predictor(frame)
    assert isinstance(result, pandas.DataFrame)
    assert list(result.index) == [10, 11, 12]
    _assert_columns(result, _expected(reference, TEXTS[:3]))


def test_sampling_params_as_dict_or_object(chat_checkpoint: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=3, stop=["zzz"])
    predictor = EnginePredictor(chat_checkpoint, params, ENGINE_KWARGS)
    try:
        assert predictor.sampling_params is params
        result = predictor({"prompt": np.array(["Hello"], dtype=object)})
        assert len(result["generated_token_ids"][0]) == 3
    finally:
        predictor.close()
    with pytest.raises(InvalidSamplingParamsError, match=r"unknown SamplingParams field.*temp"):
        EnginePredictor(chat_checkpoint, {"temp": 0.0}, ENGINE_KWARGS)
    with pytest.raises(InvalidSamplingParamsError, match="max_tokens"):
        EnginePredictor(chat_checkpoint, {"max_tokens": 0}, ENGINE_KWARGS)
    with pytest.raises(InvalidSamplingParamsError, match="one completion per row"):
        EnginePredictor(chat_checkpoint, {"n": 2}, ENGINE_KWARGS)
    with pytest.raises(InvalidSamplingParamsError, match="not list"):
        EnginePredictor(chat_checkpoint, [0.0], ENGINE_KWARGS)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        pytest.param({"text": np.array(["a"])}, r"'prompt' column.*\['text'\]", id="no-column"),
        pytest.param({"prompt": np.array([3.5])}, "row 0.*not float", id="number"),
        pytest.param(
            {"prompt": np.array([None], dtype=object)}, "row 0.*neither", id="missing-row"
        ),
        pytest.param({"messages": np.array(["hi"])}, "row 0.*list of messages", id="bad-messages"),
        pytest.param({"prompt": np.array([[1.0, 2.0]])}, "not an integer", id="float-ids"),
        pytest.param({"prompt": np.array([[1, 99999]])}, "out of vocabulary", id="id-range"),
    ],
)
def test_bad_batches_raise_invalid_request(
    predictor: EnginePredictor, batch: dict[str, Any], match: str
) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        predictor(batch)
    assert not predictor.engine.has_unfinished_requests()


def test_messages_without_a_chat_template(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    # The random checkpoints' tokenizer has a chat template: a copy without one.
    checkpoint = tmp_path / "no-template"
    shutil.copytree(make_checkpoint("tiny", with_tokenizer=True), checkpoint)
    (checkpoint / "chat_template.jinja").unlink(missing_ok=True)
    config_path = checkpoint / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    predictor = EnginePredictor(checkpoint, GREEDY, ENGINE_KWARGS)
    try:
        with pytest.raises(InvalidRequestError, match="no chat template"):
            predictor({"messages": np.array([CONVERSATIONS[0]], dtype=object)})
    finally:
        predictor.close()


def test_generate_checks_its_arguments_before_touching_ray(chat_checkpoint: Path) -> None:
    from pagedinfer.ray import generate

    with pytest.raises(ConfigurationError, match="num_replicas=0"):
        generate(["a"], chat_checkpoint, num_replicas=0)
    with pytest.raises(ConfigurationError, match="batch_size=0"):
        generate(["a"], chat_checkpoint, num_replicas=1, batch_size=0)
    with pytest.raises(InvalidSamplingParamsError, match="top_p"):
        generate(["a"], chat_checkpoint, {"top_p": 2.0}, num_replicas=1)
    with pytest.raises(InvalidRequestError, match="wrap a single prompt"):
        generate("a", chat_checkpoint, num_replicas=1)  # type: ignore[call-overload]
    with pytest.raises(InvalidRequestError, match="mix"):
        generate(["a", [1, 2]], chat_checkpoint, num_replicas=1)
    with pytest.raises(InvalidRequestError, match="prompt 1 is a int"):
        generate(["a", 7], chat_checkpoint, num_replicas=1)  # type: ignore[list-item]
    assert generate([], chat_checkpoint, num_replicas=2) == []


# ----------------------------------------------------------- what `import pagedinfer.ray` costs


def _run_python(code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def test_import_loads_neither_ray_nor_torch() -> None:
    result = _run_python(
        """
        import sys
        import pagedinfer.ray
        from pagedinfer.ray import EnginePredictor  # the class itself needs neither
        heavy = sorted(
            name for name in sys.modules if name.split(".")[0] in ("ray", "torch", "numpy")
        )
        assert not heavy, heavy
        """
    )
    assert result.returncode == 0, result.stderr


def test_without_ray_generate_says_what_to_install() -> None:
    # A meta-path finder that refuses ray stands in for "ray is not installed".
    result = _run_python(
        """
        import sys

        class Refuse:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "ray":
                    raise ModuleNotFoundError(f"No module named {name!r}")
                return None

        sys.meta_path.insert(0, Refuse())
        from pagedinfer.errors import MissingDependencyError
        from pagedinfer.ray import EnginePredictor
        try:
            from pagedinfer.ray import generate
        except MissingDependencyError as error:
            assert isinstance(error, ImportError)
            print(error)
        else:
            raise SystemExit("generate imported without ray")
        """
    )
    assert result.returncode == 0, result.stderr
    assert "pip install '.[ray]' in the pagedinfer checkout" in result.stdout
