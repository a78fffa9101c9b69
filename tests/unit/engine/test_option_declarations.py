"""The engine's options are declared once (``EngineConfig``'s fields, engine/config.py): the
command line's flags, help texts and defaults, ``Engine``'s keywords and the documented
signature all follow from the declaration."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import re
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from pagedinfer import Engine, GrammarLimits
from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.cli import _build_parser, _engine_kwargs
from pagedinfer.engine.config import (
    CLI_FLAG,
    ENGINE_OPTIONS,
    GRAMMAR_LIMITS_GROUP,
    CliFlag,
    EngineConfig,
    EngineOptions,
    parse_num_threads,
    parse_speculative_config,
)
from pagedinfer.engine.generation_config import parse_override_generation_config
from pagedinfer.engine.pooling_setup import parse_pooler_config

COMMANDS = ("generate", "demo", "bench", "serve")
REPO = Path(__file__).resolve().parents[3]

# One sample per parser: the text given on the command line and the value it must become.
# A new parser needs a line here (the test below fails until it has one).
SAMPLES: dict[object, tuple[str, object]] = {
    int: ("7", 7),
    float: ("0.5", 0.5),
    str: ("some-text", "some-text"),
    parse_num_threads: ("3", 3),
    parse_speculative_config: (
        '{"method": "ngram", "num_speculative_tokens": 2}',
        {"method": "ngram", "num_speculative_tokens": 2},
    ),
    parse_override_generation_config: ('{"temperature": 0.6}', {"temperature": 0.6}),
    parse_pooler_config: ('{"pooling_type": "MEAN"}', {"pooling_type": "MEAN"}),
}


def _flags() -> dict[str, CliFlag]:
    return {
        option.name: option.metadata[CLI_FLAG]
        for option in fields(EngineConfig)
        if CLI_FLAG in option.metadata
    }


def _defaults() -> dict[str, object]:
    return {option.name: option.default for option in fields(EngineConfig)}


def _parse(command: str, *flags: str) -> dict[str, object]:
    words = ["m", "--prompt", "x"] if command == "generate" else ["m"] * (command == "serve")
    return _engine_kwargs(_build_parser().parse_args([command, *words, *flags]))


def _engine_actions(command: str) -> dict[str, list[str]]:
    """The flags of ``command`` that set an engine option, by option (hidden ones included)."""
    parser = _build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    sub = commands.choices[command]
    found: dict[str, list[str]] = {}
    members = {
        f"{flag.member_prefix}_{member}": name
        for name, flag in _flags().items()
        if flag.members is not None
        for member in flag.members
    }
    for action in sub._actions:
        if action.dest in ENGINE_OPTIONS:
            found.setdefault(action.dest, []).extend(action.option_strings)
        elif action.dest in members:  # a composite option's member flag
            found.setdefault(members[action.dest], []).extend(action.option_strings)
    return found


def _member_flags(flag: CliFlag) -> list[str]:
    assert flag.members is not None
    return [f"--{flag.member_prefix}-{member.replace('_', '-')}" for member in flag.members]


def test_every_field_but_the_model_is_an_option_with_a_flag() -> None:
    names = [option.name for option in fields(EngineConfig)]
    assert names[0] == "model_path"
    assert list(ENGINE_OPTIONS) == names[1:] == list(_flags())
    for name, flag in _flags().items():
        assert isinstance(flag, CliFlag) and flag.help.strip(), name
        assert flag.group in ("engine", "request limits", GRAMMAR_LIMITS_GROUP), name
        assert (flag.members is None) == (flag.group != GRAMMAR_LIMITS_GROUP), name


def test_engines_keywords_are_the_options() -> None:
    """``EngineOptions`` (the keywords' types) names exactly the options, and ``Engine``'s
    signature (help(), inspect) lists each, keyword-only, with its declared default."""
    assert set(EngineOptions.__annotations__) == set(ENGINE_OPTIONS)
    parameters = inspect.signature(Engine).parameters
    assert list(parameters) == ["model", *ENGINE_OPTIONS]
    defaults = _defaults()
    for name in ENGINE_OPTIONS:
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert parameters[name].default == defaults[name], name


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_has_a_flag_and_every_engine_flag_an_option(command: str) -> None:
    actions = _engine_actions(command)
    assert set(actions) == set(ENGINE_OPTIONS)
    for name, flag in _flags().items():
        if flag.members is not None:  # one flag per member, no flag of its own
            assert sorted(actions[name]) == sorted(_member_flags(flag)), name
            continue
        dashed = f"--{name.replace('_', '-')}"
        assert dashed in actions[name], name
        assert set(flag.aliases) <= set(actions[name]), name


@pytest.mark.parametrize("command", COMMANDS)
def test_a_flags_default_is_the_options_default(command: str) -> None:
    """Written once: the flag's default is the field's (none declares a command-line default
    of its own: --num-threads auto is the library's default too)."""
    parsed = _parse(command)
    defaults = _defaults()
    own = object()
    differing = {name: flag.default(own) for name, flag in _flags().items()}
    differing = {name: default for name, default in differing.items() if default is not own}
    assert differing == {}
    assert defaults["num_threads"] == "auto"
    for name in ENGINE_OPTIONS:
        assert parsed[name] == differing.get(name, defaults[name]), name


def test_help_shows_every_flag_with_its_help_and_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        _build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal's width
    defaults = _defaults()
    for name, flag in _flags().items():
        if flag.members is not None:
            default = defaults[name]
            for spelling, (member, help_text) in zip(
                _member_flags(flag), flag.members.items(), strict=True
            ):
                shown = f"{' '.join(help_text.split())} (default {getattr(default, member)})"
                assert f"{spelling} N {shown}" in text, spelling
            continue
        assert f"--{name.replace('_', '-')}" in text, name
        assert " ".join(flag.help.split()) in text, name
        default = flag.default(defaults[name])
        if flag.switch:
            continue  # a switch says in its help whether it is on by default
        if default is None:
            assert "default" in flag.help, name  # None says what it means in words
        else:
            assert f"{' '.join(flag.help.split())} (default: {default})" in text, name


@pytest.mark.parametrize("name", ENGINE_OPTIONS)
def test_each_flag_parses_to_the_option(name: str) -> None:
    """Round trip per kind: a value option's text (and its aliases') becomes the value, a
    choice each of its choices, a switch turns the option on (and --no-x off)."""
    flag = _flags()[name]
    default = flag.default(_defaults()[name])
    names = [f"--{name.replace('_', '-')}", *flag.aliases]
    if flag.members is not None:  # each member's flag sets that member, the rest keep defaults
        for spelling, member in zip(_member_flags(flag), flag.members, strict=True):
            value = _parse("generate", spelling, "3")[name]
            assert getattr(value, member) == 3, spelling
            assert value == dataclasses.replace(default, **{member: 3}), spelling
        return
    if flag.switch:
        assert _parse("generate", names[0])[name] is True
        if default is not False:
            assert _parse("generate", f"--no-{name.replace('_', '-')}")[name] is False
        return
    for spelling in names:
        if flag.choices is not None:
            for choice in flag.choices:
                assert _parse("generate", spelling, choice)[name] == choice
            continue
        parse = flag.parse or type(default)
        assert parse in SAMPLES, f"{name}: add a sample for {parse}"
        text, value = SAMPLES[parse]
        assert _parse("generate", spelling, text)[name] == value


def test_a_parsers_message_reaches_the_command_line() -> None:
    with pytest.raises(ValueError, match="expected an integer >= 1 or 'auto', got '0'"):
        parse_num_threads("0")
    with pytest.raises(ValueError, match="JSON object"):
        parse_speculative_config("{method: ngram}")
    assert json.loads(SAMPLES[parse_speculative_config][0]) == SAMPLES[parse_speculative_config][1]


def test_the_documented_signature_has_the_declared_defaults() -> None:
    """docs/api.md shows ``Engine(model, *, ...)`` with every option and its default."""
    text = (REPO / "docs" / "api.md").read_text(encoding="utf-8")
    (block,) = re.findall(r"```python\n(Engine\(model, \*,.*?\))\n```", text, re.S)
    function = ast.parse(f"def {block}: pass").body[0]
    assert isinstance(function, ast.FunctionDef)
    documented = {
        argument.arg: GrammarLimits()
        if ast.unparse(default) == "GrammarLimits()"
        else ast.literal_eval(default)
        for argument, default in zip(
            function.args.kwonlyargs, function.args.kw_defaults, strict=True
        )
        if default is not None
    }
    defaults = _defaults()
    assert documented == {name: defaults[name] for name in ENGINE_OPTIONS}


def test_what_runs_at_once_is_computed_in_one_place() -> None:
    config = EngineConfig(model_path="m", max_num_seqs=8, max_num_batched_tokens=5)
    assert config.max_running == 5
    assert EngineConfig(model_path="m", max_num_seqs=3).max_running == 3
    runner = RunnerConfig(
        model_path="m",
        device=torch.device("cpu"),
        dtype=torch.float32,
        block_size=16,
        attention_backend="torch",
        max_num_seqs=8,
        max_num_batched_tokens=5,
    )
    assert runner.max_running == 5


def test_an_unknown_keyword_names_itself_and_the_options() -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'block_sz'.*max_num_seqs"):
        EngineConfig.from_options("m", {"block_sz": 16})  # type: ignore[typeddict-unknown-key]


def test_the_top_level_help_and_version_load_no_torch() -> None:
    """Only the command being run gets the engine's flags (building them imports torch):
    ``pagedinfer --help`` and ``--version`` stay quick, and work on the core install."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from pagedinfer.cli import main\n"
        "for argv in (['--help'], ['--version']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "generate" in result.stdout and "pagedinfer " in result.stdout
