"""A tiny policy-gradient loop: rollouts from pagedinfer, training in torch, weights pushed
back into the live engine after every step (docs/rl.md).

The policy is a small random Qwen3 checkpoint (written with transformers' ``save_pretrained``
unless ``--model`` names one); the trainer holds a float32 transformers copy of it. Each round:

1. the engine samples ``--group`` completions per prompt, with the logprob of every sampled
   token (``logprobs=0``; ``logprobs_mode="raw_logprobs"``: the model's own distribution,
   before temperature and filters);
2. the trainer recomputes those logprobs with its forward over prompt + completion and
   compares them with the engine's (float32: they agree within 2e-4), so a mismatch between
   the rollout policy and the trained one is seen at once;
3. reward: how many of the completion's tokens are below ``--target-below`` (a reward anyone
   can compute; a random policy gets 1/8 of them at the defaults); advantage: reward minus
   the mean of its prompt's group (GRPO-style); one optimizer step on
   ``-(advantage * sum of logprobs)``;
4. ``engine.update_weights(trainer.named_parameters())``: the new weights, in place, in
   checkpoint names, no file written; the next round samples from them.

::

    python examples/rl_loop.py [--rounds 8] [--model DIR]
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

from pagedinfer import Engine, SamplingParams


@dataclass(frozen=True)
class Round:
    """What one round measured."""

    mean_reward: float
    max_logprob_gap: float  # the largest |engine logprob - trainer logprob| of a sampled token
    max_weight_change: float  # the largest change the optimizer step made to a weight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a local checkpoint directory")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--target-below", type=int, default=64, help="rewarded token ids")
    parser.add_argument("--lr", type=float, default=3e-2)
    args = parser.parse_args()
    options = {
        "rounds": args.rounds,
        "num_prompts": args.prompts,
        "group": args.group,
        "max_tokens": args.max_tokens,
        "target_below": args.target_below,
        "lr": args.lr,
    }
    if args.model is not None:
        rounds = train(args.model, **options)
    else:
        from pagedinfer.adapters.models.random_checkpoint import build_random_checkpoint

        with tempfile.TemporaryDirectory() as folder:
            rounds = train(str(build_random_checkpoint(folder, "tiny", seed=0)), **options)
    for index, result in enumerate(rounds):
        print(
            f"round {index}: mean reward {result.mean_reward:.3f}, "
            f"max |engine - trainer| logprob {result.max_logprob_gap:.2e}, "
            f"largest weight change {result.max_weight_change:.2e}"
        )


def train(
    model: str,
    *,
    rounds: int,
    num_prompts: int,
    group: int,
    max_tokens: int,
    target_below: int,
    lr: float,
    seed: int = 0,
) -> list[Round]:
    """Run the loop on checkpoint ``model``; what each round measured."""
    from transformers import AutoModelForCausalLM

    trainer: Any = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    optimizer = torch.optim.Adam(trainer.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    vocab = trainer.config.vocab_size
    prompts = [torch.randint(vocab, (8,), generator=generator).tolist() for _ in range(num_prompts)]
    results = []
    with Engine(
        model,
        device="cpu",
        dtype="float32",
        kv_block_size=16,
        max_model_len=64,
        num_kv_blocks=4 * num_prompts * group,
        logprobs_mode="raw_logprobs",
    ) as engine:
        for index in range(rounds):
            params = SamplingParams(
                n=group,
                temperature=1.0,
                max_tokens=max_tokens,
                ignore_eos=True,
                logprobs=0,  # the sampled token's logprob only
                seed=seed + 1000 * index,
            )
            outputs = engine.generate(prompts, params, use_tqdm=False)
            loss = torch.zeros(())
            rewards: list[float] = []
            gap = 0.0
            for prompt, output in zip(prompts, outputs, strict=True):
                completions = output.outputs
                group_rewards = [
                    float(sum(token < target_below for token in c.token_ids)) for c in completions
                ]
                baseline = sum(group_rewards) / len(group_rewards)
                rewards += group_rewards
                for completion, reward in zip(completions, group_rewards, strict=True):
                    tokens = list(completion.token_ids)
                    assert completion.logprobs is not None
                    engine_logprobs = torch.tensor(
                        [
                            entry[token].logprob
                            for token, entry in zip(tokens, completion.logprobs, strict=True)
                        ]
                    )
                    logits = trainer(torch.tensor([prompt + tokens])).logits[
                        0, len(prompt) - 1 : -1
                    ]
                    logprobs = torch.log_softmax(logits.float(), -1)
                    taken = logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0]
                    gap = max(gap, float((taken.detach() - engine_logprobs).abs().max()))
                    loss = loss - (reward - baseline) * taken.sum()
            optimizer.zero_grad()
            (loss / len(rewards)).backward()
            before = [param.detach().clone() for param in trainer.parameters()]
            optimizer.step()
            change = max(
                float((param.detach() - old).abs().max())
                for param, old in zip(trainer.parameters(), before, strict=True)
            )
            # Push the new weights into the live engine: no checkpoint file, no restart.
            engine.update_weights(trainer.named_parameters())
            results.append(Round(sum(rewards) / len(rewards), gap, change))
    return results


if __name__ == "__main__":
    main()
