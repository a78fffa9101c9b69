"""Fill a model's parameters from the ``*.safetensors`` files of a checkpoint directory.

Which files: those named by ``model.safetensors.index.json`` when the checkpoint has one (so
a ``consolidated.safetensors`` in another naming scheme beside them is not read), else every
``*.safetensors`` file in the directory.

For each tensor, in this order, before anything is read or narrowed for tensor parallelism:

1. its name must be new (a tensor stored twice, in one or two files, is refused);
2. it must map to a parameter of the model (through the model's
   :class:`~pagedinfer.adapters.models.base.WeightMapping`), or be one the model ignores
   (a tied ``lm_head.weight``, ``rotary_emb.inv_freq``);
3. its dtype must be one its parameter accepts: a float (F16, BF16, F32, F64) for dense
   weights; for a quantized checkpoint (``config.json``'s ``quantization_config``) the
   quantized layers' tensors have their format's dtypes (``F8_E4M3`` weights, ``I32`` packed
   4-bit words, float scales);
4. its full shape must be the one the config (and the quantization format: block, group and
   packing sizes) implies for it;
5. once read, it must hold no NaN and no infinity, for the tensors ``check`` names
   (:mod:`~pagedinfer.adapters.models.finite`: by default the scales, norms and biases, not
   the big weight matrices; KV-cache scales always): else
   :class:`~pagedinfer.errors.NonFiniteWeightError`, naming it.

FP8 KV-cache scales (one number per layer for K and one for V, in the names vLLM accepts:
``self_attn.k_scale``, ``self_attn.attn.k_scale``, ``self_attn.k_proj.k_scale`` (ModelOpt),
``self_attn.k_proj.output_scale`` (older compressed-tensors); likewise for V) are not
parameters: they go to the layer's
:meth:`~pagedinfer.adapters.layers.attention.PagedAttention.set_kv_scales`, and the runner
uses them when the KV cache is FP8.

An MXFP4 checkpoint (GPT-OSS) stores each expert projection as ``<name>_blocks`` and
``<name>_scales``: once both halves are read they are dequantized into the dense tensor
``<name>`` (``adapters/quantization/mxfp4.py``), which then goes through the steps above.

Then the parameter's ``weight_loader`` copies this rank's shard, converted to the
parameter's dtype. Finally every parameter (and every shard of a packed one) must have been
filled (a quantized format's optional tensors, GPTQ's ``g_idx``, may be absent), and each
quantized layer finishes: it dequantizes its tensors into a dense weight, or keeps them for
its GPU kernel (``adapters/quantization``). Each refusal is an
:class:`~pagedinfer.errors.UnsupportedModelError` naming the tensor, the file, and what was
expected against what was found.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from pagedinfer.adapters.layers.linear import (
    ShardId,
    checkpoint_dtypes,
    checkpoint_shape,
    expected_shard_ids,
    get_weight_loader,
    is_optional,
)
from pagedinfer.adapters.models.base import CausalLM
from pagedinfer.adapters.models.finite import WeightCheck, check_finite, checks_tensor
from pagedinfer.adapters.quantization.mxfp4 import (
    BLOCKS_SUFFIX,
    GROUP_SIZE,
    SCALES_SUFFIX,
    Mxfp4Config,
    dequantize_mxfp4,
    packed_tensor_name,
)
from pagedinfer.errors import PagedInferError, UnsupportedModelError

__all__ = [
    "FLOAT_DTYPES",
    "INDEX_FILE",
    "Header",
    "TensorLoader",
    "TensorTarget",
    "bare_decoder_name",
    "checkpoint_files",
    "is_bare_decoder",
    "load_weights",
    "open_safetensors",
]

INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES: frozenset[str] = frozenset({"F16", "BF16", "F32", "F64"})
"""safetensors dtype names a weight may have (converted to the model's dtype on load)."""

_MAX_NAMES_SHOWN = 5
_KV_SCALE = re.compile(
    r"^(?P<attention>.*\.self_attn)\.(?:attn\.|(?P<proj>[kv])_proj\.)?"
    r"(?P<scale>[kv]_scale|output_scale)$"
)
"""A layer's FP8 KV-cache scale (see the module docstring)."""


_BARE_DECODER = ("embed_tokens.", "layers.", "norm.")


# A multimodal checkpoint's text tower (Gemma3ForConditionalGeneration), as transformers
# saves it (language_model.model.*, language_model.lm_head.*) or names it in memory
# (model.language_model.*): the causal LM's names.
_TEXT_TOWER_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)


