"""``LLM``, vLLM's entry point: its quickstart runs unchanged but for the import and the
model path; vLLM's arguments are honoured, accepted as no-ops or refused by name; vLLM's
SamplingParams defaults; ``dir(pagedinfer)``."""

from __future__ import annotations

import json
import re
import runpy
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import pagedinfer
from pagedinfer import LLM, Engine, SamplingParams
from pagedinfer.engine.llm import VLLM_ARGUMENTS
from pagedinfer.errors import ConfigurationError, InvalidRequestError

SMALL = {"device": "cpu", "max_model_len": 256, "kv_block_size": 16}

# vLLM's offline quickstart (examples/offline_inference/basic/basic.py): the prompts, the
# sampling parameters, LLM(model=...), llm.generate(prompts, sampling_params) and the loop
# that prints each prompt and its text. Only the import and the model path differ.
QUICKSTART = """
from pagedinfer import LLM, SamplingParams

# Sample prompts.
prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
# Create a sampling params object.
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)


def main():
    # Create an LLM.
    llm = LLM(model=MODEL)
    # Generate texts from the prompts.
    # The output is a list of RequestOutput objects
    # that contain the prompt, generated text, and other information.
    outputs = llm.generate(prompts, sampling_params)
    # Print the outputs.
    print("\\nGenerated Outputs:\\n" + "-" * 60)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt:    {prompt!r}")
        print(f"Output:    {generated_text!r}")
        print("-" * 60)


if __name__ == "__main__":
    main()
"""


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny", with_tokenizer=True)


@pytest.fixture(scope="module")
def llm(checkpoint: Path) -> Iterator[LLM]:
    with LLM(model=str(checkpoint), **SMALL) as llm:
        yield llm


def test_vllms_quickstart_runs_unchanged_but_for_the_import_and_the_model(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "basic.py"
    script.write_text(QUICKSTART.replace("MODEL", repr(str(checkpoint))))
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    prompts = [line for line in out.splitlines() if line.startswith("Prompt:")]
    texts = [line for line in out.splitlines() if line.startswith("Output:")]
    assert prompts == [
        "Prompt:    'Hello, my name is'",
        "Prompt:    'The president of the United States is'",
        "Prompt:    'The capital of France is'",
        "Prompt:    'The future of AI is'",
    ]
    assert len(texts) == 4 and all(len(line) > len("Output:    ''") for line in texts)


def test_the_example_runs(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    example = Path(__file__).resolve().parents[3] / "examples" / "vllm_offline.py"
    monkeypatch.setattr("sys.argv", [str(example), "--model", str(checkpoint)])
    runpy.run_path(str(example), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[:2]] == ["[0]", "[1]"]
    assert lines[2].startswith("chat -> ") and lines[3].startswith("tokenizer: ")


def test_generate_and_chat_take_vllms_positional_order(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate(["Hello", [1, 2, 3]], params, False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4]
    assert all(isinstance(o.request_id, str) for o in outputs)
    (reply,) = llm.chat([{"role": "user", "content": "Hi!"}], params, False)
    assert reply.prompt is not None and "Hi!" in reply.prompt
    (again,) = llm.chat(
        [{"role": "user", "content": "Hi!"}], params, False, None, None, "string", True
    )
    assert again.outputs[0].token_ids == reply.outputs[0].token_ids
    assert llm.get_tokenizer() is llm.tokenizer is not None
    (default,) = llm.generate([[1, 2, 3]])  # SamplingParams(): 16 tokens, as in vLLM
    assert len(default.outputs[0].token_ids) <= 16


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda llm: llm.generate("x", None, False, object()), "lora_request"),
        (lambda llm: llm.generate("x", None, False, None, [1]), "priority=[1]"),
        (lambda llm: llm.chat([{"role": "user", "content": "x"}], tools=[{}]), "tools"),
        (
            lambda llm: llm.chat([{"role": "user", "content": "x"}], continue_final_message=True),
            "continue_final_message",
        ),
        (
            lambda llm: llm.chat(
                [{"role": "user", "content": "x"}], chat_template_content_format="openai"
            ),
            "chat_template_content_format",
        ),
        (lambda llm: llm.embed("x", use_tqdm=False), "runner='pooling'"),
        (lambda llm: llm.score("x", "y", use_tqdm=False), "runner='pooling'"),
    ],
)
def test_request_options_pagedinfer_lacks_are_refused_by_name(
    llm: LLM, call: Callable[[LLM], object], needle: str
) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(needle)):
        call(llm)
    llm.generate("x", None, False, None, [0])  # priority 0 is first come, first served


def test_parallelism_arguments_reach_the_engine(checkpoint: Path) -> None:
    """vLLM's distributed_executor_backend (None: the default, "mp") and
    pipeline_parallel_size are Engine arguments: pipeline parallelism needs Ray."""
    with LLM(str(checkpoint), distributed_executor_backend=None, **SMALL) as llm:
        assert llm.config.distributed_executor_backend == "mp"
    with pytest.raises(ConfigurationError, match="needs distributed_executor_backend='ray'"):
        LLM(str(checkpoint), pipeline_parallel_size=2, **SMALL)
    with pytest.raises(ConfigurationError, match=r"expected 'mp' .* or 'ray'"):
        LLM(str(checkpoint), distributed_executor_backend="external_launcher", **SMALL)


