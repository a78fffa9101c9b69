"""The random checkpoints' tokenizer covers the model's whole vocabulary (issue 11.11).

It covered 640 of the demo model's 4,096 ids: most tokens a random model samples printed as
nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

from pagedinfer.adapters.models.random_checkpoint import build_random_checkpoint, build_tokenizer


def test_every_id_of_the_demo_vocabulary_decodes_to_text() -> None:
    tokenizer = build_tokenizer(4096)
    assert len(tokenizer) == 4096
    texts = [tokenizer.decode([token_id]) for token_id in range(4096)]
    assert all(texts), [i for i, text in enumerate(texts) if not text][:10]
    fillers = texts[1024:]  # past what the embedded text trains: readable ASCII fragments
    assert all(text.isascii() and text.isprintable() for text in fillers)
    assert tokenizer.decode(tokenizer.encode("Hello, world!")) == "Hello, world!"


def test_the_tokenizer_is_deterministic() -> None:
    assert build_tokenizer(2048).get_vocab() == build_tokenizer(2048).get_vocab()


def test_a_checkpoint_tokenizer_matches_the_config_vocabulary(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    directory = build_random_checkpoint(tmp_path, "tiny", with_tokenizer=True, vocab_size=1536)
    config = json.loads((directory / "config.json").read_text())
    assert len(AutoTokenizer.from_pretrained(str(directory))) == config["vocab_size"] == 1536
