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
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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
from pagedinfer.errors import UnsupportedModelError

__all__ = [
    "FLOAT_DTYPES",
    "INDEX_FILE",
    "bare_decoder_name",
    "checkpoint_files",
    "is_bare_decoder",
    "load_weights",
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


def bare_decoder_name(name: str) -> str:
    """A tensor of a checkpoint saved as the bare decoder (Qwen3-Embedding's ``layers.0...``,
    without the causal LM's ``model.`` prefix) under its causal LM's name."""
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
            with _open_safetensors(files[0]) as handle:
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
    loader = _Loader(model, root, check)
    for file in checkpoint_files(root):
        loader.load_file(file)
    loader.check_complete()
    for module in model.modules():
        finish = getattr(module, "finish_loading", None)
        if callable(finish):  # quantized layers: dequantize, or prepare their kernels
            finish()


class _Loader:
    """The state of one load: which tensors were seen, which parameter shards were filled."""

    def __init__(self, model: CausalLM, root: Path, check: WeightCheck) -> None:
        self.model = model
        self.root = root
        self.check = check
        self.mapping = model.weight_mapping
        self.params: dict[str, nn.Parameter] = dict(model.named_parameters())
        self.seen: dict[str, Path] = {}  # tensor name -> the file it came from
        self.filled: dict[tuple[str, ShardId], str] = {}  # (param, shard) -> tensor name

    def fail(self, name: str, file: Path, problem: str) -> UnsupportedModelError:
        return UnsupportedModelError(
            f"checkpoint {str(self.root)!r}: tensor {name!r} in {file.name}: {problem}."
        )

    def where(self, file: Path) -> str:
        return f"checkpoint {str(self.root)!r}, {file.name}"

    def load_file(self, file: Path) -> None:
        with _open_safetensors(file) as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                self.load_tensor(handle, name, file)

    def load_tensor(self, handle: Any, name: str, file: Path) -> None:
        if name in self.seen:
            where = "twice in that file" if self.seen[name] == file else f"also in {file.name}"
            raise UnsupportedModelError(
                f"checkpoint {str(self.root)!r}: tensor {name!r} is stored in "
                f"{self.seen[name].name} and {where}: expected each tensor once (remove the "
                "duplicate file, or keep only the files model.safetensors.index.json lists)."
            )
        self.seen[name] = file
        if self.model.is_ignored_weight(bare_decoder_name(name)):
            return
        kv_scale = _KV_SCALE.match(name)
        if kv_scale is not None:
            self.load_kv_scale(handle, name, file, kv_scale)
            return
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
        try:
            tensor_slice = handle.get_slice(name)
            dtype, shape = tensor_slice.get_dtype(), tuple(tensor_slice.get_shape())
        except SafetensorError as error:
            raise self.fail(name, file, f"cannot read its header entry: {error}") from error
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
        try:
            tensor = handle.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as error:
            raise self.fail(name, file, f"cannot read its data: {error}") from error
        if checks_tensor(name, tensor, self.check):
            check_finite(name, tensor, self.where(file))
        get_weight_loader(param)(param, tensor, shard_id)
        self.filled[key] = name

    def load_kv_scale(self, handle: Any, name: str, file: Path, match: re.Match[str]) -> None:
        """Hand a layer's K or V cache scale to its attention layer's ``set_kv_scales``."""
        scale, proj = match["scale"], match["proj"]
        which = proj if scale == "output_scale" else scale[0]
        if which is None or (proj is not None and proj != which):
            raise self.fail(name, file, "is not a K or V cache scale this loader knows")
        try:
            attention = self.model.get_submodule(f"{match['attention']}.attn")
        except AttributeError:
            attention = None
        setter = getattr(attention, "set_kv_scales", None)
        if setter is None:
            raise self.fail(
                name, file, "is a KV-cache scale of an attention layer the model does not have"
            )
        try:
            tensor = handle.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as error:
            raise self.fail(name, file, f"cannot read its data: {error}") from error
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
def _open_safetensors(file: Path) -> Iterator[Any]:
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
