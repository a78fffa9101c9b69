"""Multi-LoRA throughput (issue 43): the base model alone against 1, 4 and 16 adapters mixed.

One random checkpoint (``--preset``, ``small`` by default), ``--requests`` random prompts
(32 tokens, ``--output-len`` greedy tokens each, ``ignore_eos``) generated in one batch by:

* ``base``: an engine without LoRA (the baseline);
* ``base, lora on``: an engine with ``enable_lora`` whose requests name no adapter (what the
  LoRA machinery costs a base-only batch);
* ``N adapters``: the same engine, the requests spread round-robin over N random adapters
  (rank ``--rank``, every projection adapted: q, k, v, o, gate, up, down), all mixed in
  every step (``max_loras`` = 16, so every adapter holds a device slot).

Adapters are written in PEFT's layout (adapter_config.json + adapter_model.safetensors) with
random weights; their tokens are not checked (tests/unit/lora checks them against PEFT). Each
round runs every configuration in turn (``--rounds``, medians reported), one torch thread by
default, on the CPU by default (``--device cuda`` for a GPU: the Triton kernels run there).

    python benchmarks/lora.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch
from safetensors.torch import save_file

TARGETS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def write_adapter(path: Path, config: dict[str, int], rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter for a checkpoint with ``config``'s shapes."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config["num_key_value_heads"] * head_dim
    shapes = {
        "q_proj": (hidden, q_out),
        "k_proj": (hidden, kv_out),
        "v_proj": (hidden, kv_out),
        "o_proj": (q_out, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for parent, modules in TARGETS.items():
            for module in modules:
                in_features, out_features = shapes[module]
                name = f"base_model.model.model.layers.{layer}.{parent}.{module}"
                a = torch.randn(rank, in_features, generator=generator) / in_features**0.5
                b = torch.randn(out_features, rank, generator=generator) / rank**0.5
                tensors[f"{name}.lora_A.weight"] = a
                tensors[f"{name}.lora_B.weight"] = b * 0.1
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    settings = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": [m for modules in TARGETS.values() for m in modules],
        "bias": "none",
    }
    (path / "adapter_config.json").write_text(json.dumps(settings))
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small", help="random checkpoint preset")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    from pagedinfer import Engine, LoRARequest, SamplingParams
    from pagedinfer.adapters.models.random_checkpoint import build_random_checkpoint

    root = Path(tempfile.mkdtemp(prefix="pagedinfer-lora-bench-"))
    checkpoint = build_random_checkpoint(root / "model", args.preset)
    config = json.loads((checkpoint / "config.json").read_text())
    adapters = [
        LoRARequest(f"a{i}", i, str(write_adapter(root / f"a{i}", config, args.rank, i)))
        for i in range(1, 17)
    ]
    rng = random.Random(0)
    prompts = [
        [rng.randrange(config["vocab_size"]) for _ in range(32)] for _ in range(args.requests)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    common = {
        "device": args.device,
        "num_threads": args.threads,
        "kv_block_size": 16,
        "max_model_len": 256,
        "max_num_seqs": args.requests,
    }
    base = Engine(checkpoint, **common)
    lora = Engine(checkpoint, enable_lora=True, max_loras=16, max_lora_rank=args.rank, **common)
    runs = {
        "base": (base, None),
        "base, lora on": (lora, None),
        "1 adapter": (lora, [adapters[0]] * len(prompts)),
        "4 adapters": (lora, [adapters[i % 4] for i in range(len(prompts))]),
        "16 adapters": (lora, [adapters[i % 16] for i in range(len(prompts))]),
    }
    for engine, loras in runs.values():  # warm-up: loads every adapter once
        engine.generate(
            prompts[:16],
            SamplingParams(max_tokens=2),
            use_tqdm=False,
            lora_request=None if loras is None else loras[:16],
        )
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (engine, loras) in runs.items():
            started = time.perf_counter()
            outputs = engine.generate(prompts, params, use_tqdm=False, lora_request=loras)
            seconds = time.perf_counter() - started
            tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
            rates[name].append(tokens / seconds)
    baseline = statistics.median(rates["base"])
    print(
        f"{args.preset} preset, {args.requests} requests x {args.output_len} tokens, rank "
        f"{args.rank}, {args.device}, {args.threads} thread(s), {platform.machine()}"
    )
    print("| configuration | output tok/s (median) | vs base |")
    print("|---|---:|---:|")
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"| {name} | {rate:.0f} | {rate / baseline:.2f} |")
    base.close()
    lora.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
