"""Build checkpoints with random weights on local disk (no model hub needed).

Used by the tests, ``make demo`` and the benchmarks. ``transformers`` writes the files
(``config.json`` + safetensors), so what we load is exactly what a real checkpoint looks like.
Every supported architecture can be built (``RandomModelSpec.architecture``); the presets are
Qwen3. A small byte-level BPE tokenizer, trained on an embedded text, can be saved alongside
so that string prompts work; its outputs are meaningless because the weights are random.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ARCHITECTURE_FIELDS",
    "CHAT_TEMPLATE",
    "PRESETS",
    "RandomModelSpec",
    "build_random_checkpoint",
    "build_tokenizer",
]


@dataclass(frozen=True, slots=True)
class RandomModelSpec:
    """The shape of a random checkpoint. Fields an architecture does not have are ignored
    (see :data:`ARCHITECTURE_FIELDS`); ``rope_scaling`` is transformers' ``rope_scaling``
    dict without ``rope_theta`` (e.g. ``{"rope_type": "linear", "factor": 2.0}``)."""

    architecture: str = "Qwen3ForCausalLM"
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False  # Llama, Qwen3, Qwen3-MoE
    mlp_bias: bool = False  # Llama
    sliding_window: int | None = None  # Mistral, Gemma 3, GPT-OSS
    # Gemma 3 / GPT-OSS: each layer's attention ("sliding_attention" / "full_attention")
    layer_types: tuple[str, ...] | None = None
    query_pre_attn_scalar: int = 32  # Gemma 3
    rope_local_base_freq: float = 10000.0  # Gemma 3's sliding layers
    final_logit_softcapping: float | None = None  # Gemma 3
    # Qwen3-MoE
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    num_local_experts: int = 4  # GPT-OSS (experts of intermediate_size features)
    # Larger than transformers' default 0.02 so that greedy argmax gaps are comfortably
    # above float32 rounding noise in parity tests.
    initializer_range: float = 0.1
    dtype: str = "float32"
    eos_token_id: int | None = None


_COMMON_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
    "max_position_embeddings",
    "rms_norm_eps",
    "initializer_range",
)
_MOE_FIELDS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
)
ARCHITECTURE_FIELDS: dict[str, tuple[str, ...]] = {
    "GptOssForCausalLM": (
        *_COMMON_FIELDS,
        "attention_bias",
        "sliding_window",
        "layer_types",
        "num_local_experts",
        "num_experts_per_tok",
    ),
    "LlamaForCausalLM": (*_COMMON_FIELDS, "attention_bias", "mlp_bias"),
    "MistralForCausalLM": (*_COMMON_FIELDS, "sliding_window"),
    "Gemma3ForCausalLM": (
        *_COMMON_FIELDS,
        "attention_bias",
        "sliding_window",
        "layer_types",
        "query_pre_attn_scalar",
        "rope_local_base_freq",
        "final_logit_softcapping",
    ),
    "Qwen2ForCausalLM": _COMMON_FIELDS,
    "Qwen3ForCausalLM": (*_COMMON_FIELDS, "attention_bias"),
    "Qwen3MoeForCausalLM": (*_COMMON_FIELDS, "attention_bias", *_MOE_FIELDS),
}
"""The spec fields each architecture's transformers config receives."""


PRESETS: dict[str, RandomModelSpec] = {
    # Unit and parity tests: milliseconds per step on a CPU.
    "tiny": RandomModelSpec(),
    # CPU demo and CPU benchmark: small enough for 2 cores, large enough to be bound by compute.
    "small": RandomModelSpec(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        rope_theta=1_000_000.0,
        initializer_range=0.02,
    ),
    # Qwen3-0.6B's shape (28 layers, hidden 1024, 16/8 heads, head_dim 128, vocab 151936, tied).
    "qwen3-0.6b": RandomModelSpec(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=1_000_000.0,
        max_position_embeddings=40960,
        initializer_range=0.02,
        dtype="bfloat16",
        eos_token_id=151645,
    ),
}


