"""Pooling models (runner="pooling"): embeddings equal transformers' final hidden states
pooled the same way (float32, 1e-4), for batches of mixed lengths, chunked prefill and
prefix-cache hits; classification heads; the pooling configuration's sources."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_reference import hf_model
from pagedinfer import LLM, PoolingParams, SamplingParams
from pagedinfer.errors import ConfigurationError, InvalidRequestError

TOLERANCE = 1e-4
# A 32-token budget prefills the longer prompts in chunks.
OPTIONS: dict[str, Any] = {
    "device": "cpu",
    "kv_block_size": 16,
    "max_model_len": 128,
    "max_num_batched_tokens": 32,
    "num_kv_blocks": 64,
}


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(512) for _ in range(40)]
    lengths = (1, 5, 17, 33, 70)
    return [[rng.randrange(512) for _ in range(n)] for n in lengths] + [
        shared + [rng.randrange(512) for _ in range(n)] for n in (3, 20)
    ]


def _hidden(checkpoint: Path, prompt: list[int]) -> torch.Tensor:
    model = hf_model(str(checkpoint))
    with torch.inference_mode():
        out = model.model(torch.tensor([prompt]))
    return out.last_hidden_state[0]  # after the final norm


def _pool(hidden: torch.Tensor, pooling_type: str, normalize: bool) -> torch.Tensor:
    row = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling_type]
    return torch.nn.functional.normalize(row, dim=0) if normalize else row


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Path) -> Path:
    return tiny_checkpoint


@pytest.fixture(scope="module")
def last_llm(checkpoint: Path) -> Iterator[LLM]:
    with LLM(model=checkpoint, runner="pooling", **OPTIONS) as llm:
        yield llm


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS"])
def test_mean_and_cls_embeddings_equal_transformers(checkpoint: Path, pooling_type: str) -> None:
    prompts = _prompts(1)
    config = {"pooling_type": pooling_type, "normalize": False}
    with LLM(model=checkpoint, runner="pooling", pooler_config=config, **OPTIONS) as llm:
        assert not llm.scheduler.config.enable_prefix_caching  # every row is needed
        for _ in range(2):  # the second time, nothing may come from a cache
            outputs = llm.embed(prompts, use_tqdm=False)
            for prompt, output in zip(prompts, outputs, strict=True):
                assert output.prompt_token_ids == prompt
                expected = _pool(_hidden(checkpoint, prompt), pooling_type, False)
                got = torch.tensor(output.outputs.embedding)
                torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=TOLERANCE)


def test_last_token_embeddings_equal_transformers_with_prefix_hits(
    checkpoint: Path, last_llm: LLM
) -> None:
    prompts = _prompts(2)
    first = last_llm.embed(prompts, use_tqdm=False)
    again = last_llm._pooling_tasks().pooled(prompts)  # the same prompts: cached blocks
    assert sum(output.num_cached_tokens for output in again) >= 64
    for prompt, output, raw in zip(prompts, first, again, strict=True):
        expected = _pool(_hidden(checkpoint, prompt), "LAST", True)  # normalized by default
        got = torch.tensor(output.outputs.embedding)
        torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=TOLERANCE)
        assert raw.pooled is not None
        cached = torch.nn.functional.normalize(torch.tensor(raw.pooled), dim=0)
        torch.testing.assert_close(cached, expected, atol=TOLERANCE, rtol=TOLERANCE)
        assert output.outputs.hidden_size == 64
    assert isinstance(first[0].request_id, str)


def test_truncate_prompt_tokens_keeps_the_last_tokens(last_llm: LLM) -> None:
    prompt = list(range(1, 200))  # longer than max_model_len: truncated before the check
    (cut,) = last_llm.embed([prompt], truncate_prompt_tokens=7, use_tqdm=False)
    (short,) = last_llm.embed([prompt[-7:]], use_tqdm=False)
    assert cut.prompt_token_ids == prompt[-7:]
    assert cut.outputs.embedding == short.outputs.embedding


def test_a_pooling_engine_refuses_to_generate(last_llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="pooling model"):
        last_llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="pooling model"):
        last_llm.add_request([1, 2, 3])
    # The engine still embeds after the refusal.
    assert len(last_llm.embed([[4, 5, 6]], use_tqdm=False)[0].outputs.embedding) == 64


def test_embedder_score_is_the_cosine_of_embeddings(last_llm: LLM) -> None:
    query, documents = [[1, 2, 3]], [[1, 2, 3], [9, 8, 7, 6]]
    scores = last_llm.score(query * 2, documents, use_tqdm=False)  # type: ignore[arg-type]
    embeddings = [torch.tensor(o.outputs.embedding) for o in last_llm.embed(query + documents)]
    assert scores[0].outputs.score == pytest.approx(1.0, abs=1e-5)
    expected = float(embeddings[0] @ embeddings[2])
    assert scores[1].outputs.score == pytest.approx(expected, abs=1e-5)


def test_dimensions_need_a_matryoshka_model(
    last_llm: LLM, checkpoint: Path, tmp_path: Path
) -> None:
    with pytest.raises(InvalidRequestError, match="Matryoshka"):
        last_llm.embed([[1, 2]], pooling_params=PoolingParams(dimensions=16), use_tqdm=False)
    target = _copy(checkpoint, tmp_path / "matryoshka")
    _edit_json(target / "config.json", matryoshka_dimensions=[16, 32, 64])
    with LLM(model=target, runner="pooling", **OPTIONS) as llm:
        out = llm.embed([[1, 2, 3]], pooling_params=PoolingParams(dimensions=16), use_tqdm=False)
        full = _pool(_hidden(checkpoint, [1, 2, 3]), "LAST", False)
        expected = torch.nn.functional.normalize(full[:16], dim=0)  # truncated, then normalized
        got = torch.tensor(out[0].outputs.embedding)
        torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=TOLERANCE)
        with pytest.raises(InvalidRequestError, match="16, 32, 64"):
            llm.embed([[1]], pooling_params=PoolingParams(dimensions=20), use_tqdm=False)


def test_sentence_transformers_layout_sets_the_pooling(checkpoint: Path, tmp_path: Path) -> None:
    target = _copy(checkpoint, tmp_path / "st")
    (target / "1_Pooling").mkdir()
    (target / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False})
    )
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    (target / "modules.json").write_text(json.dumps(modules))
    from pagedinfer.engine.pooling_setup import pooling_setup

    setup = pooling_setup("pooling", str(target), None)
    assert setup is not None and (setup.pooling_type, setup.normalize) == ("MEAN", False)
    modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "x.models.Normalize"})
    (target / "modules.json").write_text(json.dumps(modules))
    setup = pooling_setup("pooling", str(target), {"pooling_type": "CLS"})
    assert setup is not None and (setup.pooling_type, setup.normalize) == ("CLS", True)
    with pytest.raises(ConfigurationError, match="pooling_type"):
        pooling_setup("pooling", str(target), {"pooling_type": "MAX"})
    with pytest.raises(ConfigurationError, match="runner='pooling'"):
        pooling_setup("generate", str(target), {"pooling_type": "MEAN"})


def _head_checkpoint(checkpoint: Path, target: Path, num_labels: int) -> torch.Tensor:
    """The tiny checkpoint as a Qwen3ForSequenceClassification with a random score head."""
    from safetensors.torch import load_file, save_file

    _copy(checkpoint, target)
    weights = load_file(str(target / "model.safetensors"))
    weights.pop("lm_head.weight", None)
    head = torch.randn(num_labels, 64, generator=torch.Generator().manual_seed(3))
    weights["score.weight"] = head
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    _edit_json(
        target / "config.json",
        architectures=["Qwen3ForSequenceClassification"],
        num_labels=num_labels,
    )
    return head


def test_sequence_classifier_probabilities(checkpoint: Path, tmp_path: Path) -> None:
    head = _head_checkpoint(checkpoint, tmp_path / "cls", 3)
    prompts = [[5, 6, 7], list(range(40))]
    with LLM(model=tmp_path / "cls", **OPTIONS) as llm:  # runner "auto": a classifier pools
        outputs = llm.classify(prompts, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        logits = head @ _hidden(checkpoint, prompt)[-1]
        expected = torch.softmax(logits, 0)
        got = torch.tensor(output.outputs.probs)
        torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=TOLERANCE)
    with pytest.raises(ConfigurationError, match="cannot generate"):
        LLM(model=tmp_path / "cls", runner="generate", **OPTIONS)


def test_qwen3_reranker_scores_yes_against_no(make_checkpoint: Callable[..., Path]) -> None:
    checkpoint = make_checkpoint("tiny", with_tokenizer=True)
    overrides = {
        "architectures": ["Qwen3ForSequenceClassification"],
        "classifier_from_token": ["a", "b"],  # Qwen3-Reranker's are ["no", "yes"]
        "is_original_qwen3_reranker": True,
    }
    with LLM(model=checkpoint, hf_overrides=overrides, **OPTIONS) as llm:
        tokenizer = llm.get_tokenizer()
        no, yes = tokenizer.convert_tokens_to_ids(["a", "b"])
        scores = llm.score("query text", ["first doc", "second document"], use_tqdm=False)
        for document, result in zip(["first doc", "second document"], scores, strict=True):
            prompt = tokenizer("query text", document)["input_ids"]
            assert result.prompt_token_ids == prompt
            model = hf_model(str(checkpoint))
            with torch.inference_mode():
                logits = model(torch.tensor([prompt])).logits[0, -1]
            expected = torch.softmax(logits[[no, yes]], 0)[1]
            assert result.outputs.score == pytest.approx(float(expected), abs=TOLERANCE)


def _copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def _edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_vllms_pooling_arguments_map_to_the_engines() -> None:
    from pagedinfer.engine.llm_pooling import vllm_pooling_kwargs
    from pagedinfer.engine.pooling_setup import PoolerConfig

    defaults = {"task": "auto", "convert": "auto", "hf_overrides": None}
    assert vllm_pooling_kwargs({**defaults, "override_pooler_config": None}) == {}
    assert vllm_pooling_kwargs({"task": "embed"}) == {"runner": "pooling"}
    mapped = vllm_pooling_kwargs({"convert": "embed", "pooler_config": {"pooling_type": "MEAN"}})
    assert mapped == {"runner": "pooling", "pooler_config": PoolerConfig(pooling_type="MEAN")}
    with pytest.raises(ConfigurationError, match="hf_overrides"):
        vllm_pooling_kwargs({"hf_overrides": {"num_hidden_layers": 1}})


def test_a_bare_decoder_checkpoint_embeds(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """Qwen3-Embedding's layout: the decoder saved alone (``layers.0...``, no ``model.``
    prefix, no LM head), with config.json naming the causal LM, untied."""
    from safetensors.torch import load_file, save_file

    checkpoint = make_checkpoint("tiny", tie_word_embeddings=False)
    target = _copy(checkpoint, tmp_path / "bare")
    weights = load_file(str(target / "model.safetensors"))
    bare = {
        name.removeprefix("model."): w for name, w in weights.items() if name != "lm_head.weight"
    }
    save_file(bare, str(target / "model.safetensors"), metadata={"format": "pt"})
    prompts = [[3, 1, 4, 1, 5], list(range(50))]
    with LLM(model=target, runner="pooling", **OPTIONS) as llm:
        outputs = llm.embed(prompts, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = _pool(_hidden(checkpoint, prompt), "LAST", True)
        got = torch.tensor(output.outputs.embedding)
        torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=TOLERANCE)
