"""Drive pagedinfer's scheduler from your own runtime, without torch.

``pagedinfer.domain`` is pure Python: a :class:`~pagedinfer.domain.Scheduler` decides what
each step computes and hands you a :class:`~pagedinfer.domain.BatchPlan` in flat integer
arrays (``array.array``); your :class:`~pagedinfer.domain.Executor` runs the plan and returns
a :class:`~pagedinfer.domain.StepOutput` with one sampled token per sample
(``plan.sample_indices``); the scheduler records them. The whole contract (failures
included) is :mod:`pagedinfer.domain.executor`'s docstring. Sampling parameters
reach the executor as deltas: each request's ``SamplingParams`` arrive once, with a slot
number (``plan.new_requests``), and each step names only the slot of every sampled row.
This example's executor is a fake: it "stores KV" by writing each
token id into its slot of a flat list, reads every sequence's context back through its
block table (so a wrong slot or block table shows up at once), and samples random token ids.
``examples/numpy_runtime.py`` is a real one (a model in NumPy). The scheduler's events
report preemptions as they happen.

The pool is deliberately small and the token budget low, so the printed plans show chunked
prefill, prefix-cache hits on a shared system prompt and preemption by recompute.

    python examples/custom_runtime.py [--seed 0] [--show-steps 6]
"""

from __future__ import annotations

import argparse
import random
import sys

from pagedinfer.domain import (
    PADDING_SLOT,
    BatchPlan,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    Sequence,
    SequencePreempted,
    StepOutput,
)

BLOCK_SIZE = 8
NUM_BLOCKS = 16  # 128 token slots: just one max_model_len sequence, so requests compete
MAX_MODEL_LEN = 128
MAX_NUM_BATCHED_TOKENS = 32  # smaller than the prompts: long prompts are prefilled in chunks
VOCAB_SIZE = 1000
EOS_TOKEN_ID = 0


