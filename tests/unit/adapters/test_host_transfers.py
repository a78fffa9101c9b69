"""Host transfers of the launch path (issue 37) and the device-side speculative verify."""

from __future__ import annotations

import random
from array import array
from dataclasses import dataclass
from typing import Any, cast

import pytest
import torch

from pagedinfer.adapters.host_transfers import HostUploads, Readbacks
from pagedinfer.adapters.speculative.verify import accepted_samples
from pagedinfer.domain.speculative import accepted_length

CPU = torch.device("cpu")


def test_uploads_hold_the_values_in_their_own_memory() -> None:
    uploads = HostUploads(CPU)
    values = array("q", [3, 1, 4, 1, 5])
    tensor = uploads.upload(values, torch.int64)
    values[0] = 9  # the caller may reuse its array
    assert tensor.tolist() == [3, 1, 4, 1, 5]
    assert uploads.upload(array("i", [2, 7]), torch.int64).tolist() == [2, 7]
    assert uploads.upload([0.5, 2.0], torch.float32).tolist() == [0.5, 2.0]
    empty = uploads.upload([], torch.int64)
    assert empty.shape == (0,) and empty.dtype == torch.int64


def test_readbacks_read_the_values() -> None:
    readback = Readbacks(CPU).start(torch.tensor([5, 6, 7]))
    assert readback.read() == [5, 6, 7]


@dataclass
class _Plan:
    """The two things accepted_samples reads of a BatchPlan."""

    num_samples: int
    rows: list[tuple[int, int, list[int]]]

    def verify_drafts(self) -> list[tuple[int, int, list[int]]]:
        return self.rows


def _host_rule(plan: _Plan, sampled: list[int]) -> list[bool]:
    kept = [True] * plan.num_samples
    for _, first, drafts in plan.rows:
        accepted = accepted_length(sampled[first : first + len(drafts) + 1], drafts)
        for i in range(len(drafts) + 1):
            kept[first + i] = i <= accepted
    return kept


@pytest.mark.parametrize("seed", range(20))
def test_device_verify_equals_the_domain_rule(seed: int) -> None:
    rng = random.Random(seed)
    sampled: list[int] = []
    rows: list[tuple[int, int, list[int]]] = []
    for row in range(rng.randint(1, 6)):
        if rng.random() < 0.6:  # a verify row: k drafts, k + 1 samples
            k = rng.randint(1, 4)
            drafts = [rng.randrange(3) for _ in range(k)]
            rows.append((row, len(sampled), drafts))
            sampled += [d if rng.random() < 0.7 else rng.randrange(3) for d in drafts]
            sampled.append(rng.randrange(3))
        else:
            sampled.append(rng.randrange(3))
    plan = _Plan(len(sampled), rows)
    kept = accepted_samples(cast(Any, plan), torch.tensor(sampled), HostUploads(CPU))
    assert kept.tolist() == _host_rule(plan, sampled)
