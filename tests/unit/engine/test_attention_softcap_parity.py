"""Attention-logit softcapping through the engine, token for token against transformers.

transformers' Gemma 3 reads ``attn_logit_softcapping`` and never applies it (its
``Gemma3Attention`` passes no ``softcap`` to the attention), so a Gemma 3 checkpoint that
sets it must generate what transformers generates with the cap ignored. The capped path
itself (every layer's ``softcap`` through the backends, sliding and full layers, prefix
caching and chunked prefill) is checked against transformers' eager attention made to apply
the cap, with Gemma 3 listed as an architecture that applies it.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_reference import hf_greedy
from pagedinfer import Engine, SamplingParams
from pagedinfer.adapters.models import config as config_module

CAP = 0.5  # small next to the scores of the tiny model: capping changes its logits a lot
MAX_TOKENS = 8
VOCAB = 256
GEMMA3 = {
    "architecture": "Gemma3ForCausalLM",
    "num_hidden_layers": 2,
    "layer_types": ("sliding_attention", "full_attention"),
    "sliding_window": 8,
    "query_pre_attn_scalar": 24,
    "tie_word_embeddings": False,
    "vocab_size": VOCAB,
}


@pytest.fixture(scope="module")
def capped_checkpoint(
    make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tiny Gemma 3 with ``attn_logit_softcapping`` set in its config.json."""
    source = make_checkpoint("tiny", **GEMMA3)
    target = tmp_path_factory.mktemp("gemma3-softcap") / "model"
    shutil.copytree(source, target)
    config_path = target / "config.json"
    config = json.loads(config_path.read_text())
    config["attn_logit_softcapping"] = CAP
    config_path.write_text(json.dumps(config))
    return target


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(VOCAB) for _ in range(40)]
    return [[*shared, *(rng.randrange(VOCAB) for _ in range(n))] for n in (3, 11)]


def generate(checkpoint: Path) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with Engine(
        checkpoint, device="cpu", kv_block_size=16, max_model_len=96,
        max_num_batched_tokens=24,  # chunked prefill
    ) as engine:  # fmt: skip
        # One at a time: the second prompt hits the first's cached blocks.
        outputs = [engine.generate([p], params, use_tqdm=False)[0] for p in prompts()]
    assert outputs[1].num_cached_tokens >= 32
    return [list(output.outputs[0].token_ids) for output in outputs]


def capped_reference(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """transformers' greedy tokens with its eager attention applying each layer's cap."""
    from transformers import AutoModelForCausalLM
    from transformers.models.gemma3 import modeling_gemma3

    eager = modeling_gemma3.eager_attention_forward

    def capped(module: Any, *args: Any, **kwargs: Any) -> Any:
        return eager(module, *args, softcap=module.attn_logit_softcapping, **kwargs)

    monkeypatch.setattr(modeling_gemma3, "eager_attention_forward", capped)
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokens = []
    for prompt in prompts():
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0,
            )  # fmt: skip
        tokens.append([int(t) for t in out[0, len(prompt) :]])
    return tokens


def test_gemma3_ignores_attn_logit_softcapping_like_transformers(capped_checkpoint: Path) -> None:
    expected = [hf_greedy(capped_checkpoint, prompt, MAX_TOKENS) for prompt in prompts()]
    assert generate(capped_checkpoint) == expected


def test_capped_attention_matches_transformers_eager_softcap(
    capped_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = capped_reference(capped_checkpoint, monkeypatch)
    uncapped = [hf_greedy(capped_checkpoint, prompt, MAX_TOKENS) for prompt in prompts()]
    assert expected != uncapped  # the cap matters for this model: the test can fail
    monkeypatch.setattr(config_module, "ATTN_SOFTCAP_ARCHITECTURES", {"Gemma3ForCausalLM"})
    assert generate(capped_checkpoint) == expected
