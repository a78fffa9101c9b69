"""Command line: ``pagedinfer generate``, ``demo``, ``bench`` and ``serve``.

Also reachable as ``python -m pagedinfer``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]

DEMO_PROMPTS = (
    "Explain how paged attention works.",
    "Write a short poem about the sea.",
    "What is the capital of France?",
    "Once upon a time there was a small language model",
    "The quick brown fox",
    "Hello, world! How are you today?",
    "Prefix caching shares the blocks of a common prompt prefix.",
    "The scheduler admits waiting requests while memory allows.",
)


def _engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    group.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    group.add_argument("--max-model-len", type=int, default=4096)
    group.add_argument("--max-num-seqs", type=int, default=512)
    group.add_argument("--max-num-batched-tokens", type=int, default=16384)
    group.add_argument("--kv-block-size", type=int, default=256)
    group.add_argument("--num-kv-blocks", type=int, default=None)
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    group.add_argument("--tensor-parallel-size", type=int, default=1)
    group.add_argument("--attention-backend", default="auto", help="auto, torch, triton or flash")
    group.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    group.add_argument("--no-prefix-caching", action="store_true")
    group.add_argument("--seed", type=int, default=0)


def _sampling_arguments(parser: argparse.ArgumentParser, *, temperature: float) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--temperature", type=float, default=temperature)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--max-tokens", type=int, default=64)
    group.add_argument("--ignore-eos", action="store_true")
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedinfer", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate for one or more prompts")
    generate.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
    generate.add_argument("--prompt", action="append", default=[], help="text prompt (repeatable)")
    generate.add_argument(
        "--token-ids", action="append", default=[], help="comma-separated token ids (repeatable)"
    )
    _engine_arguments(generate)
    _sampling_arguments(generate, temperature=0.0)

    demo = commands.add_parser("demo", help="generate with a small local checkpoint")
    demo.add_argument("--model", default=None, help="checkpoint dir (default: build a random one)")
    demo.add_argument(
        "--checkpoint-dir", default=".demo-model", help="where the random demo checkpoint is built"
    )
    _engine_arguments(demo)
    _sampling_arguments(demo, temperature=0.8)

    bench = commands.add_parser("bench", help="quick engine-only throughput run")
    bench.add_argument("--model", default=None, help="checkpoint dir (default: random 'small')")
    bench.add_argument("--random-weights", default="small", help="preset when --model is absent")
    bench.add_argument("--checkpoint-dir", default=".bench-cache/model")
    bench.add_argument("--num-requests", type=int, default=64)
    bench.add_argument("--input-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    bench.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    _engine_arguments(bench)

    serve = commands.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (needs pip install 'pagedinfer[serve]')",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and "
        "/metrics (see docs/serving.md).",
    )
    serve.add_argument("model_dir", metavar="MODEL_DIR", help="local Hugging Face checkpoint")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="port (default %(default)s)")
    serve.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send (default: MODEL_DIR as given)",
    )
    serve.add_argument("--log-level", default="info", help="uvicorn's log level")
    _engine_arguments(serve)
    return parser


def _engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    return {
        "device": args.device,
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_block_size": args.kv_block_size,
        "num_kv_blocks": args.num_kv_blocks,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "tensor_parallel_size": args.tensor_parallel_size,
        "attention_backend": args.attention_backend,
        "enforce_eager": args.enforce_eager,
        "enable_prefix_caching": not args.no_prefix_caching,
        "seed": args.seed,
    }


def _sampling_params(args: argparse.Namespace) -> object:
    from pagedinfer import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
        stop=tuple(args.stop),
        seed=args.sample_seed,
    )


def _run_generate(args: argparse.Namespace) -> int:
    from pagedinfer import Engine

    prompts: list[str | list[int]] = list(args.prompt)
    prompts.extend([int(t) for t in ids.split(",") if t.strip()] for ids in args.token_ids)
    if not prompts:
        print("error: give at least one --prompt or --token-ids", file=sys.stderr)
        return 2
    with Engine(args.model, **_engine_kwargs(args)) as engine:  # type: ignore[arg-type]
        outputs = engine.generate(prompts, _sampling_params(args))  # type: ignore[arg-type]
    for output in outputs:
        shown = output.text if output.text else " ".join(map(str, output.token_ids))
        print(f"[{output.request_id}] ({output.finish_reason}) {shown}")
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    from pagedinfer import Engine

    model = args.model
    if model is None:
        model = _demo_checkpoint(Path(args.checkpoint_dir))
        print(
            f"Using a small Qwen3 checkpoint with RANDOM WEIGHTS at {model}: the generated text "
            "is gibberish; it shows the engine at work. Pass MODEL=/path/to/checkpoint for a "
            "real model."
        )
    with Engine(model, **_engine_kwargs(args)) as engine:  # type: ignore[arg-type]
        started = time.perf_counter()
        outputs = engine.generate(list(DEMO_PROMPTS), _sampling_params(args))  # type: ignore[arg-type]
        seconds = time.perf_counter() - started
        stats = engine.stats()
    for prompt, output in zip(DEMO_PROMPTS, outputs, strict=True):
        print(f"\nprompt: {prompt!r}\noutput: {output.text!r} ({output.finish_reason})")
    generated = sum(len(output.token_ids) for output in outputs)
    print(
        f"\n{len(outputs)} requests, {generated} generated tokens in {seconds:.2f} s "
        f"({generated / seconds:.1f} tok/s end to end; prefill {stats.prefill_throughput:.0f} "
        f"tok/s, decode {stats.decode_throughput:.0f} tok/s) on {engine.device}, "
        f"{engine.attention_backend} attention"
    )
    return 0


def _demo_checkpoint(directory: Path) -> str:
    if not (directory / "config.json").exists() or not (directory / "tokenizer.json").exists():
        from pagedinfer.adapters.models.random_checkpoint import build_random_checkpoint

        print(f"Building a random-weight Qwen3 checkpoint with a tokenizer in {directory} ...")
        build_random_checkpoint(directory, "small", with_tokenizer=True, seed=0)
    return str(directory)


def _run_bench(args: argparse.Namespace) -> int:
    from pagedinfer import Engine, SamplingParams

    model = args.model
    if model is None:
        from pagedinfer.adapters.models.random_checkpoint import build_random_checkpoint

        directory = Path(args.checkpoint_dir) / args.random_weights
        if not (directory / "config.json").exists():
            build_random_checkpoint(directory, args.random_weights, seed=0)
        model = str(directory)
    rng = random.Random(0)
    with Engine(model, **_engine_kwargs(args)) as engine:  # type: ignore[arg-type]
        vocab = min(engine.model_config.vocab_size, 10000)
        prompts = [
            [rng.randrange(vocab) for _ in range(rng.randint(*args.input_len))]
            for _ in range(args.num_requests)
        ]
        params = [
            SamplingParams(
                temperature=0.6, ignore_eos=True, max_tokens=rng.randint(*args.output_len)
            )
            for _ in prompts
        ]
        engine.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        started = time.perf_counter()
        outputs = engine.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
    generated = sum(len(output.token_ids) for output in outputs)
    print(f"{generated} tokens in {seconds:.2f} s: {generated / seconds:.1f} output tok/s")
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    try:
        from pagedinfer.serving.server import run_server
    except ImportError as error:
        print(
            f"error: pagedinfer serve needs the serve extra ({error.name or error} is missing): "
            "pip install 'pagedinfer[serve]'",
            file=sys.stderr,
        )
        return 2
    run_server(
        args.model_dir,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        log_level=args.log_level,
        engine_kwargs=_engine_kwargs(args),
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "generate":
        return _run_generate(args)
    if args.command == "demo":
        return _run_demo(args)
    if args.command == "serve":
        return _run_serve(args)
    return _run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
