"""A tool's ``$ref``s mean what they mean in its own ``parameters`` (issue 36, item 6).

With ``tool_choice="required"`` the server embeds each tool's parameters in its schema of an
array of calls; ``"$ref": "#"`` used to resolve against that array (a recursive tool got
arguments like ``{"x": [{"name": "tree", "parameters": {"x": true}}]}``). Checked three
ways: the rewritten schema itself; the compiled grammar, which must accept exactly the
arguments the tool's own schema accepts (deterministic, token by token); and answers from
the app (random weights, recursive tools) under ``required``, a named function and ``auto``
with each tool-call parser, whose arguments must validate against the tool's own schema.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagedinfer.serving.fields import RequestFieldError
from pagedinfer.serving.tools import plan_tools
from pagedinfer.serving.tools.parsers import TOOL_CALL_PARSERS
from pagedinfer.serving.tools.schemas import (
    MAX_TOOL_SCHEMA_DEPTH,
    ToolSchemaError,
    check_tool_depth,
    embed_tool_parameters,
)

jsonschema = pytest.importorskip("jsonschema")

# The issue's tool: x is a boolean or another such object.
TREE: dict[str, Any] = {
    "type": "object",
    "properties": {"x": {"anyOf": [{"type": "boolean"}, {"$ref": "#"}]}},
    "required": ["x"],
    "additionalProperties": False,
}
# A linked list: every node must say where it goes next (null, or a node).
CHAIN: dict[str, Any] = {
    "type": "object",
    "properties": {
        "head": {"type": "integer", "minimum": 0, "maximum": 9},
        "tail": {"anyOf": [{"type": "null"}, {"$ref": "#"}]},
    },
    "required": ["head", "tail"],
    "additionalProperties": False,
}
# Pointers into its own $defs and properties; another tool defines $defs/Small differently.
POINTERS: dict[str, Any] = {
    "type": "object",
    "properties": {"a": {"$ref": "#/$defs/Small"}, "b": {"$ref": "#/properties/a"}},
    "required": ["a", "b"],
    "additionalProperties": False,
    "$defs": {"Small": {"type": "integer", "minimum": 0, "maximum": 3}},
}
OTHER_SMALL: dict[str, Any] = {
    "type": "object",
    "properties": {"s": {"$ref": "#/$defs/Small"}},
    "required": ["s"],
    "additionalProperties": False,
    "$defs": {"Small": {"type": "string", "enum": ["p", "q"]}},
}
SCHEMAS = {"tree": TREE, "chain": CHAIN, "pointers": POINTERS, "other": OTHER_SMALL}


def _tools(*names: str) -> list[dict[str, Any]]:
    return [
        {"type": "function", "function": {"name": name, "parameters": copy.deepcopy(SCHEMAS[name])}}
        for name in names
    ]


def _plan(tools: list[dict[str, Any]], choice: Any, parser: str = "hermes") -> Any:
    return plan_tools(tools, choice, None, parser=parser, auto_tool_choice=True)


# ------------------------------------------------------------------ the rewritten schema
def test_refs_are_rewritten_to_the_tools_own_definition() -> None:
    tools = _tools("tree", "pointers", "other")
    schema = json.loads(_plan(tools, "required").constraint.json)
    variants = schema["items"]["anyOf"]
    assert [v["properties"]["parameters"] for v in variants] == [
        {"$ref": "#/$defs/tree"},
        {"$ref": "#/$defs/pointers"},
        {"$ref": "#/$defs/other"},
    ]
    defs = schema["$defs"]
    assert defs["tree"]["properties"]["x"]["anyOf"][1] == {"$ref": "#/$defs/tree"}
    assert defs["pointers"]["properties"] == {
        "a": {"$ref": "#/$defs/pointers/$defs/Small"},
        "b": {"$ref": "#/$defs/pointers/properties/a"},
    }
    # Same-named $defs of two tools no longer share one namespace.
    assert defs["other"]["properties"]["s"] == {"$ref": "#/$defs/other/$defs/Small"}
    assert tools[0]["function"]["parameters"] == TREE  # the request is not changed


def test_a_tool_without_refs_stays_inline() -> None:
    plain = {"type": "object", "properties": {"q": {"type": "string"}}, "$id": "urn:x"}
    embedded = embed_tool_parameters(plain, "tools[0].function.parameters", "f")
    assert embedded.definition is None and embedded.schema == plain


def test_only_schema_positions_are_rewritten() -> None:
    """A "$ref" member of enum, const, default or examples is data, and "$ref" may be a
    property's name."""
    parameters = {
        "type": "object",
        "properties": {
            "$ref": {"type": "string"},  # a property named "$ref"
            "k": {"enum": [{"$ref": "#"}], "default": {"$ref": "#"}, "examples": [{"$ref": "#"}]},
            "c": {"const": {"$ref": "http://example.com/x"}},
            "n": {"items": [{"$ref": "#/properties/k"}], "not": {"$ref": "#"}},
            "d": {"dependencies": {"a": ["b"], "c": {"$ref": "#"}}},
        },
        "patternProperties": {"^p/~": {"$ref": "#/properties/c"}},
    }
    definition = embed_tool_parameters(parameters, "f", "t").definition
    assert definition is not None
    props = definition["properties"]
    assert props["$ref"] == {"type": "string"}
    assert props["k"] == parameters["properties"]["k"]  # type: ignore[index]
    assert props["c"] == parameters["properties"]["c"]  # type: ignore[index]
    assert props["n"] == {
        "items": [{"$ref": "#/$defs/t/properties/k"}],
        "not": {"$ref": "#/$defs/t"},
    }
    assert props["d"]["dependencies"] == {"a": ["b"], "c": {"$ref": "#/$defs/t"}}
    assert definition["patternProperties"]["^p/~"] == {"$ref": "#/$defs/t/properties/c"}


