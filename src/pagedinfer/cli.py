"""Command line: ``pagedinfer generate``, ``demo``, ``bench``, ``serve``, ``check-weights``
and ``quantize``.

Also reachable as ``python -m pagedinfer``. A user error (a path that is no checkpoint, a
value out of range, a malformed option) prints one line on stderr and exits with status 2,
without a traceback; ``--help`` on every command shows each option's default.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import NoReturn

__all__ = ["EXIT_ENGINE_DEAD", "EXIT_FAILURE", "EXIT_INTERRUPTED", "EXIT_USER_ERROR", "main"]

EXIT_USER_ERROR = 2
"""Bad input: options, paths, values (argparse's convention)."""
EXIT_FAILURE = 1
"""The input was fine but the run failed (out of memory, a worker died)."""
EXIT_INTERRUPTED = 130
"""Ctrl-C (128 + SIGINT, as shells report it)."""
EXIT_ENGINE_DEAD = 3
"""``serve``: the engine failed while serving and the server shut down; restart it."""

_DESCRIPTION = (
    "Command line of pagedinfer: generate, demo, bench, serve, check-weights and quantize "
    "(also python -m pagedinfer). "
    "A user error (a path that is no checkpoint, a value out of range, a malformed option) "
    "prints one line on stderr and exits with status 2, without a traceback; --help on every "
    "command shows each option's default."
)

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


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (its own repeat the whole usage, many lines, first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default, but not for flags (their default is always off)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.nargs == 0 or action.default in (None, [], argparse.SUPPRESS):
            return action.help
        return super()._get_help_string(action)


def _token_ids(text: str) -> list[int]:
    """argparse type of ``--token-ids``: comma-separated non-negative integers."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}")
    try:
        ids = [int(part) for part in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integer token ids (e.g. 1,2,3), got {text!r}"
        ) from None
    return ids


def _engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's options as flags, built from their one declaration: ``EngineConfig``'s
    fields (engine/config.py), each with its ``CliFlag`` (help text, aliases, parsing) and
    its default. Imported here, not at the top: it loads torch."""
    from dataclasses import fields

    from pagedinfer.engine.config import CLI_FLAG, CliFlag, EngineConfig

    groups: dict[str, argparse._ArgumentGroup] = {}
    for option in fields(EngineConfig):
        flag = option.metadata.get(CLI_FLAG)
        if not isinstance(flag, CliFlag):
            continue  # model_path: MODEL_DIR or --model
        if flag.group not in groups:
            groups[flag.group] = parser.add_argument_group(flag.group)
        group = groups[flag.group]
        default = flag.default(option.default)
        if flag.members is not None:  # a composite option: one integer flag per member
            for member, text in flag.members.items():
                value = getattr(default, member)
                group.add_argument(
                    f"--{flag.member_prefix}-{member.replace('_', '-')}",
                    type=int,
                    metavar="N",
                    default=value,
                    dest=f"{flag.member_prefix}_{member}",
                    help=f"{text} (default {value})",
                )
            continue
        names = (f"--{option.name.replace('_', '-')}", *flag.aliases)
        if flag.switch:  # --x, or --x / --no-x when on (or decided later) by default
            action = "store_true" if default is False else argparse.BooleanOptionalAction
            group.add_argument(
                *names, dest=option.name, action=action, default=default, help=flag.help
            )
            continue
        parse = flag.parse or type(default)
        group.add_argument(
            *names,
            dest=option.name,
            type=_argument_type(parse),
            default=default,
            metavar=flag.metavar,
            choices=flag.choices,
            help=flag.help,
        )
    groups["engine"].add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help=argparse.SUPPRESS,  # the old spelling of --no-enable-prefix-caching
    )


def _argument_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """argparse's ``type`` for an option's parser: int, float and str as they are (argparse
    names them in its messages); another parser's ValueError message shown as it is."""
    if parse in (int, float, str):
        return parse

    def convert(text: str) -> object:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def _sampling_arguments(parser: argparse.ArgumentParser, *, temperature: float) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument(
        "--temperature", type=float, metavar="X", default=temperature, help="0 is greedy (argmax)"
    )
    group.add_argument("--top-k", type=int, metavar="N", default=0, help="0 or -1 is off")
    group.add_argument("--top-p", type=float, metavar="X", default=1.0, help="1 is off")
    group.add_argument("--min-p", type=float, metavar="X", default=0.0, help="0 is off")
    group.add_argument("--n", type=int, metavar="N", default=1, help="completions per prompt")
    group.add_argument(
        "--max-tokens", type=int, metavar="N", default=64, help="most generated tokens"
    )
    group.add_argument("--ignore-eos", action="store_true", help="generate past EOS")
    group.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)"
    )
    group.add_argument(
        "--sample-seed", type=int, metavar="N", default=None, help="per-request sampling seed"
    )
    group.add_argument("--min-tokens", type=int, metavar="N", default=0, help="hold EOS back")
    group.add_argument("--presence-penalty", type=float, metavar="X", default=0.0)
    group.add_argument("--frequency-penalty", type=float, metavar="X", default=0.0)
    group.add_argument(
        "--repetition-penalty", type=float, metavar="X", default=1.0, help="1 is off"
    )
    group.add_argument(
        "--logprobs", type=int, metavar="N", default=None, help="top logprobs per token"
    )