class FakeExecutor:
    """Runs a :class:`BatchPlan` the way a paged-attention model would, minus the model.

    Anything with ``execute(plan) -> StepOutput`` (:class:`~pagedinfer.domain.Executor`)
    can drive the scheduler; this one keeps a token id per KV slot instead of K/V tensors.
    """

    def __init__(self, num_blocks: int, block_size: int, seed: int) -> None:
        self.block_size = block_size
        self.kv_slots: list[int | None] = [None] * (num_blocks * block_size)
        self.rng = random.Random(seed)
        self.sampling: dict[int, SamplingParams] = {}  # slot -> the request's parameters

    def execute(self, plan: BatchPlan) -> StepOutput:
        # 0. Keep the sampling table current: released slots first, then new requests; then
        #    copy the blocks a fork (n > 1) starts from. All of it is safe to apply twice.
        for slot in plan.released_slots:
            self.sampling.pop(slot, None)
        for request in plan.new_requests:
            self.sampling[request.slot] = request.params
        size = self.block_size
        for source, target in plan.block_copies:
            self.kv_slots[target * size : (target + 1) * size] = self.kv_slots[
                source * size : (source + 1) * size
            ]
        # 1. Store this step's tokens in their slots (padding rows have slot -1).
        for token_id, slot in zip(plan.input_ids, plan.slot_mapping, strict=True):
            if slot != PADDING_SLOT:
                self.kv_slots[slot] = token_id
        # 2. "Attend": each sequence reads its whole context back through its block table.
        for row in range(plan.num_seqs):
            context = self.context(plan, row)
            query = plan.input_ids[plan.cu_seqlens_q[row] : plan.cu_seqlens_q[row + 1]].tolist()
            if context[len(context) - len(query) :] != query:
                raise RuntimeError(f"seq {plan.seq_ids[row]}: KV read back != tokens written")
        # 3. Sample one token per sampled row (a real model would use the logits of row
        #    plan.sample_indices[i] and the parameters self.sampling[plan.sample_slots[i]]).
        assert all(slot in self.sampling for slot in plan.sample_slots)
        return StepOutput([self.rng.randrange(VOCAB_SIZE) for _ in plan.sample_indices])

    def context(self, plan: BatchPlan, row: int) -> list[int | None]:
        """The tokens sequence ``row`` attends to, gathered through its block table."""
        table = plan.block_table(row)
        size = self.block_size
        return [
            self.kv_slots[table[position // size] * size + position % size]
            for position in range(plan.context_lens[row])
        ]


def make_requests(rng: random.Random) -> list[Sequence]:
    """Five requests; four share a 3-block system prompt, so later ones hit the prefix cache."""
    system_prompt = [rng.randrange(1, VOCAB_SIZE) for _ in range(3 * BLOCK_SIZE)]
    requests = []
    for seq_id in range(5):
        prefix = system_prompt if seq_id != 2 else []
        question = [rng.randrange(1, VOCAB_SIZE) for _ in range(rng.randint(6, 20))]
        params = SamplingParams(temperature=0.7, max_tokens=rng.randint(12, 30), seed=seq_id)
        requests.append(Sequence(seq_id, prefix + question, params))
    return requests


def check_context(plan: BatchPlan, scheduler: Scheduler, executor: FakeExecutor) -> None:
    """Every sequence read exactly its own tokens, prefix-cache hits included.

    A real runtime has no reason to do this; here it shows that shared and recomputed
    blocks hold what the block tables claim.
    """
    for row, seq_id in enumerate(plan.seq_ids):
        seq = scheduler.get(seq_id)
        assert seq is not None  # scheduled sequences are unfinished until postprocess
        if executor.context(plan, row) != seq.token_ids[: plan.context_lens[row]]:
            raise RuntimeError(f"seq {seq_id} would attend to the wrong KV")


def describe(plan: BatchPlan, step: int) -> str:
    """A readable rendering of one plan: one line per scheduled sequence."""
    # A mixed step: the first num_decode_rows rows decode (one token each), the rest prefill.
    kind = "mixed" if plan.is_mixed else "prefill" if plan.is_prefill else "decode"
    if plan.is_mixed:
        kind += (
            f" ({plan.num_decode_rows} decode rows + {plan.num_seqs - plan.num_decode_rows} chunks)"
        )
    lines = [
        f"step {step}: {kind}, is_prefill={plan.is_prefill}, {plan.num_seqs} seqs, "
        f"{plan.num_tokens} query tokens, sample_indices={plan.sample_indices.tolist()} "
        f"(-> seqs {plan.sampled_seq_ids}, sampling slots {plan.sample_slots.tolist()})"
    ]
    for request in plan.new_requests:
        lines.append(f"  new request {request.seq_id} -> sampling slot {request.slot}")
    if plan.released_slots:
        lines.append(f"  released sampling slots {list(plan.released_slots)}")
    for row, seq_id in enumerate(plan.seq_ids):
        begin, end = plan.cu_seqlens_q[row], plan.cu_seqlens_q[row + 1]
        positions = plan.positions[begin:end].tolist()
        slots = plan.slot_mapping[begin:end].tolist()
        lines.append(
            f"  seq {seq_id}: query_len={plan.query_lens[row]:>2} "
            f"positions={_span(positions)} context_len={plan.context_lens[row]:>3} "
            f"slots={_span(slots)} block_table={_table(plan, row)}"
        )
    return "\n".join(lines)


def _table(plan: BatchPlan, row: int) -> str:
    """The padded block table, with filler entries (past the context) shown as ``-``."""
    used = -(-plan.context_lens[row] // plan.block_size)
    entries = [str(block_id) for block_id in plan.block_table(row)[:used]]
    entries += ["-"] * (plan.block_table_width - used)
    return "[" + ", ".join(entries) + "]"


def _span(values: list[int]) -> str:
    """``[a..b]`` for a contiguous run, else the runs joined (slots jump between blocks)."""
    runs: list[str] = []
    start = previous = values[0]
    for value in values[1:]:
        if value != previous + 1:
            runs.append(f"{start}..{previous}" if previous != start else f"{start}")
            start = value
        previous = value
    runs.append(f"{start}..{previous}" if previous != start else f"{start}")
    return "[" + ", ".join(runs) + "]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="seeds prompts and samples")
    parser.add_argument("--show-steps", type=int, default=6, help="plans to print in full")
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK_SIZE,
            max_num_seqs=8,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            max_model_len=MAX_MODEL_LEN,
            eos_token_ids=frozenset({EOS_TOKEN_ID}),
        ),
        record_events=True,  # preemptions, prefix-cache hits, finishes: drain_events()
    )
    executor = FakeExecutor(NUM_BLOCKS, BLOCK_SIZE, seed=args.seed)
    requests = make_requests(rng)
    for seq in requests:
        scheduler.add(seq)

    print(
        f"pool: {NUM_BLOCKS} blocks x {BLOCK_SIZE} tokens; max_num_batched_tokens="
        f"{MAX_NUM_BATCHED_TOKENS}; prompts: "
        + ", ".join(f"seq {seq.seq_id}={seq.num_prompt_tokens}" for seq in requests)
    )
    step = 0
    while True:
        plan = scheduler.schedule()
        if plan is None:
            break
        step += 1
        if step <= args.show_steps:
            print(describe(plan, step))
        for event in scheduler.drain_events():
            if isinstance(event, SequencePreempted):  # by this schedule() call
                print(
                    f"step {step}: seq {event.seq_id} preempted (no free block): it released "
                    "its blocks, went back to the front of the queue and will be recomputed"
                )
        output = executor.execute(plan)
        check_context(plan, scheduler, executor)
        scheduler.postprocess(plan, output.sampled_token_ids)
        if step > 10_000:
            raise RuntimeError("the scheduler did not finish: this is a bug")

    print(f"\nfinished after {step} steps")
    for seq in requests:
        completion = seq.completion_token_ids
        print(
            f"  seq {seq.seq_id}: prompt={seq.num_prompt_tokens} cached={seq.num_cached_tokens} "
            f"completion={len(completion)} finish_reason={seq.finish_reason} "
            f"first tokens={completion[:6]}"
        )
    pool = scheduler.pool.stats()
    sched = scheduler.stats()
    print(
        f"pool: free={pool.num_free_blocks}/{pool.num_blocks} usage={pool.usage:.2f} "
        f"cached_blocks={pool.num_cached_blocks} prefix_hits={pool.prefix_hit_tokens}/"
        f"{pool.prefix_query_tokens} tokens ({pool.prefix_hit_rate:.0%})"
    )
    print(
        f"scheduler: prefill_steps={sched.num_prefill_steps} mixed_steps="
        f"{sched.num_mixed_steps} decode_steps={sched.num_decode_steps} "
        f"preemptions={sched.num_preemptions} "
        f"waiting={sched.num_waiting} running={sched.num_running}"
    )
    print(f"torch imported: {'torch' in sys.modules}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