def test_pointers_with_escapes_resolve() -> None:
    parameters = {
        "type": "object",
        "properties": {"a/b": {"type": "integer"}, "m~n": {"type": "string"}},
        "allOf": [{"$ref": "#/properties/a~1b"}, {"$ref": "#/properties/m~0n"}],
        "anyOf": [{"$ref": "#/properties/a%7E1b"}, {"$ref": "#/allOf/0"}],
    }
    definition = embed_tool_parameters(parameters, "f", "t").definition
    assert definition is not None
    assert definition["allOf"] == [
        {"$ref": "#/$defs/t/properties/a~1b"},
        {"$ref": "#/$defs/t/properties/m~0n"},
    ]


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"$ref": "http://example.com/schema.json"}, "another document"),
        ({"$ref": "file:///etc/passwd"}, "another document"),
        ({"properties": {"a": {"$ref": "other.json#/x"}}}, "another document"),
        ({"properties": {"a": {"$ref": "#/$defs/Nope"}}}, "points to nothing"),
        ({"properties": {"a": {"$ref": "#/properties/a/items/3"}}}, "points to nothing"),
        ({"properties": {"a": {"$ref": "#node"}}}, "anchor"),
        ({"properties": {"a": {"$ref": 3}}}, "must be a string"),
        ({"$defs": {"n": {"$anchor": "node"}}}, "$anchor"),
        ({"anyOf": [{"$dynamicRef": "#node"}]}, "$dynamicRef"),
        ({"$dynamicAnchor": "node"}, "$dynamicAnchor"),
        ({"items": {"$recursiveRef": "#"}}, "$recursiveRef"),
        ({"properties": {"a": {"$id": "https://example.com/a", "type": "string"}}}, "$id"),
    ],
)
def test_refs_that_cannot_be_rewritten_safely_are_400s(
    parameters: dict[str, Any], message: str
) -> None:
    tools = [
        {"type": "function", "function": {"name": "ok", "parameters": TREE}},
        {"type": "function", "function": {"name": "bad", "parameters": parameters}},
    ]
    for choice in ("required", {"type": "function", "function": {"name": "bad"}}):
        with pytest.raises(RequestFieldError, match=re.escape(message)) as error:
            _plan(tools, choice)
        assert error.value.param == "tools[1].function.parameters"
    assert _plan(tools, "auto").tools == tools  # auto compiles nothing: the template gets them
    assert _plan(tools, "none").tools == tools


def test_the_message_says_where_the_ref_is() -> None:
    parameters = {"properties": {"a": {"anyOf": [{"$ref": "https://x/y"}]}}}
    with pytest.raises(ToolSchemaError) as error:
        embed_tool_parameters(parameters, "tools[0].function.parameters", "t")
    assert "tools[0].function.parameters at /properties/a/anyOf/0" in str(error.value)


