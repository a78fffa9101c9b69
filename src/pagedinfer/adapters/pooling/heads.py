"""Classification heads read from a checkpoint, for a pooling model's ``classify`` / ``score``.

* A sequence classifier (``Qwen3ForSequenceClassification``, ``LlamaForSequenceClassification``,
  ...) stores its head as ``score.weight`` (``[num_labels, hidden]``).
* A causal LM used as a classifier from tokens (vLLM's ``classifier_from_token``, e.g.
  Qwen3-Reranker's ``["no", "yes"]``): the LM head's rows of those tokens (the embedding's
  when the LM head is tied). With ``is_original_qwen3_reranker`` the two rows become one,
  ``yes - no``: its sigmoid is the softmax of ``[no, yes]`` at ``yes``.

The weights come back in float32 on the CPU; the engine applies them to the pooled rows.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from pagedinfer.adapters.models.loader import checkpoint_files
from pagedinfer.errors import UnsupportedModelError

__all__ = ["read_head_rows"]


def read_head_rows(
    path: str | Path, names: tuple[str, ...], rows: list[int] | None
) -> torch.Tensor:
    """The first tensor of ``names`` found in the checkpoint at ``path`` (all its rows, or
    ``rows``), float32 on the CPU."""
    root = Path(path)
    for file in checkpoint_files(root):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            keys = set(handle.keys())
            for name in names:
                if name in keys:
                    if rows is None:
                        tensor: torch.Tensor = handle.get_tensor(name)
                    else:
                        whole = handle.get_slice(name)
                        tensor = torch.stack([whole[row : row + 1][0] for row in rows])
                    return tensor.to(torch.float32)
    raise UnsupportedModelError(
        f"checkpoint {str(root)!r} has none of the tensors {', '.join(names)}: the "
        "classification head cannot be read."
    )
