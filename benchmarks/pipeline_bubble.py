"""The pipeline bubble of ``pipeline_parallel_size=2`` on a local two-node Ray cluster (CPU).

With one micro-batch in flight (what the Ray executor does today) a step runs the stages one
after the other: each stage is busy for its share of the step and idle for the rest. This
measures it: a decode-heavy workload on the ``small`` random checkpoint (4 layers) runs on

* one in-process engine (the reference: its wall time is all compute and scheduling), and
* ``pipeline_parallel_size=2`` with ``distributed_executor_backend="ray"``, the stages on
  two simulated nodes (``ray.cluster_utils.Cluster`` on 127.0.0.1),

and reports, per stage, the seconds spent inside its steps (``RayExecutor.busy_seconds``)
against the wall time of the run: utilization = busy / wall, bubble = 1 - utilization.

    python benchmarks/pipeline_bubble.py            # markdown on stdout (about a minute)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

SETTINGS = {
    "device": "cpu",
    "kv_block_size": 16,
    "max_model_len": 256,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 256,
    "num_kv_blocks": 128,
    "num_threads": 1,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    # The nodes listen on 127.0.0.1 only; Ray must not swap in the host's address.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray
    from ray.cluster_utils import Cluster

    from pagedinfer import Engine, SamplingParams
    from pagedinfer.adapters.distributed.ray_executor import RayExecutor
    from pagedinfer.adapters.models.random_checkpoint import build_random_checkpoint

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [[(7 * i + j) % 4000 + 1 for j in range(32)] for i in range(args.prompts)]
    with tempfile.TemporaryDirectory() as directory:
        checkpoint = build_random_checkpoint(Path(directory) / "small", "small")
        with Engine(checkpoint, **SETTINGS) as engine:
            engine.generate(prompts[:1], params, use_tqdm=False)  # warm-up
            started = time.perf_counter()
            reference = engine.generate(prompts, params, use_tqdm=False)
            one_rank_s = time.perf_counter() - started
        node = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 80 << 20}
        cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
        cluster.add_node(**node)
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            engine = Engine(
                checkpoint,
                pipeline_parallel_size=2,
                distributed_executor_backend="ray",
                **SETTINGS,
            )
            executor = engine._executor
            assert isinstance(executor, RayExecutor)
            engine.generate(prompts[:1], params, use_tqdm=False)  # warm-up
            before = executor.busy_seconds()
            started = time.perf_counter()
            outputs = engine.generate(prompts, params, use_tqdm=False)
            wall_s = time.perf_counter() - started
            busy = [after - b for after, b in zip(executor.busy_seconds(), before, strict=True)]
            same = [o.outputs[0].token_ids for o in outputs] == [
                o.outputs[0].token_ids for o in reference
            ]
            engine.close()
        finally:
            ray.shutdown()
            cluster.shutdown()
    tokens = args.prompts * args.max_tokens
    print(f"{args.prompts} prompts of 32 tokens, {args.max_tokens} greedy tokens each")
    print("(random 'small' checkpoint: 4 layers, hidden 256; CPU, 1 thread per rank)\n")
    print("| run | wall s | tokens/s | stage 0 busy | stage 1 busy | bubble per stage |")
    print("|---|---|---|---|---|---|")
    print(f"| 1 rank, in process | {one_rank_s:.2f} | {tokens / one_rank_s:.0f} | | | |")
    utilization = [b / wall_s for b in busy]
    print(
        f"| PP=2 on Ray, 2 nodes | {wall_s:.2f} | {tokens / wall_s:.0f} | "
        f"{busy[0]:.2f} s ({utilization[0]:.0%}) | {busy[1]:.2f} s ({utilization[1]:.0%}) | "
        f"{1 - utilization[0]:.0%} / {1 - utilization[1]:.0%} |"
    )
    print(f"\ntokens equal to one rank's: {same}")


if __name__ == "__main__":
    main()
