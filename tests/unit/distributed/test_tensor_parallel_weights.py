"""``update_weights`` and ``collective_rpc`` through ``tensor_parallel_size=2`` (gloo on the
CPU), and a trainer in another process broadcasting its weights into both ranks (issue 40).

One TP engine for the module (a worker process), one trainer subprocess."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from pagedinfer import Engine, SamplingParams
from pagedinfer.adapters.distributed.weight_broadcast import (
    TrainerGroup,
    describe,
    join_trainer_group,
    leave_trainer_group,
    receive_weights,
)
from pagedinfer.errors import CollectiveRpcError, ConfigurationError, WeightUpdateError

pytestmark = [pytest.mark.tensor_parallel]

REPO = Path(__file__).resolve().parents[3]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SETTINGS: dict[str, Any] = {
    "device": "cpu",
    "dtype": "float32",
    "kv_block_size": 16,
    "max_model_len": 96,
    "num_kv_blocks": 24,
}
PROMPTS = [[5, 17, 300, 41, 9], [(7 * i) % 500 + 1 for i in range(40)]]

# The trainer: rank 0 of a gloo group with both engine ranks; broadcasts a checkpoint.
TRAINER = """
import sys
from safetensors.torch import load_file
from pagedinfer.adapters.distributed import weight_broadcast as broadcast
host, port, checkpoint = sys.argv[1], int(sys.argv[2]), sys.argv[3]
tensors = load_file(checkpoint + "/model.safetensors")
named = [(name, tensors[name].float()) for name in sorted(tensors)]
sender = broadcast.join_as_trainer(broadcast.TrainerGroup(host, port, world_size=3, timeout_s=60))
broadcast.send_weights(sender, named)
sender.close()
"""


def _tokens(engine: Engine) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in engine.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def checkpoints(make_checkpoint: Callable[..., Path]) -> tuple[Path, Path]:
    return make_checkpoint("tiny", seed=0), make_checkpoint("tiny", seed=1)


@pytest.fixture(scope="module")
def expected(checkpoints: tuple[Path, Path]) -> list[list[list[int]]]:
    """Greedy tokens of single-process engines on the two checkpoints."""
    results = []
    for checkpoint in checkpoints:
        with Engine(checkpoint, **SETTINGS, num_threads=1) as engine:
            results.append(_tokens(engine))
    assert results[0] != results[1]
    return results


@pytest.fixture(scope="module")
def engine(checkpoints: tuple[Path, Path]) -> Iterator[Engine]:
    with Engine(checkpoints[0], **SETTINGS, tensor_parallel_size=2) as engine:
        yield engine


def _rank(runner: Any, offset: int) -> int:
    return int(runner.parallel.rank) + offset


def _qkv_rows(runner: Any) -> int:
    return int(runner.model.get_parameter("model.layers.0.self_attn.qkv_proj.weight").shape[0])


def _fail_on_rank_1(runner: Any) -> int:
    if runner.parallel.rank == 1:
        raise RuntimeError("rank 1 refuses")
    return 0


def test_collective_rpc_gathers_every_rank_in_order(engine: Engine) -> None:
    assert engine.collective_rpc(_rank, args=(10,)) == [10, 11]
    assert engine.collective_rpc(_qkv_rows) == [128, 128]  # half of q, k, v (256 rows) each
    with pytest.raises(CollectiveRpcError, match="rank 1 refuses"):
        engine.collective_rpc(_fail_on_rank_1)
    with pytest.raises(ConfigurationError, match="cannot be pickled"):
        engine.collective_rpc(lambda runner: 0)  # the workers are other processes
    assert engine.collective_rpc(_rank, kwargs={"offset": 0}) == [0, 1]  # still serving


def test_update_weights_reaches_every_rank(
    engine: Engine, checkpoints: tuple[Path, Path], expected: list[list[list[int]]]
) -> None:
    assert _tokens(engine) == expected[0]
    tensors = load_file(str(checkpoints[1] / "model.safetensors"))
    down = "model.layers.1.mlp.down_proj.weight"
    bad = [*((n, t) for n, t in tensors.items() if n != down), (down, tensors[down][:3])]
    with pytest.raises(WeightUpdateError, match="does not match the shape"):
        engine.update_weights(bad)
    assert _tokens(engine) == expected[0]
    engine.update_weights(tensors)
    assert _tokens(engine) == expected[1]
    engine.update_weights_from_path(checkpoints[0])
    assert _tokens(engine) == expected[0]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def test_a_trainer_process_broadcasts_into_both_ranks(
    engine: Engine, checkpoints: tuple[Path, Path], expected: list[list[list[int]]]
) -> None:
    group = TrainerGroup("127.0.0.1", _free_port(), world_size=3, timeout_s=60)
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    trainer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(TRAINER), group.host, str(group.port),
         str(checkpoints[1])],
        env=env,
    )  # fmt: skip
    try:
        assert engine.collective_rpc(join_trainer_group, args=(group,)) == [1, 2]
        tensors = load_file(str(checkpoints[1] / "model.safetensors"))
        metas = describe((name, tensors[name].float()) for name in sorted(tensors))
        written = engine.collective_rpc(receive_weights, args=(group, metas))
        assert written == [len(metas), len(metas)]
        engine.reset_prefix_cache()
        assert trainer.wait(timeout=60) == 0
    finally:
        if trainer.poll() is None:
            trainer.kill()
        engine.collective_rpc(leave_trainer_group, args=(group,))
    assert _tokens(engine) == expected[1]
    engine.update_weights_from_path(checkpoints[0])
