"""Reasoning parsers (``--reasoning-parser``): an answer split into reasoning and content,
whole and streamed. Pure Python: no server, no model.

Streamed in pieces of any size (every character boundary, and random chunkings), the
deltas add up to the whole answer's split.
"""

from __future__ import annotations

import itertools
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tests.property.profiles import sized

from pagedinfer.errors import ConfigurationError
from pagedinfer.serving.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    Reasoned,
    ReasoningParser,
    get_reasoning_parser,
)

QWEN3 = Qwen3ReasoningParser()
R1 = DeepSeekR1ReasoningParser()
PARSERS: list[ReasoningParser] = [QWEN3, R1]

# (text, reasoning, content, ended), for a thinking answer.
WHOLE: list[tuple[str, str | None, str, bool]] = [
    ("<think>\nLet me see.\n</think>\n\nParis.", "\nLet me see.\n", "\n\nParis.", True),
    ("Let me see.</think>Paris.", "Let me see.", "Paris.", True),  # <think> in the prompt
    ("  <think>a</think>b", "a", "b", True),
    ("</think>Paris.", "", "Paris.", True),
    ("<think>a</think>", "a", "", True),
    ("<think>cut short by max_tokens", "cut short by max_tokens", "", False),
    ("no markers at all", "no markers at all", "", False),
    ("a</think>b</think>c", "a", "b</think>c", True),  # the first end marker ends it
    ("x<think>y</think>z", "x<think>y", "z", True),  # <think> opens reasoning at the start only
    ("<think>a</thin", "a</thin", "", False),
]


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.name)
@pytest.mark.parametrize(("text", "reasoning", "content", "ended"), WHOLE)
def test_a_whole_answer_splits_at_the_first_end_marker(
    parser: ReasoningParser, text: str, reasoning: str | None, content: str, ended: bool
) -> None:
    assert parser.split(text) == Reasoned(reasoning, content, ended)


QWEN35_CALL = "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # Qwen3.5: a tool call opened inside the thought ends it (vLLM's rule).
        (f"I need the time.\n{QWEN35_CALL}", Reasoned("I need the time.\n", QWEN35_CALL, True)),
        # A <tool_call> not followed by <function is reasoning text (Hermes JSON, a mention).
        ('<tool_call>{"name": "f"}</tool_call> hmm', None),
        ("mention <tool_call> then <functions>", None),
        # After </think>, calls are the content's business.
        (f"a</think>b{QWEN35_CALL}", Reasoned("a", f"b{QWEN35_CALL}", True)),
    ],
)
def test_qwen3_ends_the_reasoning_at_a_tool_call_it_opens(
    text: str, expected: Reasoned | None
) -> None:
    assert QWEN3.split(text) == (expected or Reasoned(text, "", False))
    # DeepSeek-R1 has no such rule.
    if expected is not None and "</think>" not in text:
        assert R1.split(text) == Reasoned(text, "", False)
    # Streamed one character at a time, the deltas add up.
    whole = QWEN3.split(text)
    assert _streamed(QWEN3, list(text)) == (whole.reasoning or "", whole.content)


def test_an_answer_that_does_not_think_is_all_content() -> None:
    text = "<think>a</think>b"
    assert QWEN3.split(text, thinking=False) == Reasoned(None, text, True)


@pytest.mark.parametrize(
    ("prompt", "kwargs", "thinking"),
    [
        ("<|im_start|>assistant\n", None, True),
        ("<|im_start|>assistant\n<think>\n", None, True),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", None, False),  # closed by the template
        ("<|im_start|>assistant\n", {"enable_thinking": False}, False),
        ("<|im_start|>assistant\n", {"enable_thinking": True}, True),
        # A previous turn's reasoning in the history does not close this one.
        ("<think>old</think>answer<|im_end|>\n<|im_start|>assistant\n", None, True),
        (None, None, True),  # unknown prompt (truncated)
    ],
)
def test_qwen3_thinks_unless_the_prompt_or_enable_thinking_says_not(
    prompt: str | None, kwargs: dict[str, bool] | None, thinking: bool
) -> None:
    assert QWEN3.thinking(prompt, kwargs) is thinking


@pytest.mark.parametrize(
    ("prompt", "thinking"),
    [
        ("<|im_start|>assistant\n<think>\nSo far I", True),
        ("<|im_start|>assistant\n<think>\nhmm\n</think>\n\nThe answer is", False),
        ("<|im_start|>assistant\nThe answer is", False),  # a prefilled answer, no thinking
    ],
)
def test_a_continued_message_thinks_if_its_last_marker_opens_a_thought(
    prompt: str, thinking: bool
) -> None:
    assert QWEN3.thinking(prompt, None, continued=True) is thinking


def test_deepseek_v3_thinks_only_when_the_thinking_variable_says_so() -> None:
    v3 = get_reasoning_parser("deepseek_v3")
    assert v3.thinking("assistant\n", None) is False
    assert v3.thinking("assistant\n", {"enable_thinking": True}) is False
    assert v3.thinking("assistant\n<think>", {"thinking": True}) is True
    assert v3.thinking("assistant\n</think>", {"thinking": True}) is False