_ENGINE_COMMANDS = ("generate", "demo", "bench", "serve")


def _build_parser(engine_commands: Collection[str] = _ENGINE_COMMANDS) -> argparse.ArgumentParser:
    """The command line; only ``engine_commands`` get the engine's flags (building them
    loads torch, which ``pagedinfer --help`` and ``--version`` need not)."""
    from pagedinfer import __version__

    parser = _Parser(prog="pagedinfer", description=_DESCRIPTION, formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"pagedinfer {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        sub: argparse.ArgumentParser = commands.add_parser(
            name, help=help_text, description=help_text, formatter_class=_HelpFormatter
        )
        return sub

    generate = command("generate", "generate for one or more prompts")
    _model_arguments(generate)
    generate.add_argument(
        "--prompt", action="append", default=[], metavar="TEXT", help="text prompt (repeatable)"
    )
    generate.add_argument(
        "--token-ids",
        action="append",
        default=[],
        type=_token_ids,
        metavar="IDS",
        help="comma-separated token ids, e.g. 1,2,3 (repeatable)",
    )
    if "generate" in engine_commands:
        _engine_arguments(generate)
    _sampling_arguments(generate, temperature=0.0)

    demo = command("demo", "generate with a small local checkpoint (random weights by default)")
    demo.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="checkpoint directory (default: build a random-weight one in --checkpoint-dir)",
    )
    demo.add_argument(
        "--checkpoint-dir",
        default=".demo-model",
        metavar="DIR",
        help="where the random demo checkpoint is built",
    )
    if "demo" in engine_commands:
        _engine_arguments(demo)
    _sampling_arguments(demo, temperature=0.8)

    bench = command("bench", "quick engine-only throughput run")
    bench.add_argument(
        "--model", default=None, metavar="DIR", help="checkpoint dir (default: random weights)"
    )
    bench.add_argument("--random-weights", default="small", help="preset when --model is absent")
    bench.add_argument("--checkpoint-dir", default=".bench-cache/model", metavar="DIR")
    bench.add_argument(
        "--num-requests", type=int, metavar="N", default=64, help="requests in the run"
    )
    bench.add_argument(
        "--input-len",
        type=int,
        nargs=2,
        default=(16, 256),
        metavar=("MIN", "MAX"),
        help="prompt lengths, drawn uniformly",
    )
    bench.add_argument(
        "--output-len",
        type=int,
        nargs=2,
        default=(16, 128),
        metavar=("MIN", "MAX"),
        help="output lengths, drawn uniformly",
    )
    if "bench" in engine_commands:
        _engine_arguments(bench)

    serve = command(
        "serve",
        "OpenAI-compatible HTTP server (needs the serve extra: pip install '.[serve]' in the "
        "pagedinfer checkout): "
        "/v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, "
        "/version and /metrics (see docs/serving.md)",
    )
    _serve_arguments(serve)
    if "serve" in engine_commands:
        _engine_arguments(serve)
        from pagedinfer.engine.vllm_flags import add_vllm_flags

        add_vllm_flags(serve)  # vllm serve's flags that change nothing here

    check_weights = command(
        "check-weights",
        "read every tensor of a checkpoint and list those holding NaN or infinite values "
        "(exit status 1 if any; loading checks only scales, norms and biases by default)",
    )
    check_weights.add_argument("checkpoint", metavar="DIR", help="checkpoint directory")
    quantize = command("quantize", "write a dense checkpoint quantized (docs/models.md)")
    quantize.add_argument("source", metavar="DIR", help="dense checkpoint (bf16, fp16, fp32)")
    quantize.add_argument("target", metavar="OUT", help="new directory for the quantized one")
    quantize.add_argument(
        "--method", required=True, choices=("fp8", "gptq", "awq", "compressed-tensors"),
        help="fp8: block-wise FP8 (128x128); gptq, awq: 4-bit round-to-nearest per group",
    )  # fmt: skip
    quantize.add_argument("--group-size", type=int, default=128, metavar="N", help="4-bit")
    quantize.add_argument("--block", type=int, default=128, metavar="N", help="fp8: NxN")
    return parser


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model of ``generate`` and ``serve``: ``MODEL_DIR`` or ``--model DIR`` (vLLM takes
    both forms); :func:`_resolve_model` leaves the one given in ``args.model``."""
    parser.add_argument(
        "model_dir",
        nargs="?",
        default=None,
        metavar="MODEL_DIR",
        help="local Hugging Face checkpoint directory (or --model DIR)",
    )
    parser.add_argument(
        "--model", default=None, metavar="DIR", help="the checkpoint directory, as a flag"
    )


def _resolve_model(args: argparse.Namespace) -> None:
    """``args.model`` is the checkpoint given as ``MODEL_DIR`` or ``--model`` (not both)."""
    from pagedinfer.errors import ConfigurationError

    if "model_dir" not in args:
        return
    positional, flag = args.model_dir, args.model
    if positional is not None and flag is not None and positional != flag:
        raise ConfigurationError(
            f"two models given, MODEL_DIR {positional!r} and --model {flag!r}: give one."
        )
    args.model = positional if positional is not None else flag
    if args.model is None:
        raise ConfigurationError(
            f"the model is missing: pagedinfer {args.command} MODEL_DIR (or --model MODEL_DIR)."
        )


def _serve_arguments(serve: argparse.ArgumentParser) -> None:
    from pagedinfer.serving.arguments import add_serve_arguments
    from pagedinfer.serving.lora import add_lora_arguments

    _model_arguments(serve)
    add_serve_arguments(serve)
    add_lora_arguments(serve)


def _checked_engine_kwargs(args: argparse.Namespace, model: str) -> dict[str, object]:
    """:func:`_engine_kwargs`, after one stderr line per setting that does not fit the CPU
    (``--tensor-parallel-size 2``, ``--dtype float16``, ...) and one naming the vLLM flags
    given that change nothing here (``ConfigurationError`` for a value refused)."""
    from pagedinfer.engine.config import EngineConfig
    from pagedinfer.engine.cpu_notes import cpu_notes, explicit_options
    from pagedinfer.engine.vllm_flags import VLLM_FLAGS, vllm_flag_notes

    kwargs = _engine_kwargs(args)
    prog = f"pagedinfer {args.command}"
    if any(f"vllm_{name}" in args for name in VLLM_FLAGS):
        values = {name: getattr(args, f"vllm_{name}") for name in VLLM_FLAGS}
        note = vllm_flag_notes(values, model)
        if note is not None:
            print(f"{prog}: note: {note}", file=sys.stderr)
    config = EngineConfig.from_options(model, kwargs)  # type: ignore[arg-type]
    for warning in cpu_notes(config, explicit_options(kwargs)):
        print(f"{prog}: warning: {warning}", file=sys.stderr)
    return kwargs


def _engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """``Engine``'s keyword arguments from the parsed flags: every engine option."""
    from pagedinfer.engine.config import ENGINE_OPTIONS

    return {name: _option_value(args, name) for name in ENGINE_OPTIONS}


