"""What pagedinfer needs to know about a checkpoint, read from its ``config.json``.

Both ``config.json`` layouts in the wild are understood: transformers < 5 writes ``rope_theta``,
``rope_scaling`` and ``torch_dtype`` at the top level; transformers >= 5 writes
``rope_parameters: {rope_theta, rope_type, ...}`` and ``dtype``. EOS ids come from
``generation_config.json`` when it names them (that is what ``generate`` stops on), else from
``config.json``; either may hold one id or a list.

This module reads and validates fields; it does not know which architectures exist (the
registry, ``models/registry.py``, decides that and imports this module, never the reverse).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeGuard

import torch

from pagedinfer.adapters.attention.base import LayerAttentionKind
from pagedinfer.adapters.layers.rotary import ROPE_TYPES, RopeScaling
from pagedinfer.adapters.models.family_defaults import text_tower, with_family_defaults
from pagedinfer.adapters.quantization import QuantizationConfig, parse_quantization_config
from pagedinfer.errors import CheckpointNotFoundError, ConfigurationError, UnsupportedModelError

__all__ = ["HIDDEN_ACTIVATIONS", "ModelConfig", "MoeConfig"]

HIDDEN_ACTIVATIONS: tuple[str, ...] = ("silu", "gelu_pytorch_tanh")
"""The MLP gate activations served: SwiGLU's SiLU; Gemma's GELU (tanh approximation)."""

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """The sparse-MoE fields of ``config.json`` (Qwen3-MoE)."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]

    def is_sparse(self, layer: int) -> bool:
        """True when decoder layer ``layer`` uses the experts, False for a dense MLP."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


_CLASSIFIER = "ForSequenceClassification"
# Architectures whose attention caps its scores with `attn_logit_softcapping` (transformers'
# eager attention with `softcap`), and those whose config has the field but whose modeling
# code never applies it (transformers' Gemma3Attention passes no softcap; nor does vLLM).
ATTN_SOFTCAP_ARCHITECTURES: frozenset[str] = frozenset()
ATTN_SOFTCAP_IGNORED = frozenset({"Gemma3ForCausalLM"})


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The architecture hyper-parameters of one checkpoint directory.

    ``sliding_window`` is the attention window of the layers that have one (``None``: every
    layer attends to its whole context) and ``layer_windows`` each layer's window (``None``
    for a full-attention layer; empty when no layer slides); ``attention_sinks``: every
    layer has learned sinks (GPT-OSS). ``moe`` is set for mixture-of-experts checkpoints;
    ``quantization`` for quantized checkpoints (``config.json``'s ``quantization_config``,
    see ``adapters/quantization``).
    """

    path: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    moe: MoeConfig | None
    dtype: torch.dtype  # the checkpoint's dtype ("auto" resolves to it)
    eos_token_ids: tuple[int, ...]
    quantization: QuantizationConfig | None = None
    layer_windows: tuple[int | None, ...] = ()
    attention_sinks: bool = False
    # The sliding layers' own RoPE (theta, scaling); None: every layer uses the one above.
    local_rope: tuple[float, RopeScaling] | None = None
    hidden_act: str = "silu"  # the MLP gate's activation (HIDDEN_ACTIVATIONS)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (Gemma)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # Attention scores = cap * tanh(scores / cap), in every layer (LayerAttentionKind.softcap).
    attn_logit_softcapping: float | None = None
    swiglu_alpha: float | None = None  # GPT-OSS experts: gate * sigmoid(alpha * gate)
    swiglu_limit: float | None = None  # GPT-OSS experts: gate and up clamped to this

    def uses_local_rope(self, layer: int) -> bool:
        """True when decoder layer ``layer`` rotates with :attr:`local_rope`."""
        return self.local_rope is not None and self.attention_kind(layer).is_sliding

    @property
    def attention_scale(self) -> float:
        """The softmax scale of the attention scores."""
        base = self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
        return float(base**-0.5)

    def attention_kind(self, layer: int) -> LayerAttentionKind:
        """How decoder layer ``layer`` attends (its window, its sinks)."""
        window = self.layer_windows[layer] if self.layer_windows else None
        return LayerAttentionKind(
            window=window, has_sinks=self.attention_sinks, softcap=self.attn_logit_softcapping
        )

    @property
    def attention_kinds(self) -> tuple[LayerAttentionKind, ...]:
        """Every decoder layer's :class:`LayerAttentionKind`, in order: what a KV manager
        groups layers by."""
        return tuple(self.attention_kind(layer) for layer in range(self.num_hidden_layers))

    @property
    def max_context_len(self) -> int:
        """The longest sequence the model can position: ``max_position_embeddings``, or that
        times ``factor`` for dynamic NTK RoPE (whose purpose is to stretch the context)."""
        if self.rope_scaling.rope_type == "dynamic":
            return int(self.max_position_embeddings * self.rope_scaling.factor)
        return self.max_position_embeddings

    def check_max_model_len(self, max_model_len: int) -> None:
        """Raise :class:`ConfigurationError` unless sequences of ``max_model_len`` tokens can
        be served exactly (sliding windows of any length are: each such layer attends within
        its window)."""
        if max_model_len > self.max_context_len:
            raise ConfigurationError(
                f"max_model_len={max_model_len} exceeds the model's context of "
                f"{self.max_context_len} positions (max_position_embeddings="
                f"{self.max_position_embeddings}): lower max_model_len."
            )

    def check_tensor_parallel(self, world_size: int) -> None:
        """Raise :class:`ConfigurationError` unless every split dimension divides evenly."""
        checks = [
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("vocab_size", self.vocab_size),
        ]
        moe = self.moe
        if moe is None or not all(moe.is_sparse(i) for i in range(self.num_hidden_layers)):
            checks.append(("intermediate_size", self.intermediate_size))
        if moe is not None:
            checks.append(("moe_intermediate_size", moe.moe_intermediate_size))
        for what, total in checks:
            if total % world_size:
                raise ConfigurationError(
                    f"{what}={total} is not divisible by tensor_parallel_size={world_size}: "
                    f"choose a tensor_parallel_size that divides {total}."
                )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read ``path/config.json`` (and ``generation_config.json`` if present).

        Raises :class:`CheckpointNotFoundError` if ``path`` is not a directory and
        :class:`UnsupportedModelError` if its config cannot be read or is not one this
        library can run (the architecture name is checked by the registry).
        """
        root = Path(path)
        if not root.is_dir():
            raise CheckpointNotFoundError(_missing_checkpoint_message(str(path)))
        config_file = root / "config.json"
        if not (config_file.exists() or config_file.is_symlink()):
            raise UnsupportedModelError(
                f"checkpoint {str(root)!r} has no config.json: expected a Hugging Face "
                "checkpoint directory (config.json + *.safetensors)."
            )
        raw = _read_json(config_file, "the model's configuration")
        generation_file = root / "generation_config.json"
        generation = (
            _read_json(generation_file, "the generation settings")
            if generation_file.exists() or generation_file.is_symlink()
            else None
        )
        return cls.from_dict(raw, root, generation)

    @classmethod
    def from_dict(
        cls,
        raw: dict[str, Any],
        path: Path,
        generation: dict[str, Any] | None = None,
    ) -> ModelConfig:
        """Validate a parsed ``config.json`` (``path`` is only used in error messages)."""
        architecture = _Reader(raw, path).architecture()
        # A sequence classifier (Qwen3ForSequenceClassification, ...) is its causal LM's
        # decoder with a `score` head that the pooling engine applies (engine/pooling_setup.py);
        # its missing LM head is tied to the embedding, which pooling never uses.
        classifier = architecture.endswith(_CLASSIFIER)
        if classifier:
            architecture = architecture.removesuffix(_CLASSIFIER) + "ForCausalLM"
        # A multimodal checkpoint's text tower (Gemma3ForConditionalGeneration); then the
        # fields transformers' config class fills in, each layer's attention explicit.
        architecture, raw = text_tower(architecture, raw)
        raw = with_family_defaults(architecture, raw)
        reader = _Reader(raw, path)
        if raw.get("use_bidirectional_attention"):
            reader.fail(
                "use_bidirectional_attention=true (every token attends to the whole input, "
                "EmbeddingGemma's encoder) is not supported: pagedinfer serves causal decoders "
                "only; use a causal Gemma 3 checkpoint (use_bidirectional_attention false)"
            )
        num_heads = reader.integer("num_attention_heads")
        hidden_size = reader.integer("hidden_size")
        num_layers = reader.integer("num_hidden_layers")
        head_dim = reader.optional_integer("head_dim")
        if head_dim is None:
            if hidden_size % num_heads:
                reader.fail(
                    f"hidden_size={hidden_size} is not divisible by num_attention_heads="
                    f"{num_heads} and config.json has no head_dim"
                )
            head_dim = hidden_size // num_heads
        num_kv_heads = reader.integer("num_key_value_heads", default=num_heads)
        if num_heads % num_kv_heads:
            reader.fail(
                f"num_attention_heads={num_heads} is not a multiple of "
                f"num_key_value_heads={num_kv_heads}"
            )
        # Gemma names it hidden_activation (family_defaults copies it to hidden_act).
        hidden_act = raw.get("hidden_act") or "silu"
        if hidden_act not in HIDDEN_ACTIVATIONS:
            reader.fail(
                f"hidden_act={hidden_act!r} is not supported: expected one of "
                f"{', '.join(repr(name) for name in HIDDEN_ACTIVATIONS)}"
            )
        attn_softcap = reader.attn_logit_softcapping(architecture)
        max_positions = reader.integer("max_position_embeddings")
        (rope_theta, rope_scaling), local_rope = reader.ropes(max_positions)
        eos = _token_ids(generation.get("eos_token_id") if generation else None)
        layer_windows = reader.layer_windows(num_layers)
        return cls(
            path=path,
            architecture=architecture,
            vocab_size=reader.integer("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=reader.integer("intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=reader.number("rms_norm_eps", default=1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=classifier or reader.flag("tie_word_embeddings"),
            attention_bias=reader.flag("attention_bias"),
            mlp_bias=reader.flag("mlp_bias"),
            sliding_window=max((w for w in layer_windows if w is not None), default=None),
            moe=reader.moe(num_layers),
            dtype=reader.dtype(),
            eos_token_ids=eos or _token_ids(raw.get("eos_token_id")),
            quantization=parse_quantization_config(
                raw.get("quantization_config"), path, architecture
            ),
            layer_windows=layer_windows,
            local_rope=local_rope,
            hidden_act=str(hidden_act),
            query_pre_attn_scalar=reader.optional_number("query_pre_attn_scalar"),
            final_logit_softcapping=reader.optional_number("final_logit_softcapping"),
            attn_logit_softcapping=attn_softcap,
            swiglu_alpha=reader.optional_number("swiglu_alpha"),
            swiglu_limit=reader.optional_number("swiglu_limit"),
        )


class _Reader:
    """Typed access to ``config.json`` fields with errors that name the file and the field."""

    def __init__(self, raw: dict[str, Any], path: Path) -> None:
        self.raw = raw
        self.path = path

    def fail(self, problem: str) -> NoReturn:
        raise UnsupportedModelError(f"checkpoint {str(self.path)!r}: {problem}.")

    def attn_logit_softcapping(self, architecture: str) -> float | None:
        """The attention-logit cap the model applies (``attn_logit_softcapping``), ``None``
        for none: as transformers does, per architecture (:data:`ATTN_SOFTCAP_ARCHITECTURES`
        apply it; Gemma 3's modeling code reads the field and never applies it, so it is
        ignored there); refused for the other architectures."""
        value = self.raw.get("attn_logit_softcapping")
        if value is None:
            return None
        if architecture in ATTN_SOFTCAP_ARCHITECTURES:
            return self.optional_number("attn_logit_softcapping")  # > 0, or refused
        if architecture in ATTN_SOFTCAP_IGNORED:
            return None
        self.fail(
            f"attn_logit_softcapping={value!r} is not supported for {architecture} "
            "(capped attention scores): expected null"
        )

    def architecture(self) -> str:
        architectures = self.raw.get("architectures")
        if (
            not isinstance(architectures, list)
            or not architectures
            or not all(isinstance(name, str) for name in architectures)
        ):
            self.fail(
                f"config.json names no 'architectures' (got {architectures!r}); expected a "
                "list with the model class name, e.g. ['LlamaForCausalLM']"
            )
        return str(architectures[0])

    def integer(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        value = self.raw.get(key, default)
        if value is None:
            self.fail(f"config.json has no {key!r}")
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            self.fail(f"{key}={value!r} is invalid: expected an integer >= {minimum}")
        return value

    def optional_integer(self, key: str) -> int | None:
        return None if self.raw.get(key) is None else self.integer(key)

    def optional_number(self, key: str) -> float | None:
        value = self.raw.get(key)
        return None if value is None else self.number(key, default=1.0)

    def number(self, key: str, default: float) -> float:
        value = self.raw.get(key, default)
        if not _is_positive_number(value):
            self.fail(f"{key}={value!r} is invalid: expected a positive number")
        return float(value)

    def flag(self, key: str) -> bool:
        value = self.raw.get(key, False)
        if value is None:
            return False
        if not isinstance(value, bool):
            self.fail(f"{key}={value!r} is invalid: expected true or false")
        return value

    def ropes(
        self, max_positions: int
    ) -> tuple[tuple[float, RopeScaling], tuple[float, RopeScaling] | None]:
        """The RoPE of the layers (of full-attention layers when the sliding ones have their
        own) and the sliding layers' own RoPE (``None``: the same). Gemma 3 gives sliding
        layers another base: ``rope_parameters: {full_attention: {...}, sliding_attention:
        {...}}`` (transformers >= 5) or ``rope_local_base_freq`` (older)."""
        params = self.raw.get("rope_parameters")
        if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
            unknown = sorted(set(params) - {"full_attention", "sliding_attention"})
            if unknown or not all(isinstance(v, dict) for v in params.values()):
                self.fail(
                    f"rope_parameters={params!r} is not supported: per-layer-type RoPE must "
                    "map 'full_attention' and 'sliding_attention' to their parameters"
                )
            full = self._one_rope(dict(params.get("full_attention") or {}), max_positions)
            sliding = params.get("sliding_attention")
            if sliding is None:
                return full, None
            return full, self._one_rope(dict(sliding), max_positions)
        main = self.rope(max_positions)
        local_base = self.raw.get("rope_local_base_freq")
        if local_base is None:
            return main, None
        if not _is_positive_number(local_base):
            self.fail(f"rope_local_base_freq={local_base!r} is invalid: expected a positive number")
        return main, (float(local_base), RopeScaling())

    def rope(self, max_positions: int) -> tuple[float, RopeScaling]:
        # transformers >= 5: rope_parameters; older: top-level rope_theta + rope_scaling.
        params = self.raw.get("rope_parameters")
        if params is None:
            scaling = self.raw.get("rope_scaling")
            if scaling is not None and not isinstance(scaling, dict):
                self.fail(f"rope_scaling={scaling!r} is invalid: expected an object or null")
            params = dict(scaling or {})
            params.setdefault("rope_theta", self.raw.get("rope_theta", 10000.0))
        if not isinstance(params, dict):
            self.fail(f"rope_parameters={params!r} is invalid: expected an object")
        return self._one_rope(params, max_positions)

    def _one_rope(self, params: dict[str, Any], max_positions: int) -> tuple[float, RopeScaling]:
        theta = params.get("rope_theta", self.raw.get("rope_theta", 10000.0))
        if not _is_positive_number(theta):
            self.fail(f"rope_theta={theta!r} is invalid: expected a positive number")
        partial = params.get("partial_rotary_factor", self.raw.get("partial_rotary_factor"))
        if partial not in (None, 1, 1.0):
            self.fail(f"partial_rotary_factor={partial!r} is not supported: expected 1.0")
        return float(theta), self._rope_scaling(params, max_positions)

    def _rope_scaling(self, params: dict[str, Any], max_positions: int) -> RopeScaling:
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            self.fail(
                f"rope type {rope_type!r} is not supported: expected one of "
                f"{', '.join(repr(name) for name in ROPE_TYPES)}"
            )
        if rope_type == "default":
            return RopeScaling()

        def number(key: str) -> float:
            value = params.get(key)
            if not _is_positive_number(value):
                self.fail(
                    f"{rope_type!r} RoPE needs a positive number {key!r} in rope_parameters "
                    f"(rope_scaling), got {value!r}"
                )
            return float(value)

        def optional_number(key: str) -> float | None:
            return None if params.get(key) is None else number(key)

        original = params.get(
            "original_max_position_embeddings",
            self.raw.get("original_max_position_embeddings", max_positions),
        )
        if rope_type == "dynamic":
            original = max_positions  # transformers grows the base beyond max_position_embeddings
        if not isinstance(original, int) or isinstance(original, bool) or original < 1:
            self.fail(
                f"original_max_position_embeddings={original!r} is invalid: expected an "
                "integer >= 1"
            )
        if rope_type == "yarn":
            # Without a factor, transformers stretches the original context to the full one.
            factor = max_positions / original if params.get("factor") is None else number("factor")
            return RopeScaling(
                rope_type="yarn",
                factor=factor,
                original_max_position_embeddings=original,
                beta_fast=optional_number("beta_fast") or 32.0,
                beta_slow=optional_number("beta_slow") or 1.0,
                attention_factor=optional_number("attention_factor"),
                mscale=optional_number("mscale"),
                mscale_all_dim=optional_number("mscale_all_dim"),
                truncate=bool(params.get("truncate", True)),
            )
        factor = number("factor")
        if rope_type == "llama3":
            low, high = number("low_freq_factor"), number("high_freq_factor")
            if high <= low:
                self.fail(
                    f"llama3 RoPE needs high_freq_factor > low_freq_factor, got {high} <= {low}"
                )
            return RopeScaling(
                rope_type="llama3",
                factor=factor,
                original_max_position_embeddings=original,
                low_freq_factor=low,
                high_freq_factor=high,
            )
        return RopeScaling(
            rope_type=rope_type, factor=factor, original_max_position_embeddings=original
        )

    def dtype(self) -> torch.dtype:
        name = self.raw.get("dtype", self.raw.get("torch_dtype")) or "float32"
        if isinstance(name, str):
            name = name.removeprefix("torch.")
        if name not in _DTYPES:
            self.fail(
                f"dtype {name!r} is not supported: expected one of float32, float16, bfloat16"
            )
        return _DTYPES[name]

    def layer_types(self, num_layers: int) -> list[str] | None:
        """``layer_types`` (transformers >= 5 names each layer's attention), checked."""
        layer_types = self.raw.get("layer_types")
        if layer_types is None:
            return None
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            self.fail(
                f"layer_types={layer_types!r} is invalid: expected a list of "
                f"num_hidden_layers={num_layers} names"
            )
        unknown = sorted(
            {str(kind) for kind in layer_types} - {"full_attention", "sliding_attention"}
        )
        if unknown:
            self.fail(
                f"layer_types {unknown} are not supported: expected 'full_attention' or "
                "'sliding_attention'"
            )
        return [str(kind) for kind in layer_types]

    def layer_windows(self, num_layers: int) -> tuple[int | None, ...]:
        """Each layer's sliding window (``None``: full attention); ``()`` when none slides."""
        window = self.raw.get("sliding_window")
        layer_types = self.layer_types(num_layers)
        if layer_types is not None:
            slides = [kind == "sliding_attention" for kind in layer_types]
        elif "use_sliding_window" in self.raw:
            # Qwen2/Qwen3 (transformers < 5): layers from max_window_layers on slide.
            first = self.raw.get("max_window_layers") or 0
            on = bool(self.raw["use_sliding_window"]) and window is not None
            on = on and isinstance(first, int)
            slides = [on and layer >= first for layer in range(num_layers)]
        else:  # Mistral: a window, when set, applies to every layer
            slides = [window is not None] * num_layers
        if not any(slides):
            return ()
        size = self.integer("sliding_window")
        return tuple(size if slide else None for slide in slides)

    def moe(self, num_layers: int) -> MoeConfig | None:
        key = "num_experts" if "num_experts" in self.raw else "num_local_experts"
        if not self.raw.get(key):
            return None
        num_experts = self.integer(key)
        top_k = self.integer("num_experts_per_tok")
        if top_k > num_experts:
            self.fail(f"num_experts_per_tok={top_k} exceeds {key}={num_experts}")
        only_dense = self.raw.get("mlp_only_layers") or []
        if not isinstance(only_dense, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers
            for i in only_dense
        ):
            self.fail(
                f"mlp_only_layers={only_dense!r} is invalid: expected a list of layer indices "
                f"below num_hidden_layers={num_layers}"
            )
        return MoeConfig(
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            # GPT-OSS: every expert has intermediate_size features.
            moe_intermediate_size=self.integer(
                "moe_intermediate_size", default=self.raw.get("intermediate_size")
            ),
            norm_topk_prob=self.flag("norm_topk_prob"),
            decoder_sparse_step=self.integer("decoder_sparse_step", default=1),
            mlp_only_layers=tuple(only_dense),
        )


def _is_positive_number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UnsupportedModelError(
            f"cannot read {str(path)!r}: {error}; expected a JSON file with {what}."
        ) from error
    if not isinstance(data, dict):
        raise UnsupportedModelError(
            f"{str(path)!r} holds a JSON {type(data).__name__}, not an object: expected a JSON "
            f"object with {what}."
        )
    return data


def _token_ids(value: object) -> tuple[int, ...]:
    """An id, a list of ids or None -> a tuple without duplicates (order kept)."""
    values = value if isinstance(value, list) else [value]
    ids = [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
    return tuple(dict.fromkeys(ids))


def _missing_checkpoint_message(path: str) -> str:
    """Why ``path`` cannot be loaded; a hub-style id gets told how to download it first."""
    looks_like_hub_id = (
        path.count("/") == 1
        and not path.startswith(("/", ".", "~"))
        and all(part and not part.startswith(".") for part in path.split("/"))
        and not Path(path).exists()
    )
    if looks_like_hub_id:
        name = path.split("/")[1]
        return (
            f"model {path!r} is not a local directory. It looks like a Hugging Face Hub id, "
            "but pagedinfer only loads local checkpoint directories: download the checkpoint "
            f"first (e.g. `hf download {path} --local-dir ./{name}`, the CLI of huggingface_hub, "
            "or huggingface_hub.snapshot_download) and pass that directory "
            f"(Engine(model='./{name}'))."
        )
    return (
        f"model path {path!r} does not exist or is not a directory: expected a local Hugging "
        "Face checkpoint directory (config.json + *.safetensors)."
    )