def test_speculative_config_reaches_the_engine(llm: LLM, checkpoint: Path) -> None:
    """vLLM's ``speculative_config`` dict: n-gram drafts are verified and accepted, and the
    greedy tokens are those of the LLM without it; a malformed one is refused by name."""
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = llm.generate(prompts, greedy, use_tqdm=False)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    with LLM(str(checkpoint), speculative_config=ngram, **SMALL) as speculative:
        assert speculative.speculation is not None
        assert speculative.speculation.num_speculative_tokens == 3
        got = speculative.generate(prompts, greedy, use_tqdm=False)
        stats = speculative.stats()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert stats.spec_decode_num_accepted_tokens > 0, "no draft was accepted: a weak test"
    with pytest.raises(ConfigurationError, match="num_speculative_tokens"):
        LLM(str(checkpoint), speculative_config={"method": "ngram"}, **SMALL)
    with pytest.raises(ConfigurationError, match="not supported"):
        LLM(str(checkpoint), speculative_config={"method": "eagle3", "k": 2}, **SMALL)


@pytest.mark.parametrize(
    ("argument", "value", "needle"),
    [
        ("quantization", "awq", "recognised from its config.json's quantization_config"),
        ("revision", "main", "hf download REPO --revision REV"),
        ("download_dir", "/tmp", "never downloads"),
        ("data_parallel_size", 2, "pagedinfer.ray"),
        ("tokenizer_mode", "mistral", "AutoTokenizer"),
        ("cpu_offload_gb", 4, "not offloaded"),
        ("task", "transcription", "a pooling task"),
        ("enable_chunked_prefill", False, "always prefilled in chunks"),
        ("scheduling_policy", "priority", "first come, first served"),
        ("hf_overrides", {"num_hidden_layers": 1}, "config.json is used as it is"),
    ],
)
def test_vllm_arguments_pagedinfer_cannot_honour_are_refused_by_name(
    checkpoint: Path, argument: str, value: object, needle: str
) -> None:
    with pytest.raises(ConfigurationError, match=rf"LLM\({argument}=.*\) is not supported") as e:
        LLM(str(checkpoint), **{argument: value}, **SMALL)
    assert needle in str(e.value)


def test_an_unknown_keyword_is_a_type_error(checkpoint: Path) -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'not_a_vllm_argument'"):
        LLM(str(checkpoint), not_a_vllm_argument=1, **SMALL)
    with pytest.raises(ConfigurationError, match="set the same thing"):
        LLM(str(checkpoint), block_size=16, **SMALL)  # SMALL has kv_block_size


def test_vllm_arguments_that_map_or_change_nothing_are_accepted(checkpoint: Path) -> None:
    vllm_arguments: dict[str, Any] = {
        "tokenizer": str(checkpoint),  # the model's own directory
        "trust_remote_code": True,
        "dtype": "float32",
        "seed": None,
        "gpu_memory_utilization": 0.5,
        "swap_space": 16,
        "enforce_eager": True,
        "max_model_len": 128,
        "block_size": 16,
        "num_gpu_blocks_override": 40,
        "max_num_seqs": 8,
        "enable_prefix_caching": None,
        "enable_chunked_prefill": True,
        "scheduling_policy": "fcfs",
        "disable_log_stats": True,
        "max_logprobs": 5,
        "tensor_parallel_size": 1,
        "device": "cpu",
        "num_threads": None,  # an Engine argument
    }
    with LLM(model=str(checkpoint), **vllm_arguments) as llm:
        config = llm.config
        assert (config.kv_block_size, config.seed, config.scheduling_policy) == (16, 0, "mixed")
        assert config.enable_prefix_caching and llm.max_model_len == 128
        assert llm.stats().num_kv_blocks == 40 and llm.request_limits.max_logprobs == 5


# vLLM's default of every argument LLM has no Engine equivalent for.
VLLM_DEFAULTS: dict[str, object] = {
    "trust_remote_code": False,
    "swap_space": 4,
    "hf_token": None,
    "max_seq_len_to_capture": 8192,
    "disable_custom_all_reduce": False,
    "disable_async_output_proc": False,
    "disable_log_stats": True,
    "served_model_name": None,
    "disable_sliding_window": False,
    "allowed_local_media_path": "",
    "allowed_media_domains": None,
    "mm_processor_kwargs": None,
    "limit_mm_per_prompt": {},
    "revision": None,
    "tokenizer_revision": None,
    "code_revision": None,
    "download_dir": None,
    "tokenizer_mode": "auto",
    "quantization": None,
    "calculate_kv_scales": False,
    "load_format": "auto",
    "cpu_offload_gb": 0,
    "compilation_config": None,
    "logits_processors": None,
    "structured_outputs_config": None,
    "guided_decoding_backend": None,
    "enable_sleep_mode": False,
    "enable_chunked_prefill": None,
    "data_parallel_size": 1,
    "enable_expert_parallel": False,
}


