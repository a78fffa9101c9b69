"""Rotary position embedding (neox / ``rotate_half`` layout) with a float32 cos/sin table.

The RoPE variants of ``config.json`` (``rope_parameters`` / ``rope_scaling``) change only the
table, never how it is applied:

* ``default``: ``theta^(-2i/d)``;
* ``linear``: the frequencies divided by ``factor`` (positions interpolated);
* ``llama3``: Llama 3.1's band-wise rescaling (low frequencies / ``factor``, high ones kept,
  a smooth blend between ``low_freq_factor`` and ``high_freq_factor``);
* ``yarn``: YaRN's ramp between interpolated and extrapolated frequencies, with cos and sin
  scaled by an attention factor;
* ``dynamic``: dynamic NTK. Position ``p`` uses the base that transformers uses for a
  sequence of ``max(p + 1, original_max_position_embeddings)`` tokens, so a position's
  angles never depend on the batch it is computed in (prefix caching and chunked prefill
  stay exact). This equals transformers' generation whenever the prompt fits in the
  original context; transformers' own rotation of a longer prompt depends on its length.

Every table is computed with the same float32 operations as transformers'
``ROPE_INIT_FUNCTIONS``: the cos/sin tables are bit-identical to transformers' rotary
embedding (tested for every variant).

:func:`apply_rotary` and :func:`qk_norm_rope_torch` are the torch twins of the Triton kernel in
:mod:`pagedinfer.adapters.kernels.qk_norm_rope`, which does the per-head q/k RMSNorm, the
rotation and the KV store in one launch (the CPU path runs the twins; the kernel tests use them
as the oracle).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from pagedinfer.adapters.layers.norm import rms_norm_torch

__all__ = [
    "ROPE_TYPES",
    "RopeScaling",
    "RotaryEmbedding",
    "RotaryStep",
    "apply_rotary",
    "full_width",
    "qk_norm_rope_torch",
    "qk_norm_rotate",
    "rotate",
    "stacked_qk_weight",
]

ROPE_TYPES: tuple[str, ...] = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """A checkpoint's RoPE variant and its parameters (see the module docstring).

    ``original_max_position_embeddings`` is the pre-training context (``llama3``, ``yarn``;
    for ``dynamic`` the length beyond which the base grows). ``attention_factor`` is YaRN's
    cos/sin scale (``None``: derived from ``factor``, ``mscale`` and ``mscale_all_dim``).
    """

    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        assert self.rope_type in ROPE_TYPES, self.rope_type

    def original_context(self) -> int:
        assert self.original_max_position_embeddings is not None, self
        return self.original_max_position_embeddings


DEFAULT_ROPE = RopeScaling()


class RotaryEmbedding(nn.Module):
    """Precomputed ``cos`` / ``sin`` of every position's angles, ``[max_position, d / 2]``.

    The tables are float32 whatever the model dtype (angles of large positions lose their
    low bits in bf16) and live on ``device``. The model looks them up once per step
    (:meth:`forward`) and every layer applies them with :func:`apply_rotary`.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: RopeScaling = DEFAULT_ROPE,
        *,
        device: torch.device,
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self.max_position = max_position
        self.scaling = scaling
        positions = torch.arange(max_position, dtype=torch.int64, device=device)
        if scaling.rope_type == "dynamic":
            inv_freq = _dynamic_ntk_inverse_frequencies(head_dim, base, scaling, positions)
            freqs = positions.to(torch.float32)[:, None] * inv_freq  # per-position frequencies
            attention_factor = 1.0
        else:
            inv_freq, attention_factor = inverse_frequencies(head_dim, base, scaling, device)
            freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if attention_factor != 1.0:
            cos, sin = cos * attention_factor, sin * attention_factor
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` of shape ``[T, 1, head_dim / 2]`` for ``positions [T]``."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def step(self, positions: torch.Tensor, *, fused: bool) -> RotaryStep:
        """This step's rotary inputs for every layer: with ``fused`` the kernels look the
        positions up in the tables themselves, otherwise cos and sin are looked up here once
        (in the full-width form :func:`rotate` takes, see :func:`full_width`)."""
        if fused:
            return RotaryStep(positions, self.cos, self.sin, None, None)
        cos, sin = full_width(*self(positions))
        return RotaryStep(positions, self.cos, self.sin, cos, sin)


@dataclass(frozen=True, slots=True)
class RotaryStep:
    """A step's rotary inputs, built once by the model and passed to every layer."""

    positions: torch.Tensor  # [T]
    table_cos: torch.Tensor  # [max_position, head_dim / 2] float32, the whole table
    table_sin: torch.Tensor
    # Torch path: [T, 1, head_dim] looked up, (cos, cos) and (-sin, sin) (see full_width);
    # None when fused.
    cos: torch.Tensor | None
    sin: torch.Tensor | None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]``: halves ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)``.

    Computed in float32 and cast back to ``x``'s dtype.
    """
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def full_width(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [..., head_dim / 2]`` -> ``(cos, cos), (-sin, sin)`` ``[..., head_dim]``:
    what :func:`rotate` multiplies by, built once per step rather than in every layer."""
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rotary` with full-width ``cos, sin`` (:func:`full_width`):
    ``x * cos + (x2, x1) * sin``, four ops whatever the number of heads. Each element is the
    same two float32 products and one sum as ``x1 cos - x2 sin`` / ``x2 cos + x1 sin``
    (``a + x2 * -sin`` is exactly ``a - x2 * sin``), so the result is bitwise the same."""
    xf = x if x.dtype == torch.float32 else x.float()
    swapped = torch.roll(xf, xf.shape[-1] // 2, dims=-1)  # (x2, x1), one copy
    out = xf * cos + swapped * sin
    return out if out.dtype == x.dtype else out.to(x.dtype)


def qk_norm_rope_torch(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)`` from the packed projection ``qkv [T, (H + 2 KV) * D]``: per-head RMSNorm
    of q and k when weights are given (Qwen3), then the rotation with this step's ``cos`` /
    ``sin`` (``[T, 1, D / 2]``, from :meth:`RotaryEmbedding.forward`)."""
    return qk_norm_rotate(
        qkv, *full_width(cos, sin),
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        q_weight=q_weight, k_weight=k_weight, eps=eps,
    )  # fmt: skip


