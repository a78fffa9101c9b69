"""A second process with its own tensor-parallel engine, driven by the engine tests.

``python tp_subprocess.py CHECKPOINT PROMPTS_JSON MAX_TOKENS``: build a TP=2 engine, print one
JSON line ``{"tokens", "worker_pids", "segments"}`` (``segments``: the /dev/shm names it
added), then generate again and print the tokens for every line read from stdin.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
from pathlib import Path


def main() -> None:
    from pagedinfer import Engine, SamplingParams

    checkpoint, prompts_json, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    prompts = json.loads(prompts_json)
    shm = Path("/dev/shm")
    before = {entry.name for entry in shm.iterdir()}
    engine = Engine(
        checkpoint,
        device="cpu",
        tensor_parallel_size=2,
        kv_block_size=16,
        max_model_len=128,
        num_kv_blocks=32,
    )
    segments = sorted(
        name
        for name in {entry.name for entry in shm.iterdir()} - before
        if name.startswith("pagedinfer-")
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def tokens() -> list[list[int]]:
        return [
            out.outputs[0].token_ids for out in engine.generate(prompts, params, use_tqdm=False)
        ]

    worker_pids = [child.pid for child in multiprocessing.active_children()]
    print(json.dumps({"tokens": tokens(), "worker_pids": worker_pids, "segments": segments}))
    sys.stdout.flush()
    for _ in sys.stdin:
        print(json.dumps({"tokens": tokens()}))
        sys.stdout.flush()
    engine.close()


if __name__ == "__main__":
    main()