def bare_decoder_name(name: str) -> str:
    """A tensor of a checkpoint saved as the bare decoder (Qwen3-Embedding's ``layers.0...``,
    without the causal LM's ``model.`` prefix), or as a multimodal model's text tower, under
    its causal LM's name."""
    for prefix, causal_lm in _TEXT_TOWER_PREFIXES:
        if name.startswith(prefix):
            return causal_lm + name.removeprefix(prefix)
    return "model." + name if name.startswith(_BARE_DECODER) else name


def is_bare_decoder(root: Path) -> bool:
    """Whether the checkpoint holds the decoder alone (``embed_tokens.weight``, no ``model.``
    prefix, no LM head): an embedding model's, which has no use for an LM head."""
    index_file = root / INDEX_FILE
    try:
        if index_file.is_file():
            index = json.loads(index_file.read_text(encoding="utf-8"))
            names = set(index.get("weight_map", {})) if isinstance(index, dict) else set()
        else:
            files = sorted(root.glob("*.safetensors"))
            if not files:
                return False
            with open_safetensors(files[0]) as handle:
                names = set(handle.keys())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, UnsupportedModelError):
        return False
    return "embed_tokens.weight" in names and "lm_head.weight" not in names


def checkpoint_files(root: Path) -> list[Path]:
    """The safetensors files to read, per the index file if there is one."""
    index_file = root / INDEX_FILE
    if index_file.exists() or index_file.is_symlink():
        names = _index_file_names(index_file)
        files = [root / name for name in names]
        for file in files:
            if not file.is_file():
                raise UnsupportedModelError(
                    f"checkpoint {str(root)!r}: {INDEX_FILE} names {file.name!r}, which does "
                    "not exist: expected every file the index lists (re-download the "
                    "checkpoint)."
                )
        return files
    try:
        files = sorted(root.glob("*.safetensors"))
    except OSError as error:
        raise UnsupportedModelError(
            f"cannot list the safetensors files of {str(root)!r}: {error}"
        ) from error
    if not files:
        raise UnsupportedModelError(
            f"checkpoint {str(root)!r} has no *.safetensors files: expected the model weights "
            "in safetensors format (convert .bin / .pt checkpoints with transformers' "
            "save_pretrained)."
        )
    return files


def load_weights(model: CausalLM, path: str | Path, *, check: WeightCheck = "default") -> None:
    """Load the checkpoint at ``path`` into ``model`` (see the module docstring); ``check``:
    which tensors must hold no NaN or infinity (``"default"``, ``"all"``, ``"none"``).

    Raises :class:`UnsupportedModelError` when a file cannot be read, or a tensor is
    duplicated, unknown, not a float, of the wrong shape, or missing;
    :class:`~pagedinfer.errors.NonFiniteWeightError` (a subclass) when a checked tensor
    holds a NaN or an infinity.
    """
    root = Path(path)
    loader = TensorLoader(model, root, check)
    for file in checkpoint_files(root):
        loader.load_file(file)
    loader.check_complete()
    for module in model.modules():
        finish = getattr(module, "finish_loading", None)
        if callable(finish):  # quantized layers: dequantize, or prepare their kernels
            finish()


@dataclass(frozen=True, slots=True)
class TensorTarget:
    """Where a checked checkpoint tensor goes: ``shard_id`` of parameter ``param_name``."""

    param_name: str
    shard_id: ShardId
    param: nn.Parameter


Header = Callable[[], tuple[str, tuple[int, ...]]]
"""Reads a tensor's safetensors dtype name and full shape (without its data)."""