# Up to this many tokens (decode steps, small batches) q and k go through the norm and the
# rotation together, in fewer calls; beyond it, over large prefill chunks, the joint pass over
# a strided view of qkv is slower than one pass per part (measured on CPU: 2.4x faster at 64
# tokens, 1.4x slower at 512).
_JOINT_QK_MAX_TOKENS = 128


def qk_norm_rotate(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    qk_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`qk_norm_rope_torch` with full-width ``cos, sin`` (``[T, 1, D]``, see
    :func:`full_width`; ``RotaryStep.cos`` / ``sin``). q and k are adjacent in ``qkv``: their
    heads are normalised and rotated together, one call each (the q and k norm weights
    stacked per head, :func:`stacked_qk_weight`; pass ``qk_weight`` if it is at hand), the
    same per-element arithmetic as one call per part (which large steps take, see
    ``_JOINT_QK_MAX_TOKENS``)."""
    num_tokens = qkv.shape[0]
    qk_heads = num_heads + num_kv_heads
    value = qkv[:, qk_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    if qk_weight is None and q_weight is not None and k_weight is not None:
        qk_weight = stacked_qk_weight(q_weight, k_weight, num_heads, num_kv_heads)
    if num_tokens > _JOINT_QK_MAX_TOKENS:  # large steps: one part at a time is faster
        half = head_dim // 2
        cos_half, sin_half = cos[..., :half], sin[..., half:]
        parts = []
        for first, count in ((0, num_heads), (num_heads, num_kv_heads)):
            part = qkv[:, first * head_dim : (first + count) * head_dim]
            part = part.view(num_tokens, count, head_dim)
            if qk_weight is not None:
                part = rms_norm_torch(part, qk_weight[first : first + count], eps)
            parts.append(apply_rotary(part, cos_half, sin_half))
        return parts[0], parts[1], value
    qk = qkv[:, : qk_heads * head_dim].view(num_tokens, qk_heads, head_dim)
    if qk_weight is not None:
        qk = rms_norm_torch(qk, qk_weight, eps)
    rotated = rotate(qk, cos, sin)
    return rotated[:, :num_heads], rotated[:, num_heads:], value


def stacked_qk_weight(
    q_weight: torch.Tensor, k_weight: torch.Tensor, num_heads: int, num_kv_heads: int
) -> torch.Tensor:
    """``[num_heads + num_kv_heads, head_dim]``: the q norm's weight for every query head,
    then the k norm's for every KV head (the per-head weights of :func:`qk_norm_rotate`)."""
    head_dim = q_weight.shape[-1]
    return torch.cat(
        (q_weight.expand(num_heads, head_dim), k_weight.expand(num_kv_heads, head_dim))
    )


def _exponents(head_dim: int, device: torch.device) -> torch.Tensor:
    """``2i / d`` for ``i < d / 2`` in float32, computed as transformers does."""
    return torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / (
        head_dim
    )


def inverse_frequencies(
    head_dim: int, base: float, scaling: RopeScaling, device: torch.device
) -> tuple[torch.Tensor, float]:
    """``(inv_freq [d / 2], attention_factor)`` for every position-independent RoPE type."""
    inv_freq = 1.0 / (base ** _exponents(head_dim, device))
    kind = scaling.rope_type
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling.factor, 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(head_dim, base, scaling, device)
    raise AssertionError(f"rope type {kind!r} has no position-independent frequencies")


def _llama3(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    factor = scaling.factor
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    old_context = scaling.original_context()
    low_freq_wavelen = old_context / low
    high_freq_wavelen = old_context / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are interpolated, short ones kept, the band between
    # them blended smoothly.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(
    head_dim: int, base: float, scaling: RopeScaling, device: torch.device
) -> tuple[torch.Tensor, float]:
    factor = scaling.factor
    original = scaling.original_context()
    attention_factor = scaling.attention_factor
    if attention_factor is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, scaling.mscale) / _yarn_mscale(
                factor, scaling.mscale_all_dim
            )
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength makes num_rotations turns over the original context.
        return (head_dim * math.log(original / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low: float = correction_dim(scaling.beta_fast)
    high: float = correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = (torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)
    extrapolation_weight = 1 - torch.clamp(ramp, 0, 1)
    pos_freqs = base ** _exponents(head_dim, device)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)
    inv_freq = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    return inv_freq, float(attention_factor)


def _dynamic_ntk_inverse_frequencies(
    head_dim: int, base: float, scaling: RopeScaling, positions: torch.Tensor
) -> torch.Tensor:
    """``[P, d / 2]``: position ``p``'s frequencies for a sequence of ``max(p + 1, M)`` tokens."""
    original = scaling.original_context()
    factor = scaling.factor
    seq_len = (positions + 1).clamp_min(original).to(torch.float32)
    stretch = (factor * seq_len / original) - (factor - 1)
    # transformers raises a 0-dim float32 tensor to this power (a correctly rounded powf); a
    # vectorised float32 pow can be one ulp off, so take it in float64 and round once.
    grown = (stretch.to(torch.float64) ** (head_dim / (head_dim - 2))).to(torch.float32)
    grown_base = base * grown
    inv_freq: torch.Tensor = 1.0 / (grown_base[:, None] ** _exponents(head_dim, positions.device))
    return inv_freq