def _option_value(args: argparse.Namespace, name: str) -> object:
    """One engine option's value from the parsed flags; a composite option (``CliFlag.members``)
    is built from its members' flags."""
    from dataclasses import fields, is_dataclass, replace

    from pagedinfer.engine.config import CLI_FLAG, CliFlag, EngineConfig

    option = next(option for option in fields(EngineConfig) if option.name == name)
    flag = option.metadata[CLI_FLAG]
    assert isinstance(flag, CliFlag)
    if flag.members is None:
        return getattr(args, name)
    values = {member: getattr(args, f"{flag.member_prefix}_{member}") for member in flag.members}
    default = option.default
    assert is_dataclass(default) and not isinstance(default, type)
    return replace(default, **values)


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
        n=args.n,
        min_p=args.min_p,
        min_tokens=args.min_tokens,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        logprobs=args.logprobs,
    )


def _run_generate(args: argparse.Namespace) -> int:
    from pagedinfer import Engine
    from pagedinfer.errors import InvalidRequestError

    prompts: list[str | list[int]] = list(args.prompt)
    prompts.extend(args.token_ids)
    if not prompts:
        raise InvalidRequestError("give at least one --prompt TEXT or --token-ids IDS")
    params = _sampling_params(args)  # checked before the model loads
    with Engine(args.model, **_checked_engine_kwargs(args, args.model)) as engine:  # type: ignore[arg-type]
        print(f"pagedinfer generate: {engine.describe()}", file=sys.stderr)
        outputs = engine.generate(prompts, params)  # type: ignore[arg-type]
    for output in outputs:
        for completion in output.outputs:
            shown = completion.text or " ".join(map(str, completion.token_ids))
            label = f"{output.request_id}" + (
                f".{completion.index}" if len(output.outputs) > 1 else ""
            )
            print(f"[{label}] ({completion.finish_reason}) {shown}")
            if completion.cumulative_logprob is not None:
                print(f"    cumulative logprob {completion.cumulative_logprob:.4f}")
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    from pagedinfer import Engine

    params = _sampling_params(args)
    model = args.model
    if model is None:
        model = _demo_checkpoint(Path(args.checkpoint_dir))
        print(
            f"Using a small Qwen3 checkpoint with RANDOM WEIGHTS at {model}: the generated text "
            "is gibberish; it shows the engine at work. Pass --model DIR (make demo MODEL=DIR) "
            "for a real checkpoint."
        )
    with Engine(model, **_checked_engine_kwargs(args, model)) as engine:  # type: ignore[arg-type]
        started = time.perf_counter()
        outputs = engine.generate(list(DEMO_PROMPTS), params)  # type: ignore[arg-type]
        seconds = time.perf_counter() - started
        stats = engine.stats()
    for prompt, output in zip(DEMO_PROMPTS, outputs, strict=True):
        print(f"\nprompt: {prompt!r}")
        for completion in output.outputs:
            print(f"output: {completion.text!r} ({completion.finish_reason})")
    generated = sum(len(c.token_ids) for output in outputs for c in output.outputs)
    print(
        f"\n{len(outputs)} requests, {generated} generated tokens in {seconds:.2f} s "
        f"({generated / seconds:.1f} tok/s end to end; prefill {stats.prefill_throughput:.0f} "
        f"tok/s, decode {stats.decode_throughput:.0f} tok/s) on {engine.device}, "
        f"{engine.attention_backend} attention"
    )
    if stats.spec_decode_num_drafts:
        print(
            f"speculative decoding: {stats.spec_decode_acceptance_rate:.0%} of "
            f"{stats.spec_decode_num_draft_tokens} drafts accepted, "
            f"{stats.spec_decode_mean_acceptance_length:.2f} tokens per verify row"
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
    with Engine(model, **_checked_engine_kwargs(args, model)) as engine:  # type: ignore[arg-type]
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
    generated = sum(len(c.token_ids) for output in outputs for c in output.outputs)
    print(f"{generated} tokens in {seconds:.2f} s: {generated / seconds:.1f} output tok/s")
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    try:
        from pagedinfer.serving.server import run_server
    except ImportError as error:
        from pagedinfer.errors import install_hint

        print(
            f"pagedinfer serve: error: the serve extra is not installed ({error.name or error} "
            f"is missing): {install_hint('serve')}",
            file=sys.stderr,
        )
        return EXIT_USER_ERROR
    from pagedinfer.errors import ConfigurationError, EngineDeadError
    from pagedinfer.serving.lora import runtime_lora_updating
    from pagedinfer.serving.options import API_KEY_ENV, ServingOptions, load_chat_template

    api_key = args.api_key
    if api_key is None and API_KEY_ENV in os.environ:
        api_key = os.environ[API_KEY_ENV]
        if not api_key:
            raise ConfigurationError(
                f"{API_KEY_ENV} is set but empty: unset it to serve without a key, or set a key."
            )
    options = ServingOptions(  # checked before the port is bound and the model loads
        api_key=api_key,
        metrics_public=args.metrics_public,
        allowed_hosts=None if args.allowed_hosts is None else tuple(args.allowed_hosts),
        max_request_bytes=int(args.max_request_bytes),
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
        chat_template=None
        if args.chat_template is None
        else load_chat_template(args.chat_template),
        trust_request_chat_template=args.trust_request_chat_template,
        ignore_unknown_fields=args.ignore_unknown_fields,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        reasoning_parser=args.reasoning_parser,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_sleep_mode=args.enable_sleep_mode,
        lora_modules=tuple(args.lora_modules),
        allow_runtime_lora_updating=runtime_lora_updating(
            args.allow_runtime_lora_updating, dict(os.environ)
        ),
    )
    try:
        run_server(
            args.model,
            host=args.host,
            port=args.port,
            served_model_name=args.served_model_name,
            log_level=args.log_level,
            engine_kwargs=_checked_engine_kwargs(args, args.model),
            options=options,
        )
    except EngineDeadError as error:
        print(f"pagedinfer serve: error: {error}", file=sys.stderr)
        return EXIT_ENGINE_DEAD
    return 0


def _run_check_weights(args: argparse.Namespace) -> int:
    from pagedinfer.adapters.models.checkpoint_scan import scan_checkpoint

    report = scan_checkpoint(args.checkpoint)
    for finding in report.findings:
        print(finding.describe())
    verdict = f"{len(report.findings)} not finite" if report.findings else "all finite"
    print(f"{report.tensors} floating-point tensors in {report.files} files: {verdict}")
    return 0 if report.clean else EXIT_FAILURE


def _command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of ``pagedinfer COMMAND`` (its errors say ``see pagedinfer COMMAND --help``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub: argparse.ArgumentParser = action.choices[command]
            return sub
    return parser


def _run_quantize(args: argparse.Namespace) -> int:
    from pagedinfer.engine.quantize import quantize_checkpoint

    written = quantize_checkpoint(
        args.source, args.target, args.method, group_size=args.group_size, block=args.block
    )
    print(f"wrote {args.target}: {written}")
    return 0


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "generate": _run_generate,
    "demo": _run_demo,
    "bench": _run_bench,
    "serve": _run_serve,
    "check-weights": _run_check_weights,
    "quantize": _run_quantize,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; return the exit status (0, or one of the ``EXIT_*`` codes)."""
    from pagedinfer.errors import PagedInferError

    argv = list(sys.argv[1:] if argv is None else argv)
    prog = "pagedinfer"
    try:
        # The command is the first word that is no option: only its flags are built.
        command = next((word for word in argv if not word.startswith("-")), None)
        parser = _build_parser(engine_commands=(command,) if command else ())
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # the command's own error, pointing at its --help
            _command_parser(parser, args.command).error(
                f"unrecognized arguments: {' '.join(unknown)}"
            )
        prog = f"{parser.prog} {args.command}"
        _resolve_model(args)
        return _COMMANDS[args.command](args)
    except PagedInferError as error:
        # Ours, raised on purpose, with a message that says what to change: no traceback.
        if isinstance(error, (ValueError, FileNotFoundError)):  # bad input: one line
            print(f"{prog}: error: {' '.join(str(error).split())}", file=sys.stderr)
            return EXIT_USER_ERROR
        print(f"{prog}: error: {error}", file=sys.stderr)  # may carry a worker's traceback
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