def _nested(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels - 1):  # built without recursion
        schema = {"type": "array", "items": schema}
    return schema


def test_depth_is_limited_without_recursion() -> None:
    check_tool_depth(_nested(MAX_TOOL_SCHEMA_DEPTH), "p")
    with pytest.raises(ToolSchemaError, match=f"more than {MAX_TOOL_SCHEMA_DEPTH}"):
        check_tool_depth(_nested(MAX_TOOL_SCHEMA_DEPTH + 1), "p")
    with pytest.raises(ToolSchemaError):
        check_tool_depth(_nested(50_000), "p")  # far past Python's recursion limit
    deep = [{"type": "function", "function": {"name": "f", "parameters": _nested(5_000)}}]
    for choice in ("none", "auto", "required"):
        with pytest.raises(RequestFieldError, match="levels") as error:
            _plan(deep, choice)
        assert error.value.param == "tools[0].function.parameters"


# ------------------------------------------------------------------ the compiled grammar
@pytest.fixture(scope="module")
def compiler(make_checkpoint: Callable[..., Path]) -> Any:
    pytest.importorskip("llguidance")
    from pagedinfer.adapters.sampling.grammar import GrammarCompiler
    from pagedinfer.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(make_checkpoint("tiny", with_tokenizer=True)))
    return GrammarCompiler(tokenizer, 512, [tokenizer.eos_token_id])


def _accepts(compiler: Any, constraint: Any, text: str) -> bool:
    matcher = compiler.compile(constraint).new_matcher()
    for token in compiler.tokenizer.encode(text, add_special_tokens=False):
        if not matcher.consume_token(token):
            return False
    return bool(matcher.is_accepting())


def _calls(*calls: tuple[str, Any]) -> str:
    return json.dumps([{"name": name, "parameters": args} for name, args in calls])


# (tool, arguments) pairs: what each tool's own schema says of them.
ARGUMENTS: list[tuple[str, Any]] = [
    ("tree", {"x": True}),
    ("tree", {"x": {"x": {"x": False}}}),
    ("tree", {"x": [{"name": "tree", "parameters": {"x": True}}]}),  # the issue's answer
    ("tree", {"x": {"x": 1}}),
    ("tree", {"x": {}}),
    ("chain", {"head": 1, "tail": None}),
    ("chain", {"head": 1, "tail": {"head": 2, "tail": {"head": 3, "tail": None}}}),
    ("chain", {"head": 1, "tail": [{"name": "chain", "parameters": {"head": 1, "tail": None}}]}),
    ("chain", {"head": 1, "tail": {"head": 2}}),
    ("pointers", {"a": 3, "b": 0}),
    ("pointers", {"a": 4, "b": 0}),
    ("pointers", {"a": 1, "b": "p"}),
    ("other", {"s": "q"}),
    ("other", {"s": 1}),
]


@pytest.mark.parametrize(("name", "arguments"), ARGUMENTS)
def test_the_grammar_accepts_what_the_tools_own_schema_accepts(
    compiler: Any, name: str, arguments: Any
) -> None:
    valid = jsonschema.Draft202012Validator(SCHEMAS[name]).is_valid(arguments)
    alone = _plan(_tools(name), "required").constraint  # the issue's case for "tree"
    assert _accepts(compiler, alone, _calls((name, arguments))) is valid
    required = _plan(_tools("tree", "chain", "pointers", "other"), "required").constraint
    assert _accepts(compiler, required, _calls((name, arguments))) is valid
    assert _accepts(compiler, required, _calls(("tree", {"x": True}), (name, arguments))) is valid
    named = _plan(_tools(name), {"type": "function", "function": {"name": name}}).constraint
    assert _accepts(compiler, named, json.dumps(arguments)) is valid


