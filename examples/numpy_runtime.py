"""Run a Qwen3 / Llama checkpoint with NumPy alone, driven by pagedinfer's scheduler.

A real executor for :mod:`pagedinfer.domain`, without torch: it reads the checkpoint's
safetensors with NumPy, keeps the K/V of every layer in paged arrays (``num_blocks *
block_size`` slots), stores each step's K/V at the plan's ``slot_mapping``, attends through the
plan's block tables and samples greedily. Its tokens equal ``Engine``'s (greedy, float32) token
for token: ``tests/unit/test_examples.py`` checks that on the project's random checkpoints.

It follows the executor contract of :mod:`pagedinfer.domain.executor` (read it first): the
plan's arrays are viewed with ``np.frombuffer(array, dtype=array.typecode)`` (no copy), the
sampling-table deltas and block copies are applied before the forward, and nothing it keeps
depends on sampled tokens, so a failed step needs no undo. ``--fail-every K`` shows both ways to
recover: every K-th step "fails" after running, and the loop alternately schedules again and
re-runs the same plan; the tokens do not change. Several completions (``--n``) fork with
:func:`~pagedinfer.domain.make_forks`; the scheduler's events report preemptions, prefix-cache
hits and finishes.

    python examples/numpy_runtime.py CHECKPOINT_DIR [--prompts '[[1, 2, 3], [1, 2, 4]]']
        [--max-tokens 16] [--n 2] [--num-blocks 64] [--block-size 16] [--fail-every 5] [--json]

``CHECKPOINT_DIR`` is a Hugging Face checkpoint (``config.json`` + ``*.safetensors``) of a dense
Qwen3, Qwen2, Llama or Mistral model; ``make demo`` builds a random one in ``.demo-model``.
float16 and bfloat16 weights are widened to float32. Only NumPy and pagedinfer's core install
are needed.
"""

from __future__ import annotations

import argparse
import json
import sys
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedinfer.domain import (
    PADDING_SLOT,
    BatchPlan,
    Executor,
    PrefixCacheHit,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    Sequence,
    SequenceFinished,
    SequencePreempted,
    StepOutput,
    make_forks,
)

Floats = npt.NDArray[np.float32]

SUPPORTED = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM")


# ----------------------------------------------------------------------- the checkpoint


def load_safetensors(directory: Path) -> dict[str, Floats]:
    """Every tensor of ``directory/*.safetensors`` as a float32 array.

    The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
    byte offsets) and the raw data; bfloat16 is float32 with the low 16 bits cut off.
    """
    tensors: dict[str, Floats] = {}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory}")
    for path in files:
        raw = path.read_bytes()
        length = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + length])
        data = memoryview(raw)[8 + length :]
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            chunk = data[begin:end]
            kind = info["dtype"]
            if kind == "BF16":
                widened = np.frombuffer(chunk, dtype="<u2").astype(np.uint32) << 16
                values = widened.view(np.float32)
            elif kind in ("F32", "F16"):
                values = np.frombuffer(chunk, dtype="<f4" if kind == "F32" else "<f2")
            else:
                raise ValueError(f"{name}: dtype {kind} is not a float type this example reads")
            tensors[name] = values.astype(np.float32).reshape(info["shape"])
    return tensors


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before RoPE
    eos_token_ids: frozenset[int]

    @classmethod
    def read(cls, directory: Path) -> ModelConfig:
        config: dict[str, Any] = json.loads((directory / "config.json").read_text())
        architecture = config["architectures"][0]
        if architecture not in SUPPORTED:
            raise ValueError(f"{architecture} is not one of {', '.join(SUPPORTED)}")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"RoPE scaling {rope} is not implemented in this example")
        theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        eos: set[int] = set()
        for source in (config, _json_or_empty(directory / "generation_config.json")):
            value = source.get("eos_token_id")
            eos.update([value] if isinstance(value, int) else value or [])
        heads = int(config["num_attention_heads"])
        return cls(
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads", heads)),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            rms_norm_eps=float(config["rms_norm_eps"]),
            rope_theta=theta,
            qk_norm=architecture == "Qwen3ForCausalLM",
            eos_token_ids=frozenset(eos),
        )


def _json_or_empty(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text())) if path.exists() else {}


# ------------------------------------------------------------------------- the model


def rms_norm(x: Floats, weight: Floats, eps: float) -> Floats:
    variance = np.mean(x * x, axis=-1, keepdims=True)
    normed: Floats = weight * (x / np.sqrt(variance + np.float32(eps)))
    return normed


def silu(x: Floats) -> Floats:
    out: Floats = x / (1 + np.exp(-x))
    return out


