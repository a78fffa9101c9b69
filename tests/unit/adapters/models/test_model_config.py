"""ModelConfig.from_pretrained and read_model_config: both config.json layouts, RoPE variants,
MoE and sliding-window fields, EOS ids, and every refusal."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from pagedinfer.adapters.layers.rotary import RopeScaling
from pagedinfer.adapters.models import config as config_module
from pagedinfer.adapters.models.config import ModelConfig
from pagedinfer.adapters.models.registry import SUPPORTED_ARCHITECTURES, read_model_config
from pagedinfer.errors import CheckpointNotFoundError, ConfigurationError, UnsupportedModelError

# A Qwen3-0.6B style config.json as transformers 4.5x writes it.
LEGACY_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def write_checkpoint(
    directory: Path,
    config: dict[str, Any] | None,
    generation: dict[str, Any] | None = None,
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation))
    return directory


def legacy(*, drop: tuple[str, ...] = (), **changes: Any) -> dict[str, Any]:
    """The legacy config with keys ``drop`` removed and ``changes`` applied."""
    config = {key: value for key, value in LEGACY_CONFIG.items() if key not in drop}
    config.update(changes)
    return config


@pytest.mark.skipif(
    int(transformers.__version__.split(".")[0]) < 5,
    reason="random checkpoints take the installed transformers' layout; 4.x writes the legacy "
    "one (test_legacy_layout)",
)
def test_transformers5_layout(make_checkpoint: Callable[..., Path]) -> None:
    path = make_checkpoint("tiny", rope_theta=123456.0)
    raw = json.loads((path / "config.json").read_text())
    assert "rope_parameters" in raw and "rope_theta" not in raw  # really the new layout
    config = ModelConfig.from_pretrained(path)
    assert config.architecture == "Qwen3ForCausalLM"
    assert config.path == path
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (512, 64, 128)
    assert (config.num_hidden_layers, config.num_attention_heads) == (2, 4)
    assert (config.num_key_value_heads, config.head_dim) == (2, 32)
    assert config.rope_theta == 123456.0
    assert config.dtype is torch.float32
    assert config.tie_word_embeddings is True
    assert config.attention_bias is False
    assert config.max_position_embeddings == 4096
    assert config.rms_norm_eps == 1e-6
    assert config.eos_token_ids == ()


def test_legacy_layout(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "m", legacy(), {"eos_token_id": [151645, 151643]})
    config = ModelConfig.from_pretrained(str(path))
    assert config.rope_theta == 1_000_000.0
    assert config.dtype is torch.bfloat16
    assert config.head_dim == 1024 // 16  # no head_dim key: hidden / heads
    assert config.eos_token_ids == (151645, 151643)


@pytest.mark.parametrize(
    ("generation", "config_eos", "expected"),
    [
        (None, 7, (7,)),
        (None, [7, 8, 7], (7, 8)),
        ({"eos_token_id": 3}, 7, (3,)),
        ({"eos_token_id": None}, [7], (7,)),
        ({}, None, ()),
    ],
)
def test_eos_ids(
    tmp_path: Path, generation: dict[str, Any] | None, config_eos: Any, expected: tuple[int, ...]
) -> None:
    path = write_checkpoint(tmp_path / "m", legacy(eos_token_id=config_eos), generation)
    assert ModelConfig.from_pretrained(path).eos_token_ids == expected


@pytest.mark.parametrize(
    ("name", "dtype"), [("float16", torch.float16), ("float32", torch.float32)]
)
def test_dtype_names(tmp_path: Path, name: str, dtype: torch.dtype) -> None:
    path = write_checkpoint(tmp_path / "m", legacy(torch_dtype=name))
    assert ModelConfig.from_pretrained(path).dtype is dtype


def test_missing_directory_is_file_not_found(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(CheckpointNotFoundError, match="nowhere") as info:
        ModelConfig.from_pretrained(missing)
    assert isinstance(info.value, FileNotFoundError)


def test_a_file_is_not_a_checkpoint(tmp_path: Path) -> None:
    file = tmp_path / "weights.bin"
    file.write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"weights\.bin"):
        ModelConfig.from_pretrained(file)


def test_no_config_json(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "empty", None)
    with pytest.raises(UnsupportedModelError, match=r"config\.json") as info:
        ModelConfig.from_pretrained(path)
    assert isinstance(info.value, ValueError)
    assert "empty" in str(info.value)


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        (legacy(drop=("architectures",)), "architectures"),
        (legacy(architectures="Qwen3ForCausalLM"), "architectures"),
        (legacy(rope_scaling={"rope_type": "longrope", "factor": 4.0}), "'longrope'"),
        (legacy(rope_scaling={"type": "su"}), "'su'"),
        (legacy(rope_scaling={"rope_type": "linear"}), "'factor'"),
        (legacy(rope_scaling={"rope_type": "dynamic", "factor": -2}), "'factor'"),
        (
            legacy(
                drop=("rope_theta",),
                rope_parameters={"rope_type": "llama3", "rope_theta": 1, "factor": 8.0},
            ),
            "'low_freq_factor'",
        ),
        (
            legacy(
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 4.0,
                    "high_freq_factor": 1.0,
                }
            ),
            "high_freq_factor",
        ),
        (legacy(rope_scaling=[1, 2]), "rope_scaling"),
        (legacy(partial_rotary_factor=0.5), "partial_rotary_factor"),
        (legacy(layer_types=["chunked_attention"] * 28), "chunked_attention"),
        (legacy(use_sliding_window=True, sliding_window=0, max_window_layers=0), "sliding_window"),
        (legacy(torch_dtype="float8_e4m3fn"), "float8_e4m3fn"),
        (legacy(hidden_act="gelu"), "gelu"),
        (legacy(drop=("vocab_size",)), "vocab_size"),
        (legacy(num_attention_heads=0), "num_attention_heads"),
        (legacy(num_key_value_heads=3), "num_key_value_heads"),
        (legacy(tie_word_embeddings="yes"), "tie_word_embeddings"),
        (legacy(num_experts=4, num_experts_per_tok=8, moe_intermediate_size=8), "exceeds"),
        (
            legacy(
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, mlp_only_layers=[99]
            ),
            "mlp_only_layers",
        ),
    ],
)
def test_unsupported_models(tmp_path: Path, config: dict[str, Any], fragment: str) -> None:
    path = write_checkpoint(tmp_path / "model-dir", config)
    with pytest.raises(UnsupportedModelError) as info:
        ModelConfig.from_pretrained(path)
    message = str(info.value)
    assert fragment in message
    assert "model-dir" in message  # names the checkpoint


@pytest.mark.parametrize("architectures", [["GPT2LMHeadModel"], ["MixtralForCausalLM"]])
def test_unsupported_architecture_names_what_is_expected(
    tmp_path: Path, architectures: list[str]
) -> None:
    path = write_checkpoint(tmp_path / "m", legacy(architectures=architectures))
    ModelConfig.from_pretrained(path)  # the fields are fine; the registry refuses the class
    with pytest.raises(UnsupportedModelError, match=architectures[0]) as info:
        read_model_config(path)
    for name in SUPPORTED_ARCHITECTURES:
        assert name in str(info.value)


def test_every_family_is_registered() -> None:
    assert set(SUPPORTED_ARCHITECTURES) == {
        "Gemma3ForCausalLM",
        "GptOssForCausalLM",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
    }


def test_moe_architecture_needs_the_moe_fields(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "m", legacy(architectures=["Qwen3MoeForCausalLM"]))
    with pytest.raises(UnsupportedModelError, match="num_experts"):
        read_model_config(path)


def test_moe_fields(tmp_path: Path) -> None:
    raw = legacy(
        architectures=["Qwen3MoeForCausalLM"],
        num_local_experts=8,  # transformers >= 5 writes this name; checkpoints "num_experts"
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        norm_topk_prob=True,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
    )
    moe = read_model_config(write_checkpoint(tmp_path / "m", raw)).moe
    assert moe is not None
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (8, 2, 16)
    assert moe.norm_topk_prob is True
    assert [layer for layer in range(8) if moe.is_sparse(layer)] == [1, 5, 7]
    assert ModelConfig.from_pretrained(write_checkpoint(tmp_path / "d", legacy())).moe is None


@pytest.mark.parametrize(
    ("changes", "window"),
    [
        ({}, None),
        ({"use_sliding_window": False, "sliding_window": 4096}, None),
        ({"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 28}, None),
        ({"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 20}, 4096),
        (
            {
                "use_sliding_window": True,
                "layer_types": ["sliding_attention"] * 28,
                "sliding_window": 512,
            },
            512,
        ),
        ({"layer_types": ["full_attention"] * 28, "sliding_window": 512}, None),
        # transformers' Qwen3Config: no window unless use_sliding_window, whatever layer_types say
        ({"layer_types": ["sliding_attention"] * 28, "sliding_window": 512}, None),
        ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 27}, 64),
    ],
)
def test_qwen_sliding_window_fields(
    tmp_path: Path, changes: dict[str, Any], window: int | None
) -> None:
    path = write_checkpoint(tmp_path / "m", legacy(**changes))
    assert ModelConfig.from_pretrained(path).sliding_window == window


def test_mistral_window_applies_to_every_layer(tmp_path: Path) -> None:
    mistral = legacy(architectures=["MistralForCausalLM"], drop=("use_sliding_window",))
    with_window = write_checkpoint(tmp_path / "a", {**mistral, "sliding_window": 4096})
    assert ModelConfig.from_pretrained(with_window).sliding_window == 4096
    without = write_checkpoint(tmp_path / "b", {**mistral, "sliding_window": None})
    assert ModelConfig.from_pretrained(without).sliding_window is None


def test_a_window_shorter_than_max_model_len_is_served(tmp_path: Path) -> None:
    mistral = legacy(architectures=["MistralForCausalLM"], drop=("use_sliding_window",))
    config = ModelConfig.from_pretrained(
        write_checkpoint(tmp_path / "win", {**mistral, "sliding_window": 4096})
    )
    config.check_max_model_len(40960)  # sliding layers attend within their window
    assert config.layer_windows == (4096,) * 28
    assert {kind.window for kind in config.attention_kinds} == {4096}


@pytest.mark.parametrize(
    ("changes", "windows"),
    [
        (
            {
                "use_sliding_window": True,
                "layer_types": ["sliding_attention", "full_attention"] * 14,
                "sliding_window": 8,
            },
            (8, None) * 14,
        ),
        (
            {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 26},
            (None,) * 26 + (64, 64),
        ),
        ({}, ()),
    ],
)
def test_each_layer_gets_its_window(
    tmp_path: Path, changes: dict[str, Any], windows: tuple[int | None, ...]
) -> None:
    config = ModelConfig.from_pretrained(write_checkpoint(tmp_path / "m", legacy(**changes)))
    assert config.layer_windows == windows
    assert [config.attention_kind(i).window for i in range(28)] == list(windows or (None,) * 28)


def test_layer_types_of_the_wrong_length_are_refused(tmp_path: Path) -> None:
    raw = legacy(layer_types=["full_attention"] * 3, sliding_window=8)
    with pytest.raises(UnsupportedModelError, match="num_hidden_layers=28"):
        ModelConfig.from_pretrained(write_checkpoint(tmp_path / "m", raw))


def test_max_model_len_beyond_the_positions_is_refused(tmp_path: Path) -> None:
    config = ModelConfig.from_pretrained(write_checkpoint(tmp_path / "m", legacy()))
    config.check_max_model_len(40960)
    with pytest.raises(ConfigurationError, match="max_position_embeddings=40960"):
        config.check_max_model_len(40961)


@pytest.mark.parametrize(
    ("rope_scaling", "expected"),
    [
        (None, RopeScaling()),
        ({"type": "linear", "factor": 2.0}, RopeScaling("linear", 2.0, 40960)),
        ({"rope_type": "dynamic", "factor": 4}, RopeScaling("dynamic", 4.0, 40960)),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            RopeScaling("llama3", 8.0, 8192, low_freq_factor=1.0, high_freq_factor=4.0),
        ),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
            RopeScaling("yarn", 4.0, 32768),
        ),
        (
            {"rope_type": "yarn", "original_max_position_embeddings": 10240, "beta_fast": 16},
            RopeScaling("yarn", 4.0, 10240, beta_fast=16.0),
        ),
    ],
)
def test_rope_scaling_in_both_layouts(
    tmp_path: Path, rope_scaling: dict[str, Any] | None, expected: RopeScaling
) -> None:
    old = legacy(rope_scaling=rope_scaling)
    assert ModelConfig.from_pretrained(write_checkpoint(tmp_path / "a", old)).rope_scaling == (
        expected
    )
    new_params = {"rope_theta": 1e6, **(rope_scaling or {})}
    new = legacy(drop=("rope_theta", "rope_scaling"), rope_parameters=new_params)
    parsed = ModelConfig.from_pretrained(write_checkpoint(tmp_path / "b", new))
    assert parsed.rope_scaling == expected
    assert parsed.rope_theta == 1e6


def test_dynamic_rope_stretches_the_context(tmp_path: Path) -> None:
    raw = legacy(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    config = ModelConfig.from_pretrained(write_checkpoint(tmp_path / "m", raw))
    assert config.max_context_len == 2 * 40960
    config.check_max_model_len(2 * 40960)


def test_default_rope_type_is_accepted_in_both_layouts(tmp_path: Path) -> None:
    new = legacy(drop=("rope_theta",), rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    assert ModelConfig.from_pretrained(write_checkpoint(tmp_path / "a", new)).rope_theta == 5e5
    old = legacy(rope_scaling={"rope_type": "default"}, rope_theta=7e5)
    assert ModelConfig.from_pretrained(write_checkpoint(tmp_path / "b", old)).rope_theta == 7e5


def test_unreadable_json(tmp_path: Path) -> None:
    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_text("{not json")
    with pytest.raises(UnsupportedModelError, match=r"config\.json"):
        ModelConfig.from_pretrained(path)


@pytest.mark.parametrize(
    ("damage", "fragment"),
    [
        pytest.param(lambda f: f.write_text("[1, 2, 3]"), "not an object", id="json-list"),
        pytest.param(lambda f: f.write_bytes(b"\xff\xfe{}"), "cannot read", id="not-utf8"),
        pytest.param(lambda f: f.mkdir(), "cannot read", id="a-directory"),
        pytest.param(lambda f: f.symlink_to(f), "cannot read", id="symlink-loop"),
        pytest.param(lambda f: f.symlink_to(f.parent / "gone.json"), "cannot read", id="dangling"),
    ],
)
def test_unreadable_config_names_the_file_and_what_was_expected(
    tmp_path: Path, damage: Callable[[Path], object], fragment: str
) -> None:
    path = tmp_path / "m"
    path.mkdir()
    damage(path / "config.json")
    with pytest.raises(UnsupportedModelError) as info:
        ModelConfig.from_pretrained(path)
    message = str(info.value)
    assert fragment in message
    assert str(path / "config.json") in message
    assert "model's configuration" in message


def test_unreadable_generation_config_is_named(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "m", legacy())
    (path / "generation_config.json").write_text("{oops")
    with pytest.raises(UnsupportedModelError, match=r"generation_config\.json"):
        ModelConfig.from_pretrained(path)


def test_gemma3_fields_and_per_layer_type_rope(tmp_path: Path) -> None:
    raw = legacy(
        architectures=["Gemma3ForCausalLM"],
        hidden_activation="gelu_pytorch_tanh",
        drop=("hidden_act", "rope_theta"),
        layer_types=["sliding_attention"] * 27 + ["full_attention"],
        sliding_window=512,
        query_pre_attn_scalar=256,
        final_logit_softcapping=30.0,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    )
    config = ModelConfig.from_pretrained(write_checkpoint(tmp_path / "g", raw))
    assert config.hidden_act == "gelu_pytorch_tanh"
    assert (config.rope_theta, config.rope_scaling.rope_type) == (1e6, "linear")
    assert config.local_rope == (10000.0, RopeScaling())
    assert [config.uses_local_rope(i) for i in (0, 26, 27)] == [True, True, False]
    assert config.attention_scale == 256**-0.5
    assert config.final_logit_softcapping == 30.0
    older = {**raw, "rope_theta": 1e6, "rope_local_base_freq": 10000.0}
    del older["rope_parameters"]
    legacy_config = ModelConfig.from_pretrained(write_checkpoint(tmp_path / "o", older))
    assert legacy_config.local_rope == (10000.0, RopeScaling())


def test_attn_logit_softcapping_is_ignored_by_gemma3_and_applied_where_listed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = legacy(
        architectures=["Gemma3ForCausalLM"],
        layer_types=["sliding_attention", "full_attention"],
        num_hidden_layers=2,
        sliding_window=512,
        attn_logit_softcapping=50.0,
    )
    path = write_checkpoint(tmp_path / "g", raw)
    # transformers' Gemma3Attention reads the field and never applies it.
    ignored = ModelConfig.from_pretrained(path)
    assert ignored.attn_logit_softcapping is None
    assert {kind.softcap for kind in ignored.attention_kinds} == {None}
    monkeypatch.setattr(config_module, "ATTN_SOFTCAP_ARCHITECTURES", {"Gemma3ForCausalLM"})
    applied = ModelConfig.from_pretrained(path)
    assert applied.attn_logit_softcapping == 50.0
    assert [(k.window, k.softcap) for k in applied.attention_kinds] == [(512, 50.0), (None, 50.0)]
    refused = write_checkpoint(tmp_path / "z", {**raw, "attn_logit_softcapping": -1.0})
    with pytest.raises(UnsupportedModelError, match="attn_logit_softcapping"):
        ModelConfig.from_pretrained(refused)


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"hidden_act": "relu"}, "hidden_act='relu'"),
        ({"rope_parameters": {"full_attention": {}, "chunked_attention": {}}}, "per-layer-type"),
        ({"quantization_config": {"quant_method": "mxfp4"}}, "only for GptOssForCausalLM"),
    ],
)
def test_unsupported_attention_fields_are_refused(
    tmp_path: Path, changes: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(UnsupportedModelError, match=fragment):
        ModelConfig.from_pretrained(write_checkpoint(tmp_path / "m", legacy(**changes)))