class TensorLoader:
    """The state of one load: which tensors were seen, which parameter shards were filled.

    ``origin`` names where the tensors come from in messages (a checkpoint directory, or
    ``update_weights``); ``error`` is the class every refusal raises.
    """

    def __init__(
        self,
        model: CausalLM,
        root: Path | None,
        check: WeightCheck,
        *,
        origin: str | None = None,
        error: type[PagedInferError] = UnsupportedModelError,
    ) -> None:
        self.model = model
        self.root = root
        self.origin = origin if origin is not None else f"checkpoint {str(root)!r}"
        self.error = error
        self.check = check
        self.mapping = model.weight_mapping
        self.params: dict[str, nn.Parameter] = dict(model.named_parameters())
        self.seen: dict[str, Path | None] = {}  # tensor name -> the file it came from
        self.filled: dict[tuple[str, ShardId], str] = {}  # (param, shard) -> tensor name
        self.mxfp4 = isinstance(model.config.quantization, Mxfp4Config)
        # MXFP4 halves read, waiting for their partner: tensor name -> (tensor, file).
        self.pending: dict[str, tuple[torch.Tensor, Path]] = {}

    def fail(self, name: str, file: Path | None, problem: str) -> PagedInferError:
        where = "" if file is None else f" in {file.name}"
        return self.error(f"{self.origin}: tensor {name!r}{where}: {problem}.")

    def where(self, file: Path | None) -> str:
        return self.origin if file is None else f"{self.origin}, {file.name}"

    def load_file(self, file: Path) -> None:
        with open_safetensors(file) as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                self.load_tensor(handle, name, file)

    def load_tensor(self, handle: Any, name: str, file: Path) -> None:
        packed = packed_tensor_name(name) if self.mxfp4 else None
        if packed is not None:
            self.load_mxfp4_half(handle, name, file, *packed)
            return
        target = self.resolve(name, file, lambda: self.read_header(handle, name, file))
        if target is None:
            return
        tensor = self.read_tensor(handle, name, file)
        if isinstance(target, re.Match):
            self.set_kv_scale(tensor, name, file, target)
        else:
            self.write(target, name, file, tensor)

    def load_mxfp4_half(self, handle: Any, name: str, file: Path, base: str, suffix: str) -> None:
        """Read one half of an MXFP4 pair; once both are read, dequantize them into the
        parameter the dense tensor ``base`` fills (``adapters/quantization/mxfp4.py``)."""
        self.mark_seen(name, file)
        dtype, _ = self.read_header(handle, name, file)
        if dtype != "U8":
            raise self.fail(name, file, f"dtype {dtype} does not fit MXFP4: expected U8")
        partner = base + (SCALES_SUFFIX if suffix == BLOCKS_SUFFIX else BLOCKS_SUFFIX)
        tensor = self.read_tensor(handle, name, file)
        if partner not in self.pending:
            self.pending[name] = (tensor, file)
            return
        other, _ = self.pending.pop(partner)
        blocks, scales = (tensor, other) if suffix == BLOCKS_SUFFIX else (other, tensor)
        if (
            blocks.dim() != 4
            or blocks.shape[-1] != GROUP_SIZE // 2
            or (blocks.shape[:-1] != scales.shape)
        ):
            raise self.fail(
                base + BLOCKS_SUFFIX,
                file,
                f"shape {list(blocks.shape)} does not fit its scales' {list(scales.shape)}: "
                f"expected blocks [experts, rows, groups, {GROUP_SIZE // 2}] and scales "
                "[experts, rows, groups]",
            )
        experts, rows, groups, _ = blocks.shape
        shape = (experts, groups * GROUP_SIZE, rows)
        target = self.resolve(base, file, lambda: ("F32", shape))
        if not isinstance(target, TensorTarget):  # a tensor the model ignores
            return
        dense = dequantize_mxfp4(blocks, scales, target.param.dtype)
        del blocks, scales, tensor, other
        self.write(target, base, file, dense)

    def read_header(self, handle: Any, name: str, file: Path) -> tuple[str, tuple[int, ...]]:
        try:
            tensor_slice = handle.get_slice(name)
            return tensor_slice.get_dtype(), tuple(tensor_slice.get_shape())
        except SafetensorError as error:
            raise self.fail(name, file, f"cannot read its header entry: {error}") from error

    def read_tensor(self, handle: Any, name: str, file: Path) -> torch.Tensor:
        try:
            tensor: torch.Tensor = handle.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as error:
            raise self.fail(name, file, f"cannot read its data: {error}") from error
        return tensor

    def resolve(
        self, name: str, file: Path | None, header: Header
    ) -> TensorTarget | re.Match[str] | None:
        """Check tensor ``name`` (steps 1 to 4 of the module docstring) before its data is
        read: where it goes (a parameter shard, or a KV-cache scale's match), or None for a
        tensor the model ignores. Raises ``self.error`` naming what is wrong."""
        self.mark_seen(name, file)
        if self.model.is_ignored_weight(bare_decoder_name(name)):
            return None
        kv_scale = _KV_SCALE.match(name)
        if kv_scale is not None:
            self.kv_scale_setter(name, file, kv_scale)
            dtype, shape = header()
            if math.prod(shape) != 1 or dtype not in FLOAT_DTYPES:
                raise self.fail(
                    name,
                    file,
                    f"holds {math.prod(shape)} {dtype} values: expected one float per layer "
                    "(per-head or per-channel KV-cache scales are not supported)",
                )
            return kv_scale
        param_name, shard_id = self.mapping.to_parameter(bare_decoder_name(name))
        param = self.params.get(param_name)
        if param is None or shard_id not in expected_shard_ids(param):
            raise self.fail(
                name,
                file,
                f"matches no parameter of {type(self.model).__name__} (config.json: "
                f"{self.model.config.architecture}); the checkpoint does not fit the "
                "architecture or the sizes its config.json names",
            )
        key = (param_name, shard_id)
        if key in self.filled:
            raise self.fail(
                name, file, f"fills the same weight as tensor {self.filled[key]!r} already did"
            )
        dtype, shape = header()
        allowed, layout = checkpoint_dtypes(param)
        if dtype not in allowed:
            raise self.fail(name, file, self._dtype_problem(dtype, allowed, layout))
        expected = checkpoint_shape(param, shard_id)
        if shape != expected:
            quantization = self.model.config.quantization
            implied = (
                f" and its quantization_config ({quantization.describe()}) imply for {layout}"
                if layout and quantization is not None
                else " implies"
            )
            raise self.fail(
                name,
                file,
                f"shape {list(shape)} does not match the shape {list(expected)} that "
                f"config.json{implied}",
            )
        self.filled[key] = name
        return TensorTarget(param_name, shard_id, param)

    def mark_seen(self, name: str, file: Path | None) -> None:
        """Step 1: refuse a tensor given twice."""
        if name in self.seen:
            first = self.seen[name]
            if first is None or file is None:
                raise self.fail(name, file, "is given twice: expected each tensor once")
            where = "twice in that file" if first == file else f"also in {file.name}"
            raise self.error(
                f"{self.origin}: tensor {name!r} is stored in "
                f"{first.name} and {where}: expected each tensor once (remove the "
                "duplicate file, or keep only the files model.safetensors.index.json lists)."
            )
        self.seen[name] = file

    def check_values(self, name: str, file: Path | None, tensor: torch.Tensor) -> None:
        """Step 5: no NaN or infinity in the tensors ``check`` names."""
        if checks_tensor(name, tensor, self.check):
            check_finite(name, tensor, self.where(file))

    def write(
        self, target: TensorTarget, name: str, file: Path | None, tensor: torch.Tensor
    ) -> None:
        """Check ``tensor``'s values, then copy this rank's shard into its parameter."""
        self.check_values(name, file, tensor)
        get_weight_loader(target.param)(target.param, tensor, target.shard_id)
        # Weight loaders write through ``param.data``, which autograd's version counter does
        # not see: bump it, so what layers derive from a parameter and key by its version
        # (the torch path's stacked q/k norm weight) is rebuilt after an update.
        torch.autograd.graph.increment_version(target.param)

    def kv_scale_setter(
        self, name: str, file: Path | None, match: re.Match[str]
    ) -> Callable[..., None]:
        """The ``set_kv_scales`` of the attention layer a K or V cache scale belongs to."""
        scale, proj = match["scale"], match["proj"]
        which = proj if scale == "output_scale" else scale[0]
        if which is None or (proj is not None and proj != which):
            raise self.fail(name, file, "is not a K or V cache scale this loader knows")
        try:
            attention = self.model.get_submodule(f"{match['attention']}.attn")
        except AttributeError:
            attention = None
        setter: Callable[..., None] | None = getattr(attention, "set_kv_scales", None)
        if setter is None:
            raise self.fail(
                name, file, "is a KV-cache scale of an attention layer the model does not have"
            )
        return setter

    def set_kv_scale(
        self, tensor: torch.Tensor, name: str, file: Path | None, match: re.Match[str]
    ) -> None:
        """Hand a layer's K or V cache scale to its attention layer's ``set_kv_scales``."""
        setter = self.kv_scale_setter(name, file, match)
        scale, proj = match["scale"], match["proj"]
        which = proj if scale == "output_scale" else scale[0]
        if tensor.numel() != 1 or not tensor.is_floating_point():
            raise self.fail(
                name,
                file,
                f"holds {tensor.numel()} {tensor.dtype} values: expected one float per layer "
                "(per-head or per-channel KV-cache scales are not supported)",
            )
        check_finite(name, tensor, self.where(file))
        try:
            setter(**{f"{which}_scale": tensor.float()})
        except UnsupportedModelError as error:
            raise self.fail(name, file, str(error).rstrip(".")) from error

    def _dtype_problem(self, dtype: str, allowed: frozenset[str], layout: str) -> str:
        quantization = self.model.config.quantization
        if allowed == FLOAT_DTYPES:
            problem = (
                f"dtype {dtype} is not a floating-point type: expected one of "
                f"{', '.join(sorted(FLOAT_DTYPES))}"
            )
            if quantization is None:
                return problem + (
                    " (config.json has no quantization_config: a quantized checkpoint must "
                    "name its format there)"
                )
            return problem + (
                f" (quantization_config, {quantization.describe()}, leaves this tensor's "
                "module unquantized)"
            )
        assert quantization is not None, "only quantized layers accept other dtypes"
        return (
            f"dtype {dtype} does not fit {layout} of quantization_config "
            f"({quantization.describe()}): expected {' or '.join(sorted(allowed))}"
        )

    def check_complete(self) -> None:
        for name, (_, file) in self.pending.items():
            raise self.fail(
                name,
                file,
                "is one half of an MXFP4 pair whose other half (_blocks with _scales) is "
                "missing: expected both",
            )
        missing = [
            self.mapping.to_checkpoint(param_name, shard_id)
            for param_name, param in self.params.items()
            if not is_optional(param)
            for shard_id in expected_shard_ids(param)
            if (param_name, shard_id) not in self.filled
        ]
        if missing:
            shown = ", ".join(repr(name) for name in missing[:_MAX_NAMES_SHOWN])
            more = (
                f" and {len(missing) - _MAX_NAMES_SHOWN} more"
                if len(missing) > _MAX_NAMES_SHOWN
                else ""
            )
            raise UnsupportedModelError(
                f"checkpoint {str(self.root)!r} is missing weights {shown}{more}: expected a "
                f"complete {self.model.config.architecture} checkpoint."
            )


@contextmanager
def open_safetensors(file: Path) -> Iterator[Any]:
    try:
        handle = safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError) as error:
        raise UnsupportedModelError(
            f"cannot read {str(file)!r}: {error}; expected a safetensors file (the file may "
            "be truncated or corrupt: re-download it)."
        ) from error
    with handle:
        yield handle


def _index_file_names(index_file: Path) -> list[str]:
    """The distinct file names in an index's ``weight_map``, in first-seen order."""
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UnsupportedModelError(
            f"cannot read {str(index_file)!r}: {error}; expected a JSON object whose "
            "'weight_map' maps tensor names to safetensors file names."
        ) from error
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(v, str) and "/" not in v for v in weight_map.values())
    ):
        raise UnsupportedModelError(
            f"{str(index_file)!r} is invalid: expected a JSON object whose 'weight_map' maps "
            "tensor names to safetensors file names in the same directory."
        )
    return list(dict.fromkeys(weight_map.values()))