def build_random_checkpoint(
    path: str | Path,
    spec: RandomModelSpec | str = "tiny",
    *,
    seed: int = 0,
    with_tokenizer: bool = False,
    **overrides: Any,
) -> Path:
    """Write a random-weight checkpoint to ``path`` and return it.

    ``spec`` is a :class:`RandomModelSpec` or a preset name; keyword ``overrides`` replace
    fields of it (``architecture="LlamaForCausalLM"``, ``num_key_value_heads=4``, ...). With
    ``with_tokenizer=True`` a small BPE tokenizer is saved too (its vocabulary is exactly
    ``vocab_size`` ids, so every sampled id decodes; ``vocab_size`` must then be >= 512).
    """
    import transformers

    base = PRESETS[spec] if isinstance(spec, str) else spec
    spec = replace(base, **overrides)
    if spec.architecture not in ARCHITECTURE_FIELDS:
        raise ValueError(
            f"cannot build a random {spec.architecture!r}: expected one of "
            f"{', '.join(ARCHITECTURE_FIELDS)}"
        )
    model_class: Any = getattr(transformers, spec.architecture)
    target = Path(path)
    target.mkdir(parents=True, exist_ok=True)
    eos = spec.eos_token_id
    if with_tokenizer:
        tokenizer = build_tokenizer(spec.vocab_size)
        tokenizer.save_pretrained(str(target))
        eos = tokenizer.eos_token_id
    fields = {name: getattr(spec, name) for name in ARCHITECTURE_FIELDS[spec.architecture]}
    if "mlp_only_layers" in fields:
        fields["mlp_only_layers"] = list(spec.mlp_only_layers)
    if fields.get("layer_types") is not None:
        fields["layer_types"] = list(fields["layer_types"])
    # rope_theta + rope_scaling: transformers >= 5 folds both into rope_parameters.
    config = model_class.config_class(
        **fields,
        rope_theta=spec.rope_theta,
        rope_scaling=dict(spec.rope_scaling) if spec.rope_scaling is not None else None,
        eos_token_id=eos,
        bos_token_id=eos,
    )
    torch.manual_seed(seed)
    dtype = getattr(torch, spec.dtype)
    large = spec.num_hidden_layers > 8
    with torch.device("meta" if large else "cpu"):
        model = model_class(config)
    if large:  # large shapes: skip transformers' slow init, fill directly
        model = model.to_empty(device="cpu")
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, spec.initializer_range, generator=generator)
    # Parameters transformers starts at 0 where that would hide them: Gemma's (1 + w) norms,
    # GPT-OSS's biases; GPT-OSS's sinks at the scale of attention scores.
    perturbed = {"Gemma3ForCausalLM": ("norm.weight",), "GptOssForCausalLM": ("bias", "sinks")}
    suffixes = perturbed.get(spec.architecture, ())
    if suffixes:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(suffixes):
                    std = 1.0 if name.endswith("sinks") else spec.initializer_range
                    param.normal_(0.0, std, generator=generator)
    model = model.to(dtype)
    model.config.dtype = dtype
    model.save_pretrained(str(target))
    return target


_CORPUS = """
Paged attention stores the key and value cache in fixed size blocks, like pages of virtual
memory. A block table maps each sequence's logical blocks to physical blocks. Prefix caching
shares the blocks of a common prompt prefix between requests. The scheduler admits waiting
requests while memory allows, prefills their prompts, then decodes one token per step for
every running request. When memory runs out, the newest request is preempted and recomputed
later. Continuous batching keeps the accelerator busy. The quick brown fox jumps over the lazy
dog. Once upon a time there was a small language model that answered every question with
random words, because its weights were random. Hello, world! How are you today? What is the
capital of France? Write a short poem about the sea. Explain how a transformer works.
0 1 2 3 4 5 6 7 8 9 10 100 1000 + - * / = ( ) [ ] { } < > , . ; : ! ? ' "
"""


def build_tokenizer(vocab_size: int = 1024) -> Any:
    """A byte-level BPE tokenizer with exactly ``vocab_size`` ids, every one of which decodes
    to text (fast, deterministic).

    It is trained on a short embedded text, which yields a few hundred tokens; the rest of
    the vocabulary is filled with merges of two trained tokens (so a random model's samples
    print as words, not as nothing). Those filler tokens decode normally but encoding plain
    text rarely produces them.
    """
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    if tokenizer.get_vocab_size() < vocab_size:
        model = json.loads(tokenizer.to_str())["model"]
        vocab, merges = _fill_vocabulary(model["vocab"], model["merges"], vocab_size)
        filled = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        filled.pre_tokenizer = tokenizer.pre_tokenizer
        filled.decoder = tokenizer.decoder
        filled.add_special_tokens(["<|endoftext|>"])
        tokenizer = filled
    fast_tokenizer: Any = PreTrainedTokenizerFast  # untyped constructor
    result = fast_tokenizer(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        bos_token="<|endoftext|>",
    )
    result.chat_template = CHAT_TEMPLATE
    return result


def _fill_vocabulary(
    vocab: dict[str, int], merges: list[Any], vocab_size: int
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Add merges of two trained tokens, drawn with a fixed seed, until ``vocab_size`` ids."""
    import random

    from tokenizers.pre_tokenizers import ByteLevel

    vocab = dict(vocab)
    merged: list[tuple[str, str]] = []
    for merge in merges:
        first, second = merge.split(" ") if isinstance(merge, str) else merge
        merged.append((first, second))
    # Pieces of printable ASCII text only, so that the filler tokens print as readable
    # fragments. Each filler token becomes a piece too, so the supply never runs out.
    printable = {char for char in ByteLevel.alphabet() if 0x20 <= _byte_of(char) < 0x7F}
    pieces = [
        token
        for token, _ in sorted(vocab.items(), key=lambda item: item[1])
        if not token.startswith("<|") and set(token) <= printable
    ]
    rng = random.Random(0)
    while len(vocab) < vocab_size:
        first, second = rng.choice(pieces), rng.choice(pieces)
        if first + second not in vocab:
            vocab[first + second] = len(vocab)
            merged.append((first, second))
            if len(first + second) <= 8:  # short pieces keep the tokenizer fast to load
                pieces.append(first + second)
    return vocab, merged


def _byte_of(char: str) -> int:
    """The byte a byte-level BPE alphabet character stands for (GPT-2's bytes_to_unicode)."""
    code = ord(char)
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    if code in printable:
        return code
    return [byte for byte in range(256) if byte not in printable][code - 256]


# ChatML, as Qwen's checkpoints use it, so that chat() and /v1/chat/completions work on the
# random checkpoints. The markers are plain text to this small vocabulary.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
