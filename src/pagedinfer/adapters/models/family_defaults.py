"""What transformers' config class of each family fills in before a ``config.json`` is used.

A ``config.json`` may leave fields out (hand-written ones, or older transformers' files), and
transformers' config classes then use their own defaults, which differ per family (Gemma 3's
``head_dim`` is 256 and its global RoPE base 1e6, GPT-OSS's attention has biases, Mistral
slides over 4096 positions). Some families also derive each layer's attention kind from other
fields (Gemma 3's ``sliding_window_pattern``, Qwen's ``use_sliding_window`` +
``max_window_layers``) or ignore fields that others honour (Mistral and Qwen3-MoE ignore
``layer_types``; Llama never slides). :func:`with_family_defaults` returns the config as
transformers 5 sees it, with every windowed layer spelled out in ``layer_types``, so that
reading it (``config.py``) needs no per-family rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["TEXT_TOWERS", "text_tower", "with_family_defaults"]

SLIDING = "sliding_attention"
FULL = "full_attention"

RawConfig = dict[str, Any]


TEXT_TOWERS: dict[str, str] = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
"""Multimodal architectures whose text tower is served as this causal LM (images are not)."""

# Top-level fields of a multimodal config.json that apply to its text tower.
_SHARED_FIELDS = (
    "dtype",
    "torch_dtype",
    "tie_word_embeddings",
    "eos_token_id",
    "quantization_config",
)


def text_tower(architecture: str, raw: RawConfig) -> tuple[str, RawConfig]:
    """``(architecture, raw)`` of the model to build: a multimodal checkpoint's text tower
    (its ``text_config``, with the top-level dtype, tying and EOS ids), else unchanged."""
    causal_lm = TEXT_TOWERS.get(architecture)
    text = raw.get("text_config")
    if causal_lm is None or not isinstance(text, dict):
        return architecture, raw
    config = dict(text)
    for key in _SHARED_FIELDS:
        if raw.get(key) is not None:
            config[key] = raw[key]
    config["architectures"] = [causal_lm]
    return causal_lm, config


def with_family_defaults(architecture: str, raw: RawConfig) -> RawConfig:
    """A copy of ``raw`` with ``architecture``'s transformers defaults filled in and its
    layers' attention kinds made explicit (``layer_types``; ``None`` when no layer slides).
    Architectures without a rule come back unchanged."""
    rule = _RULES.get(architecture)
    if rule is None:
        return dict(raw)
    config = dict(raw)
    rule(config)
    return config


def _num_layers(config: RawConfig) -> int | None:
    value = config.get("num_hidden_layers")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _every_layer_slides(config: RawConfig, slides: bool) -> None:
    """Every layer slides over ``sliding_window`` (``slides``), or none does."""
    num_layers = _num_layers(config)
    if slides and num_layers is not None:
        config["layer_types"] = [SLIDING] * num_layers
    else:
        config["layer_types"] = None
        config["sliding_window"] = None


def _mistral(config: RawConfig) -> None:
    # MistralConfig: sliding_window defaults to 4096; layer_types is ignored (every layer
    # attends through the one window).
    config.setdefault("sliding_window", 4096)
    _every_layer_slides(config, config["sliding_window"] is not None)


def _no_window(config: RawConfig) -> None:
    # Llama: no sliding attention, whatever the file says.
    _every_layer_slides(config, False)


def _qwen_dense(config: RawConfig) -> None:
    # Qwen2Config / Qwen3Config: sliding_window is None unless use_sliding_window; then
    # layer_types (when given) or the layers from max_window_layers (28) on slide.
    config.setdefault("sliding_window", 4096)
    if not config.get("use_sliding_window") or config["sliding_window"] is None:
        # No window: a sliding_attention layer attends fully (other names stay, refused).
        layer_types = config.get("layer_types")
        if isinstance(layer_types, list):
            config["layer_types"] = [FULL if kind == SLIDING else kind for kind in layer_types]
        config["sliding_window"] = None
        return
    num_layers = _num_layers(config)
    first = config.get("max_window_layers", 28)
    if config.get("layer_types") is None and num_layers is not None and isinstance(first, int):
        config["layer_types"] = [SLIDING if i >= first else FULL for i in range(num_layers)]


def _qwen_moe(config: RawConfig) -> None:
    # Qwen3MoeConfig: every layer slides when use_sliding_window (max_window_layers and
    # layer_types play no part in transformers' Qwen3-MoE).
    config.setdefault("sliding_window", 4096)
    slides = bool(config.get("use_sliding_window")) and config["sliding_window"] is not None
    _every_layer_slides(config, slides)


def _gemma3(config: RawConfig) -> None:
    # Gemma3TextConfig's defaults (Gemma 3 4B's text_config names only its sizes, window and
    # rope_scaling); its gate activation is named hidden_activation.
    for key, value in (
        ("vocab_size", 262_208),
        ("hidden_size", 2304),
        ("intermediate_size", 9216),
        ("num_hidden_layers", 26),
        ("num_attention_heads", 8),
        ("head_dim", 256),
        ("query_pre_attn_scalar", 256),
        ("sliding_window", 4096),
        ("num_key_value_heads", 4),
        ("tie_word_embeddings", True),
        ("rms_norm_eps", 1e-6),
        ("max_position_embeddings", 131_072),
    ):
        config.setdefault(key, value)
    config["hidden_act"] = config.get("hidden_activation") or "gelu_pytorch_tanh"
    num_layers = _num_layers(config)
    if config.get("layer_types") is None and num_layers is not None:
        # transformers < 5 wrote sliding_window_pattern: every pattern-th layer is global.
        pattern = config.get("sliding_window_pattern", config.get("_sliding_window_pattern", 6))
        if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 1:
            config["layer_types"] = [
                SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)
            ]
    _gemma3_ropes(config)


def _gemma3_ropes(config: RawConfig) -> None:
    """Both kinds' RoPE spelled out, as Gemma3TextConfig.convert_rope_params_to_dict does.

    Each layer reads only its kind's entry of ``rope_parameters``: keys beside
    ``full_attention`` / ``sliding_attention`` (a flat ``{"rope_type": ...}``, which
    transformers keeps in the file but never applies) are dropped. The global layers' base
    defaults to 1e6 (``rope_theta``) and takes ``rope_scaling``; the local layers' to 1e4
    (``rope_local_base_freq``)."""
    params = config.get("rope_parameters")
    ropes = params if isinstance(params, dict) else {}
    full = ropes.get(FULL)
    full_rope = dict(full) if isinstance(full, dict) else {"rope_type": "default"}
    scaling = config.get("rope_scaling")
    if isinstance(scaling, dict):
        # Merged into the default entry: an old {"type": ...} without "rope_type" stays
        # "default" in transformers 5, and so here (Gemma 3's own files say rope_type).
        full_rope.update(scaling)
    full_rope.setdefault("rope_theta", config.get("rope_theta") or 1_000_000.0)
    local = ropes.get(SLIDING)
    local_rope = dict(local) if isinstance(local, dict) else {"rope_type": "default"}
    local_rope.setdefault("rope_theta", config.get("rope_local_base_freq") or 10_000.0)
    # transformers' YaRN reads `truncate` from the top level of rope_parameters, never from a
    # kind's entry: True unless a flat key beside the entries says otherwise.
    truncate = bool(ropes.get("truncate", True))
    for rope in (full_rope, local_rope):
        if rope.get("rope_type", rope.get("type")) == "yarn":
            rope["truncate"] = truncate
    config["rope_parameters"] = {FULL: full_rope, SLIDING: local_rope}


def _gpt_oss(config: RawConfig) -> None:
    # GptOssConfig's defaults: biased attention, a 128-token window on every other layer
    # (the first slides), clamped SwiGLU, YaRN over a 4096-token original context.
    for key, value in (
        ("vocab_size", 201_088),
        ("hidden_size", 2880),
        ("intermediate_size", 2880),
        ("num_hidden_layers", 36),
        ("num_attention_heads", 64),
        ("num_local_experts", 128),
        ("num_experts_per_tok", 4),
        ("attention_bias", True),
        ("sliding_window", 128),
        ("head_dim", 64),
        ("num_key_value_heads", 8),
        ("swiglu_alpha", 1.702),
        ("swiglu_limit", 7.0),
        ("rms_norm_eps", 1e-5),
        ("max_position_embeddings", 131_072),
    ):
        config.setdefault(key, value)
    num_layers = _num_layers(config)
    if config.get("layer_types") is None and num_layers is not None:
        config["layer_types"] = [SLIDING if i % 2 == 0 else FULL for i in range(num_layers)]
    if config.get("rope_parameters") is None and config.get("rope_scaling") is None:
        config["rope_parameters"] = {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
            "rope_theta": config.get("rope_theta") or 150_000.0,
        }
    elif config.get("rope_parameters") is None:
        config.setdefault("rope_theta", 150_000.0)


_RULES: dict[str, Callable[[RawConfig], None]] = {
    "Gemma3ForCausalLM": _gemma3,
    "GptOssForCausalLM": _gpt_oss,
    "LlamaForCausalLM": _no_window,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen_dense,
    "Qwen3ForCausalLM": _qwen_dense,
    "Qwen3MoeForCausalLM": _qwen_moe,
}
