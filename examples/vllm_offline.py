"""A vLLM offline script on pagedinfer: the one change is the import (and a local model).

``LLM`` takes vLLM's constructor arguments, ``generate`` and ``chat`` vLLM's positional
order, and the outputs have vLLM's attribute names. Without ``--model`` this builds a small
checkpoint with RANDOM weights (the text is gibberish; the mechanics are real)::

    python examples/vllm_offline.py [--model DIR]
"""

from __future__ import annotations

import argparse
import tempfile

from pagedinfer import LLM, SamplingParams  # was: from vllm import LLM, SamplingParams


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
    # vLLM's arguments: those pagedinfer has no use for are accepted (trust_remote_code,
    # swap_space) or refused by name (quantization="awq" raises ConfigurationError).
    llm = LLM(model=model, dtype="float32", max_model_len=512, trust_remote_code=True)

    prompts = ["Hello, my name is", "The capital of France is"]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)  # max_tokens: 16, as vLLM
    for output in llm.generate(prompts, sampling_params):
        print(f"[{output.request_id}] {output.prompt!r} -> {output.outputs[0].text!r}")

    conversation = [{"role": "user", "content": "Say hello."}]
    (reply,) = llm.chat(conversation, SamplingParams(temperature=0.0, max_tokens=8))
    print(f"chat -> {reply.outputs[0].text!r} ({reply.outputs[0].finish_reason})")

    tokenizer = llm.get_tokenizer()
    print(f"tokenizer: {type(tokenizer).__name__}, {len(tokenizer)} tokens")
    llm.close()


if __name__ == "__main__":
    main()