def test_every_vllm_argument_accepts_vllms_default() -> None:
    assert set(VLLM_DEFAULTS) == set(VLLM_ARGUMENTS)
    for name, value in VLLM_DEFAULTS.items():
        assert VLLM_ARGUMENTS[name].accepts(value), name


def test_generation_config_gives_the_defaults_as_in_vllm(checkpoint: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(checkpoint, model)
    config = {"do_sample": True, "temperature": 0.0, "top_k": 20, "max_new_tokens": 5}
    (model / "generation_config.json").write_text(json.dumps(config))
    with LLM(str(model), **SMALL) as llm:
        defaults = llm.get_default_sampling_params()
        assert defaults == SamplingParams(temperature=0.0, top_k=20, max_tokens=5)
        (output,) = llm.generate([[1, 2, 3]], use_tqdm=False)
        assert len(output.outputs[0].token_ids) <= 5
    with LLM(str(model), generation_config="vllm", **SMALL) as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
    overrides = {"max_new_tokens": 3, "top_p": 0.5}
    with LLM(str(model), override_generation_config=overrides, **SMALL) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(
            temperature=0.0, top_k=20, top_p=0.5, max_tokens=3
        )
    (model / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ConfigurationError, match=r"generation_config\.json gives an invalid"):
        LLM(str(model), **SMALL)
    with pytest.raises(ConfigurationError, match=r"generation_config='nope' is invalid"):
        LLM(str(model), generation_config="nope", **SMALL)
    # The Engine reads it too: its calls without sampling parameters get the same defaults.
    (model / "generation_config.json").write_text(json.dumps(config))
    with Engine(model, **SMALL) as engine:
        assert engine.default_sampling_params == SamplingParams(
            temperature=0.0, top_k=20, max_tokens=5
        )
        (output,) = engine.generate([[1, 2, 3]], use_tqdm=False)
        assert len(output.outputs[0].token_ids) <= 5
    with Engine(model, generation_config="vllm", **SMALL) as engine:
        assert engine.default_sampling_params == SamplingParams()


def test_sampling_params_defaults_are_vllms() -> None:
    """vLLM's SamplingParams defaults (vllm/sampling_params.py), field by field."""
    params = SamplingParams(stop=None, stop_token_ids=None)  # type: ignore[arg-type]
    vllm_defaults: dict[str, object] = {
        "n": 1,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "seed": None,
        "ignore_eos": False,
        "max_tokens": 16,
        "min_tokens": 0,
        "logprobs": None,
        "prompt_logprobs": None,
        "skip_special_tokens": True,
        "include_stop_str_in_output": False,
        "logit_bias": None,
        "allowed_token_ids": None,
    }
    assert {name: getattr(params, name) for name in vllm_defaults} == vllm_defaults
    assert params == SamplingParams()  # vLLM's None lists are stored as ()
    assert (params.stop, params.stop_token_ids) == ((), ())


def test_dir_lists_the_public_names_and_nothing_else() -> None:
    names = dir(pagedinfer)
    assert names == sorted([*pagedinfer.__all__, "__version__"])
    assert "LLM" in names and "Engine" in names and "SamplingParams" in names
    assert not [name for name in names if name.startswith("_") and name != "__version__"]
    for name in pagedinfer.__all__:
        assert getattr(pagedinfer, name) is not None


@pytest.mark.parametrize(
    ("quant_method", "argument", "accepted"),
    [
        ("gptq", "gptq", True),
        ("gptq", "gptq_marlin", True),
        ("awq", "awq_marlin", True),
        ("fp8", "fp8", True),
        ("compressed-tensors", "compressed-tensors", True),
        ("gptq", "awq", False),
        (None, "fp8", False),
    ],
)
def test_quantization_names_the_checkpoints_own_method(
    tmp_path: Path, quant_method: str | None, argument: str, accepted: bool
) -> None:
    """vLLM's quantization= is accepted when it names the method the checkpoint's
    config.json declares (vLLM's Marlin names count as theirs), refused otherwise."""
    from pagedinfer.engine.llm import check_quantization

    config: dict[str, Any] = {"model_type": "qwen3"}
    if quant_method is not None:
        config["quantization_config"] = {"quant_method": quant_method}
    (tmp_path / "config.json").write_text(json.dumps(config))
    if accepted:
        check_quantization(str(tmp_path), argument)
        return
    found = repr(quant_method) if quant_method else "no quantization_config"
    with pytest.raises(ConfigurationError, match=re.escape(found)):
        check_quantization(str(tmp_path), argument)


def test_quantization_outside_the_loaded_formats_is_refused(checkpoint: Path) -> None:
    with pytest.raises(ConfigurationError, match=re.escape("recognised from its config.json")):
        LLM(str(checkpoint), quantization="bitsandbytes", **SMALL)