def rotate(x: Floats, cos: Floats, sin: Floats) -> Floats:
    """RoPE on ``x [T, heads, head_dim]`` (the two halves rotate together, as in HF)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate((x1 * cos - x2 * sin, x2 * cos + x1 * sin), axis=-1)


def plan_array(values: array[int]) -> npt.NDArray[np.signedinteger[Any]]:
    """A plan field as a NumPy array: a view of the same memory, no copy (NumPy reads the
    typecode, ``"q"`` or ``"i"``, as int64 or int32). Read-only by the plan's contract."""
    return np.frombuffer(values, dtype=values.typecode)


class NumpyExecutor:
    """Runs :class:`BatchPlan` s on a dense decoder with paged K/V arrays, greedily."""

    def __init__(self, weights: dict[str, Floats], config: ModelConfig, num_slots: int) -> None:
        self.w = weights
        self.config = config
        self.embed = weights["model.embed_tokens.weight"]
        self.lm_head = weights.get("lm_head.weight", self.embed)  # tied when absent
        shape = (num_slots, config.num_kv_heads, config.head_dim)
        self.k_cache = [np.zeros(shape, np.float32) for _ in range(config.num_layers)]
        self.v_cache = [np.zeros(shape, np.float32) for _ in range(config.num_layers)]
        exponents = np.arange(0, config.head_dim, 2, dtype=np.float32) / config.head_dim
        self.inv_freq = (1.0 / config.rope_theta**exponents).astype(np.float32)
        self.sampling: dict[int, SamplingParams] = {}  # slot -> the request's parameters

    def execute(self, plan: BatchPlan) -> StepOutput:
        # 1. The sampling table: releases, then installs (idempotent: a re-run repeats them).
        for slot in plan.released_slots:
            self.sampling.pop(slot, None)
        for request in plan.new_requests:
            if not request.params.is_greedy or request.params.uses_logits_processing:
                raise ValueError(f"request {request.seq_id}: this executor only samples greedily")
            self.sampling[request.slot] = request.params
        # 2. Block copies (a fork's copy of the prompt's partial last block), before the forward.
        size = plan.block_size
        for source, target in plan.block_copies:
            for cache in (*self.k_cache, *self.v_cache):
                cache[target * size : (target + 1) * size] = cache[
                    source * size : (source + 1) * size
                ]
        # 3. The forward pass over every query token of the step.
        hidden = self.forward(plan)
        # 4. Greedy sampling at the sampled rows (a forking row appears once per completion).
        rows = hidden[plan_array(plan.sample_indices)]
        rows = rms_norm(rows, self.w["model.norm.weight"], self.config.rms_norm_eps)
        logits = rows @ self.lm_head.T
        return StepOutput([int(token) for token in np.argmax(logits, axis=-1)])

    def forward(self, plan: BatchPlan) -> Floats:
        c, w = self.config, self.w
        positions = plan_array(plan.positions)
        slots = plan_array(plan.slot_mapping)
        stored = slots != PADDING_SLOT
        angles = positions[:, None].astype(np.float32) * self.inv_freq[None, :]
        cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
        x = self.embed[plan_array(plan.input_ids)]
        for layer in range(c.num_layers):
            p = f"model.layers.{layer}."
            h = rms_norm(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)
            q = self.linear(h, p + "self_attn.q_proj").reshape(-1, c.num_heads, c.head_dim)
            k = self.linear(h, p + "self_attn.k_proj").reshape(-1, c.num_kv_heads, c.head_dim)
            v = self.linear(h, p + "self_attn.v_proj").reshape(-1, c.num_kv_heads, c.head_dim)
            if c.qk_norm:
                q = rms_norm(q, w[p + "self_attn.q_norm.weight"], c.rms_norm_eps)
                k = rms_norm(k, w[p + "self_attn.k_norm.weight"], c.rms_norm_eps)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            self.k_cache[layer][slots[stored]] = k[stored]  # the paged store
            self.v_cache[layer][slots[stored]] = v[stored]
            attended = self.attend(plan, layer, q)
            x = x + self.linear(attended.reshape(len(x), -1), p + "self_attn.o_proj")
            h = rms_norm(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
            gate = self.linear(h, p + "mlp.gate_proj")
            up = self.linear(h, p + "mlp.up_proj")
            x = x + self.linear(silu(gate) * up, p + "mlp.down_proj")
        hidden: Floats = x
        return hidden

    def attend(self, plan: BatchPlan, layer: int, q: Floats) -> Floats:
        """Causal attention of each row's queries to its context, read through its block table."""
        c = self.config
        out = np.empty_like(q)
        group = c.num_heads // c.num_kv_heads
        scale = np.float32(c.head_dim**-0.5)
        size = plan.block_size
        for row in range(plan.num_seqs):
            begin, end = plan.cu_seqlens_q[row], plan.cu_seqlens_q[row + 1]
            context = plan.context_lens[row]
            table = np.asarray(plan.block_table(row), dtype=np.int64)
            where = np.arange(context)
            slots = table[where // size] * size + where % size  # position -> KV slot
            keys = np.repeat(self.k_cache[layer][slots], group, axis=1)  # [context, heads, d]
            values = np.repeat(self.v_cache[layer][slots], group, axis=1)
            scores = np.einsum("qhd,khd->hqk", q[begin:end], keys) * scale
            first = context - (end - begin)  # position of the first query token
            causal = where[None, :] > (first + np.arange(end - begin))[:, None]
            scores = np.where(causal[None], np.float32(-np.inf), scores)
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs = scores / scores.sum(axis=-1, keepdims=True)
            out[begin:end] = np.einsum("hqk,khd->qhd", probs, values)
        return out

    def linear(self, x: Floats, name: str) -> Floats:
        y: Floats = x @ self.w[name + ".weight"].T
        bias = self.w.get(name + ".bias")
        return y if bias is None else y + bias


# --------------------------------------------------------------------------- the loop


def generate(
    directory: Path,
    prompts: list[list[int]],
    *,
    max_tokens: int,
    n: int,
    num_blocks: int,
    block_size: int,
    max_num_batched_tokens: int,
    fail_every: int,
    log: bool,
) -> dict[str, Any]:
    """Generate greedily for every prompt; return the completions and what happened."""
    config = ModelConfig.read(directory)
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=16,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=num_blocks * block_size,
            eos_token_ids=config.eos_token_ids,
        ),
        record_events=True,
    )
    executor: Executor = NumpyExecutor(load_safetensors(directory), config, num_blocks * block_size)
    requests: list[list[Sequence]] = []
    next_id = 0
    for prompt in prompts:
        first = Sequence(
            next_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n)
        )
        forks = make_forks(first)  # completions 1..n-1: ids next_id + 1 ...
        scheduler.add(first, forks=forks)
        requests.append([first, *forks])
        next_id += n
    counts = {"steps": 0, "failed_steps": 0, "preemptions": 0, "prefix_hit_tokens": 0}
    plan = scheduler.schedule()
    while plan is not None:
        output = executor.execute(plan)
        counts["steps"] += 1
        if fail_every and counts["steps"] % fail_every == 0:
            # Pretend the step failed after the executor ran. Either schedule again (the work
            # is planned again) or run the same plan again: both are allowed (the contract in
            # pagedinfer.domain.executor); the tokens are the same either way.
            counts["failed_steps"] += 1
            if counts["failed_steps"] % 2:
                plan = scheduler.schedule()
            continue
        scheduler.postprocess(plan, output.sampled_token_ids)
        for event in scheduler.drain_events():
            if isinstance(event, SequencePreempted):
                counts["preemptions"] += 1
            elif isinstance(event, PrefixCacheHit):
                counts["prefix_hit_tokens"] += event.num_cached_tokens
            if log and isinstance(event, SequenceFinished):
                print(f"step {plan.step_id}: seq {event.seq_id} finished ({event.reason})")
            elif log:
                print(f"step {plan.step_id}: {event}")
        plan = scheduler.schedule()
    pool = scheduler.pool.stats()
    assert pool.num_free_blocks == pool.num_blocks, "finished requests free every block"
    outputs = [[seq.completion_token_ids for seq in seqs] for seqs in requests]
    return {"outputs": outputs, **counts}