# ------------------------------------------------------------------ through the app
@pytest.fixture(scope="module")
def app_client(make_checkpoint: Callable[..., Path]) -> Iterator[Callable[..., Any]]:
    """``post(path, body, parser=...)`` against an in-process app per tool-call parser."""
    pytest.importorskip("fastapi")
    pytest.importorskip("llguidance")
    from pagedinfer import AsyncEngine
    from pagedinfer.serving import ServingOptions, build_app

    checkpoint = make_checkpoint("tiny", with_tokenizer=True)
    engine = AsyncEngine(checkpoint, device="cpu", num_kv_blocks=256, max_model_len=1024)
    apps = {
        parser: build_app(
            engine,
            served_model_name="m",
            options=ServingOptions(tool_call_parser=parser, enable_auto_tool_choice=True),
        )
        for parser in TOOL_CALL_PARSERS
    }

    def post(body: dict[str, Any], parser: str = "hermes") -> httpx.Response:
        async def send() -> httpx.Response:
            transport = httpx.ASGITransport(app=apps[parser])
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
                return await c.post("/v1/chat/completions", json=body, timeout=300)

        return asyncio.run(send())

    try:
        yield post
    finally:
        engine.close()


ASK = [{"role": "user", "content": "Build a tree."}]


def _valid_calls(choice: dict[str, Any]) -> list[tuple[str, Any]]:
    """The calls of a choice, each checked against its tool's own schema."""
    calls = []
    for call in choice["message"]["tool_calls"] or []:
        name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, SCHEMAS[name])
        calls.append((name, arguments))
    return calls


def test_required_with_recursive_tools_through_the_app(app_client: Callable[..., Any]) -> None:
    body = {
        "messages": ASK,
        "tools": _tools("tree", "chain", "pointers", "other"),
        "tool_choice": "required",
        "n": 6,
        "seed": 5,
        "temperature": 1.0,
        "max_tokens": 400,
    }
    response = app_client(body)
    assert response.status_code == 200, response.text
    finished = [c for c in response.json()["choices"] if c["finish_reason"] == "tool_calls"]
    assert finished  # the random model closes most arrays within 400 tokens
    nested = 0
    for choice in finished:
        for name, arguments in _valid_calls(choice):
            nested += name in ("tree", "chain") and isinstance(
                arguments.get("x", arguments.get("tail")), dict
            )
    assert nested  # the $ref branch was taken, and validated


def test_a_named_recursive_tool_through_the_app(app_client: Callable[..., Any]) -> None:
    body = {
        "messages": ASK,
        "tools": _tools("tree", "chain"),
        "tool_choice": {"type": "function", "function": {"name": "chain"}},
        "n": 4,
        "seed": 3,
        "temperature": 1.0,
        "max_tokens": 300,
    }
    response = app_client(body)
    assert response.status_code == 200, response.text
    stopped = [c for c in response.json()["choices"] if c["finish_reason"] == "stop"]
    assert stopped
    for choice in stopped:
        assert [name for name, _ in _valid_calls(choice)] == ["chain"]


# Each parser's way of writing one call of the tree tool, forced with a regex (the model is
# random); the arguments go two levels down the $ref.
_ARGS = r'\{"x": \{"x": (true|false)\}\}'
FORCED = {
    "hermes": r'<tool_call>\n\{"name": "tree", "arguments": ' + _ARGS + r"\}\n</tool_call>",
    "llama3_json": r'\{"name": "tree", "parameters": ' + _ARGS + r"\}",
    "llama4_json": r'\{"name": "tree", "parameters": ' + _ARGS + r"\}",
    "mistral": r'\[TOOL_CALLS\]\[\{"name": "tree", "arguments": ' + _ARGS + r"\}\]",
    "qwen3_coder": r"<tool_call>\n<function=tree>\n<parameter=x>\n\{\"x\": (true|false)\}\n"
    r"</parameter>\n</function>\n</tool_call>",
}


@pytest.mark.parametrize("parser", sorted(TOOL_CALL_PARSERS))
def test_auto_with_a_recursive_tool_with_each_parser(
    app_client: Callable[..., Any], parser: str
) -> None:
    body = {
        "messages": ASK,
        "tools": _tools("tree", "pointers"),
        "tool_choice": "auto",
        "max_tokens": 120,
        "temperature": 0.0,
        "structured_outputs": {"regex": FORCED[parser]},
    }
    response = app_client(body, parser=parser)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert choice["finish_reason"] == "tool_calls", choice
    ((name, arguments),) = _valid_calls(choice)
    assert name == "tree" and isinstance(arguments["x"], dict)
