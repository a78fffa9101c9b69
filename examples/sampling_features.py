"""What a vLLM user reaches for, with pagedinfer: n completions, logprobs, penalties, chat().

``Engine`` takes vLLM's ``SamplingParams`` fields and returns vLLM-shaped outputs
(``output.outputs[i].text``). Without ``--model`` this builds a small checkpoint with RANDOM
weights (the text is gibberish; the mechanics are real)::

    python examples/sampling_features.py [--model DIR]
"""

from __future__ import annotations

import argparse
import tempfile

from pagedinfer import Engine, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a local checkpoint directory")
    args = parser.parse_args()
    if args.model is not None:
        run(args.model)
        return
    from pagedinfer.adapters.models.random_checkpoint import build_random_checkpoint

    with tempfile.TemporaryDirectory() as folder:  # removed with its checkpoint at the end
        run(str(build_random_checkpoint(folder, "tiny", with_tokenizer=True, seed=0)))


def run(model: str) -> None:
    with Engine(model=model, max_model_len=256, kv_block_size=16) as engine:
        # n completions of one prompt share its KV; completion i is seeded seed + i.
        params = SamplingParams(
            n=3,
            seed=0,
            temperature=0.8,
            max_tokens=12,
            logprobs=2,  # top-2 logprobs (plus the sampled token's) for every generated token
            presence_penalty=0.5,
            repetition_penalty=1.1,
        )
        (output,) = engine.generate({"prompt": "Paged attention is"}, params, use_tqdm=False)
        for completion in output.outputs:
            print(
                f"[{completion.index}] {completion.text!r} ({completion.finish_reason}, "
                f"cumulative logprob {completion.cumulative_logprob:.2f})"
            )
        first = output.outputs[0]
        assert first.logprobs is not None
        print("logprobs of the first token:", first.logprobs[0])

        # Prompt logprobs; min_tokens holds EOS back; logit_bias and allowed_token_ids steer.
        params = SamplingParams(
            prompt_logprobs=1,
            min_tokens=4,
            max_tokens=8,
            temperature=0.0,
            logit_bias={5: 2.0},
            allowed_token_ids=list(range(100)),
        )
        (output,) = engine.generate([1, 2, 3, 4], params, use_tqdm=False)
        print("prompt logprobs:", output.prompt_logprobs)

        # chat() renders the conversation with the tokenizer's chat template.
        (reply,) = engine.chat(
            [{"role": "user", "content": "Hello!"}],
            SamplingParams(max_tokens=8, temperature=0.0),
            use_tqdm=False,
        )
        print("chat prompt:", repr(reply.prompt), "->", repr(reply.outputs[0].text))

        # stream() yields deltas shaped like outputs: only what is new.
        for delta in engine.stream("Once upon a time", SamplingParams(max_tokens=6, n=2)):
            print("delta:", [(c.index, c.text) for c in delta.outputs], delta.finished)


if __name__ == "__main__":
    main()