def test_deepseek_r1_ignores_enable_thinking_but_reads_the_prompt() -> None:
    assert R1.thinking("assistant\n", {"enable_thinking": False}) is True
    assert R1.thinking("assistant\n<think>\n\n</think>\n\n", None) is False


def test_a_reasoning_cut_short_drops_the_eos_text_it_ends_with() -> None:
    assert QWEN3.split("<think>hmm<|im_end|>", end_texts=("<|im_end|>",)) == Reasoned(
        "hmm", "", False
    )
    # After the reasoning, the end text is the tool-call parser's business.
    assert QWEN3.split("a</think>b<|im_end|>", end_texts=("<|im_end|>",)).content == "b<|im_end|>"


def test_the_registry_names_vllms_parsers_and_lists_them_for_an_unknown_name() -> None:
    assert set(REASONING_PARSERS) >= {"qwen3", "deepseek_r1"}
    assert isinstance(get_reasoning_parser("qwen3"), Qwen3ReasoningParser)
    assert isinstance(get_reasoning_parser("deepseek_r1"), DeepSeekR1ReasoningParser)
    with pytest.raises(
        ConfigurationError, match=r"'nope' is unknown.*deepseek_r1, deepseek_v3, qwen3"
    ):
        get_reasoning_parser("nope")


def _streamed(
    parser: ReasoningParser,
    pieces: list[str],
    *,
    thinking: bool = True,
    end_texts: tuple[str, ...] = (),
) -> tuple[str, str]:
    stream = parser.stream(thinking=thinking, end_texts=end_texts)
    reasoning = content = ""
    text = ""
    for number, piece in enumerate(pieces):
        text += piece
        delta = stream.advance(text, final=number == len(pieces) - 1)
        reasoning += delta.reasoning
        content += delta.content
        assert stream.content == content
    return reasoning, content


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.name)
@pytest.mark.parametrize("text", [text for text, *_ in WHOLE])
def test_streamed_one_character_at_a_time_the_deltas_add_up(
    parser: ReasoningParser, text: str
) -> None:
    whole = parser.split(text)
    assert _streamed(parser, [*text] or [""]) == (whole.reasoning or "", whole.content)


@pytest.mark.parametrize("text", [text for text, *_ in WHOLE])
def test_split_at_every_boundary_the_deltas_add_up(text: str) -> None:
    whole = QWEN3.split(text)
    for cut in range(len(text) + 1):
        pieces = [text[:cut], text[cut:]]
        assert _streamed(QWEN3, pieces) == (whole.reasoning or "", whole.content)


FRAGMENTS = st.sampled_from(
    [
        "<think>",
        "</think>",
        "<th",
        "</th",
        "ink>",
        "<",
        "/",
        ">",
        " ",
        "\n",
        "a",
        "é",
        "<|im_end|>",
        "<tool_call>",
        "<tool",
        "<function=",
        "<function",
        "=",
    ]
)


@st.composite
def chunked(draw: st.DrawFn) -> tuple[str, list[str]]:
    text = "".join(draw(st.lists(FRAGMENTS, max_size=12)))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in itertools.pairwise(bounds)]


SIZES = {
    "ci": {"max_examples": 300},
    "quick": {"max_examples": 50},
    "thorough": {"max_examples": 5000},
}


@sized(SIZES)
@given(chunked(), st.booleans(), st.sampled_from(PARSERS))
def test_any_chunking_adds_up_to_the_whole_split(
    case: tuple[str, list[str]], thinking: bool, parser: ReasoningParser
) -> None:
    text, pieces = case
    end_texts = ("<|im_end|>",)
    whole = parser.split(text, thinking=thinking, end_texts=end_texts)
    reasoning, content = _streamed(parser, pieces, thinking=thinking, end_texts=end_texts)
    assert (reasoning, content) == (whole.reasoning or "", whole.content)
    # Each partial split is a prefix of the whole one (nothing sent is taken back).
    for cut in range(len(text) + 1):
        partial = parser.split(text[:cut], thinking=thinking, final=False, end_texts=end_texts)
        assert (whole.reasoning or "").startswith(partial.reasoning or "")
        assert whole.content.startswith(partial.content)


def test_a_stream_does_not_read_the_whole_reasoning_again_at_every_step() -> None:
    """Thousands of "<tool_call>" mentions in a thought, streamed a few characters at a
    time: each step looks only at what is new (reading them all at every step took 30 s)."""
    text = "<think>\n" + "<tool_call> x " * 2500 + "</think>a"
    stream = QWEN3.stream()
    began = time.perf_counter()
    for size in range(4, len(text) + 4, 4):
        stream.advance(text[:size], size >= len(text))
    assert time.perf_counter() - began < 10
    assert stream.content == "a"