def default_prompts(vocab: int) -> list[list[int]]:
    """Three prompts sharing a 40-token prefix (prefix-cache hits) and one of their own."""
    rng = np.random.default_rng(0)
    shared = rng.integers(1, vocab, 40).tolist()
    return [
        shared + rng.integers(1, vocab, 7).tolist(),
        shared + rng.integers(1, vocab, 12).tolist(),
        shared + rng.integers(1, vocab, 3).tolist(),
        rng.integers(1, vocab, 25).tolist(),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoint directory")
    parser.add_argument("--prompts", help="a JSON list of token-id lists (default: 4 prompts)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--n", type=int, default=1, help="completions per prompt")
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=64)
    parser.add_argument("--fail-every", type=int, default=0, help="fake a failed step every K")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.prompts:
        prompts = json.loads(args.prompts)
    else:
        vocab = json.loads((args.checkpoint / "config.json").read_text())["vocab_size"]
        prompts = default_prompts(int(vocab))
    result = generate(
        args.checkpoint,
        prompts,
        max_tokens=args.max_tokens,
        n=args.n,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        fail_every=args.fail_every,
        log=not args.json,
    )
    if args.json:
        print(json.dumps(result))
        return 0
    for index, completions in enumerate(result["outputs"]):
        for completion in completions:
            print(f"prompt {index}: {completion}")
    summary = ", ".join(f"{key}={value}" for key, value in result.items() if key != "outputs")
    print(f"{summary}; torch imported: {'torch' in sys.modules}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
