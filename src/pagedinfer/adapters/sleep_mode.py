"""Sleep mode: give a runner's device memory back and take it again (vLLM's levels).

* Level 1: the KV cache is discarded (its contents are lost) and, on CUDA, the weights are
  copied to host memory and their device memory freed (on the CPU they stay where they are:
  they already live in host memory).
* Level 2: the KV cache and the weights are discarded; waking up rebuilds the model and
  loads the checkpoint again (what an RL loop then overwrites with ``update_weights``).

The two halves wake separately (vLLM's ``tags``): ``"weights"`` first, then
``"kv_cache"``, so a trainer can push new weights before the cache takes its memory back.
What the runner must do for each half is its own business (:class:`SleepingRunner`); this
module keeps the state and moves the tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Final, Literal, Protocol

import torch
from torch import nn

from pagedinfer.errors import ConfigurationError

__all__ = [
    "SLEEP_LEVELS",
    "WAKE_TAGS",
    "HostCopy",
    "SleepState",
    "SleepingRunner",
    "check_sleep_level",
    "check_wake_tags",
    "offload_to_host",
]

SLEEP_LEVELS: Final = (1, 2)
WAKE_TAGS: Final = ("weights", "kv_cache")
WakeTag = Literal["weights", "kv_cache"]


def check_sleep_level(level: object) -> int:
    """``level`` if it is 1 or 2, else ``ConfigurationError`` saying what each means."""
    if isinstance(level, bool) or level not in SLEEP_LEVELS:
        raise ConfigurationError(
            f"sleep level {level!r} is invalid: expected 1 (free the KV cache; on CUDA the "
            "weights move to host memory) or 2 (free the KV cache and the weights; wake_up "
            "reloads the checkpoint)."
        )
    assert isinstance(level, int)
    return level


def check_wake_tags(tags: Iterable[str] | None) -> tuple[WakeTag, ...]:
    """The halves to wake (``None``: both), in waking order (weights before the cache)."""
    if tags is None:
        return WAKE_TAGS
    if isinstance(tags, str):
        raise ConfigurationError(
            f"tags={tags!r} is invalid: expected a list of tags, e.g. [{tags!r}]."
        )
    given = list(tags)
    unknown = [tag for tag in given if tag not in WAKE_TAGS]
    if unknown or not given:
        raise ConfigurationError(
            f"tags={given!r} is invalid: expected None (wake everything) or a non-empty list "
            f"of {list(WAKE_TAGS)}."
        )
    return tuple(tag for tag in WAKE_TAGS if tag in given)


@dataclass
class HostCopy:
    """Tensors of a module moved to host memory (level 1 on CUDA): each tensor object keeps
    its identity (its ``.data`` changes), so every module holding it sees it come back."""

    tensors: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def restore(self, device: torch.device) -> None:
        """Every tensor back on ``device`` (with its values)."""
        for tensor, host in self.tensors:
            tensor.data = host.to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.tensors.clear()


def _module_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    """Every parameter and buffer of ``module`` once (tied tensors are one)."""
    seen: set[int] = set()
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield tensor


def offload_to_host(module: nn.Module) -> HostCopy:
    """Copy ``module``'s parameters and buffers to host memory and free their device memory
    (each tensor keeps its identity and shape metadata; its storage becomes empty)."""
    copy = HostCopy()
    for tensor in _module_tensors(module):
        if tensor.device.type == "cpu":
            continue
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
        host.copy_(tensor.data)
        copy.tensors.append((tensor, host))
    for tensor, _ in copy.tensors:
        tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return copy


class SleepingRunner(Protocol):
    """What a runner does for each half of sleep mode."""

    def release_kv_cache(self) -> None:
        """Drop the KV cache (and whatever records its addresses: CUDA graphs)."""
        ...

    def restore_kv_cache(self) -> None:
        """Allocate and bind a zeroed KV cache of the same size again."""
        ...

    def release_weights(self, *, keep_host_copy: bool) -> None:
        """Level 1 (``keep_host_copy``): weights to host memory where they are on a device;
        level 2: drop them."""
        ...

    def restore_weights(self) -> None:
        """The weights back: from the host copy (level 1) or the checkpoint (level 2)."""
        ...

    def free_device_memory(self) -> None:
        """Hand freed device memory back to the device (CUDA's caching allocator)."""
        ...


@dataclass
class SleepState:
    """Which halves of a runner are asleep, and at which level."""

    level: int = 0  # 0: awake
    weights_asleep: bool = False
    kv_cache_asleep: bool = False

    @property
    def sleeping(self) -> bool:
        return self.weights_asleep or self.kv_cache_asleep

    def sleep(self, runner: SleepingRunner, level: int) -> None:
        """Put ``runner`` to sleep at ``level``; asleep already, only a deeper level does
        more (level 2 over level 1 drops the host copy of the weights)."""
        level = check_sleep_level(level)
        if not self.kv_cache_asleep:
            runner.release_kv_cache()
            self.kv_cache_asleep = True
        if level == 2 and self.level != 2:
            runner.release_weights(keep_host_copy=False)
            self.weights_asleep = True
        elif level == 1 and not self.weights_asleep:
            runner.release_weights(keep_host_copy=True)
            self.weights_asleep = True
        self.level = max(self.level, level)
        runner.free_device_memory()

    def wake_up(self, runner: SleepingRunner, tags: Iterable[str] | None) -> None:
        """Wake the halves named by ``tags`` (``None``: both), the weights first."""
        for tag in check_wake_tags(tags):
            if tag == "weights" and self.weights_asleep:
                runner.restore_weights()
                self.weights_asleep = False
            elif tag == "kv_cache" and self.kv_cache_asleep:
                runner.restore_kv_cache()
                self.kv_cache_asleep = False
        if not self.sleeping:
            self.level = 0
