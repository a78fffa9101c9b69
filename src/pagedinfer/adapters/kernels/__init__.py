"""The project's own Triton kernels for the paged KV cache.

* :mod:`~pagedinfer.adapters.kernels.store_kv` — write a step's K/V into their cache slots.
* :mod:`~pagedinfer.adapters.kernels.prefill_attention` — varlen causal attention over the
  whole context read through the block table (prefill, prefix-cache hits, chunked prefill).
* :mod:`~pagedinfer.adapters.kernels.decode_attention` — one query per sequence, GQA-grouped,
  split-KV with a reduction kernel; its launch grid depends only on shapes (CUDA-graph safe).
* :mod:`~pagedinfer.adapters.kernels.paged_tile` — the online-softmax step both attention
  kernels share.
* :mod:`~pagedinfer.adapters.kernels.race_sample` — the sampler's temperature-only path:
  temperature, seed-rule noise and the exponential race in one pass over the logits.

The kernels run on CUDA and, for tests, on CPU under ``TRITON_INTERPRET=1`` (set it before
this package is imported: ``triton.jit`` decides at decoration time).
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["interpreter_enabled"]


def interpreter_enabled() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _patch_interpreter_for_numpy_2_4() -> None:
    """Let the Triton 3.6 interpreter run loops whose bounds are kernel values under NumPy 2.4.

    The interpreter converts a scalar kernel value to a Python int with ``int(array)``, but its
    scalars are 1-element arrays, which NumPy 2.4 refuses to convert (triton-lang/triton#9171,
    fixed after 3.6). ``range(start, end)`` with loaded bounds then fails. We wrap the function
    that installs that conversion so it reshapes to 0-d first; the interpreter's own patch
    scope undoes both on exit (it restores in reverse order). Idempotent; a no-op elsewhere.
    """
    try:
        import triton.runtime.interpreter as interpreter
    except ImportError:  # triton is not installed: nothing to patch (its kernels cannot run)
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_pagedinfer_patched", False):
        return

    def index(self: Any) -> int:
        return int(self.handle.data.reshape(()))

    def patch_lang_tensor(tensor: object, *scope: object) -> None:
        # Triton 3.6 passes a patch scope (set_attr, undone on exit); older releases (3.2)
        # take the tensor class alone and set its attributes for good, as we then do.
        original(tensor, *scope)
        if scope:
            scope[0].set_attr(tensor, "__index__", index)  # type: ignore[attr-defined]
        else:
            tensor.__index__ = index  # type: ignore[attr-defined]

    patch_lang_tensor._pagedinfer_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor


if interpreter_enabled():
    _patch_interpreter_for_numpy_2_4()
