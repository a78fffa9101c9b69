"""Every NaN and infinity in a checkpoint's tensors, without loading a model
(``pagedinfer check-weights DIR``).

Loading checks the scales, norms and biases by default
(:mod:`~pagedinfer.adapters.models.finite`); this scan reads every floating-point tensor of
every safetensors file the loader would read (the index's files, else all of them), one
tensor at a time, and reports each non-finite one: a check to run once on a new checkpoint,
or in CI after a conversion or quantization.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

from pagedinfer.adapters.models.finite import NonFinite, count_nonfinite
from pagedinfer.adapters.models.loader import checkpoint_files
from pagedinfer.errors import CheckpointNotFoundError, UnsupportedModelError

__all__ = ["Finding", "ScanReport", "scan_checkpoint"]


@dataclass(frozen=True, slots=True)
class Finding:
    """A tensor holding NaN or infinite values."""

    file: str
    name: str
    numel: int
    found: NonFinite

    def describe(self) -> str:
        return f"{self.file}: {self.name}: {self.found.describe(self.numel)}"


@dataclass(frozen=True, slots=True)
class ScanReport:
    """What a scan read and what it found."""

    files: int
    tensors: int  # floating-point tensors read
    findings: tuple[Finding, ...]

    @property
    def clean(self) -> bool:
        return not self.findings


def scan_checkpoint(path: str | Path) -> ScanReport:
    """Read every floating-point tensor of the checkpoint at ``path``; the non-finite ones.

    Raises :class:`CheckpointNotFoundError` for a path that is no directory and
    :class:`UnsupportedModelError` for files that cannot be read.
    """
    root = Path(path)
    if not root.is_dir():
        raise CheckpointNotFoundError(
            f"{str(root)!r} is not a directory: expected a checkpoint directory holding "
            "*.safetensors files."
        )
    files = checkpoint_files(root)
    tensors = 0
    findings: list[Finding] = []
    for file in files:
        for name, tensor_numel, found in _scan_file(file):
            tensors += 1
            if found:
                findings.append(Finding(file.name, name, tensor_numel, found))
    return ScanReport(len(files), tensors, tuple(findings))


def _scan_file(file: Path) -> Iterator[tuple[str, int, NonFinite]]:
    try:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = handle.get_tensor(name)
                if tensor.is_floating_point():
                    yield name, tensor.numel(), count_nonfinite(tensor)
    except (SafetensorError, OSError, RuntimeError) as error:
        raise UnsupportedModelError(
            f"cannot read {str(file)!r}: {error}; expected a safetensors file (the file may "
            "be truncated or corrupt: re-download it)."
        ) from error
