"""The n-gram proposer, the acceptance rule and vLLM's speculative_config dict."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedinfer.domain.speculative import SpeculativeConfig, accepted_length, propose_ngram
from pagedinfer.errors import ConfigurationError


def test_ngram_takes_the_latest_longest_match() -> None:
    history = [1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3]
    # "2 3" occurs twice before; "1 2 3"... the suffix is "2 3" ("5 2 3" never occurred):
    # the latest earlier "2 3" is followed by 7, 5.
    assert propose_ngram(history, 2, 1, 3) == [7, 5]
    assert propose_ngram(history, 2, 3, 3) == []  # no earlier "5 2 3"
    assert propose_ngram([4, 5, 6], 3, 1, 2) == []
    assert propose_ngram([4], 3, 1, 2) == []
    assert propose_ngram([1, 2, 3, 1, 2], 0, 1, 2) == []


def test_ngram_continues_loops_past_the_end() -> None:
    assert propose_ngram([7, 8, 7, 8, 7], 5, 1, 2) == [8, 7, 8, 7, 8]
    assert propose_ngram([3, 3, 3], 4, 1, 3) == [3, 3, 3, 3]


def _reference_ngram(history: list[int], k: int, low: int, high: int) -> list[int]:
    """The rule in plain Python: the largest n, the latest earlier occurrence, then copy."""
    length = len(history)
    for n in range(min(high, length - 1), low - 1, -1):
        for end in range(length - 1, n - 1, -1):
            if history[end - n : end] == history[length - n :]:
                extended = list(history)
                while len(extended) < end + k:
                    extended.append(extended[len(extended) - (length - end)])
                return extended[end : end + k]
    return []


@given(
    st.lists(st.integers(-3, 4) | st.integers(0, 2**40), min_size=0, max_size=40),
    st.integers(1, 6),
    st.integers(1, 3),
    st.integers(0, 3),
)
def test_ngram_equals_the_plain_rule(history: list[int], k: int, low: int, extra: int) -> None:
    # Large and negative ids too: the byte search must only match whole tokens.
    assert propose_ngram(history, k, low, low + extra) == _reference_ngram(
        history, k, low, low + extra
    )


@given(st.lists(st.integers(0, 4), min_size=1, max_size=30), st.integers(1, 6))
def test_ngram_drafts_continue_a_real_occurrence(history: list[int], k: int) -> None:
    drafts = propose_ngram(history, k, 1, 3)
    assert len(drafts) in (0, k)
    if drafts:
        # Some n-gram of length >= 1 ending at the end occurred earlier, followed by the
        # first draft.
        extended = history + drafts
        assert any(
            extended[end - n : end] == history[-n:] and extended[end] == drafts[0]
            for n in range(1, 4)
            for end in range(n, len(history))
        )


def test_accepted_length() -> None:
    assert accepted_length([5, 6, 7], [5, 6]) == 2
    assert accepted_length([5, 0, 7], [5, 6]) == 1
    assert accepted_length([0, 6, 7], [5, 6]) == 0
    assert accepted_length([4], []) == 0


def test_config_from_vllm_dicts() -> None:
    config = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 3})
    assert (config.method, config.num_speculative_tokens) == ("ngram", 3)
    draft = SpeculativeConfig.from_value({"model": "/m", "num_speculative_tokens": 2})
    assert draft.method == "draft_model" and draft.model == "/m"
    for bad, match in [
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 3,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "/m"}, "takes no"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "unknown"),
        ({"num_speculative_tokens": 2}, "needs 'method'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "eagle": 1}, "not supported"),
        ("ngram", "expected a dict"),
    ]:
        with pytest.raises(ConfigurationError, match=match):
            SpeculativeConfig.from_value(bad)  # type: ignore[arg-type]


def test_ngram_edges_found_by_mutation_testing() -> None:
    # The shortest history with an earlier occurrence.
    assert propose_ngram([3, 3], 2, 1, 1) == [3, 3]
    # Every n from the longest down: n = 2 matches ("5 6" -> 1) where n = 1 would not agree
    # (the latest "6" is followed by 2) and n = 3 does not occur.
    assert propose_ngram([5, 6, 1, 7, 6, 2, 9, 5, 6], 1, 1, 3) == [1]
    assert propose_ngram([5, 6, 1, 7, 6, 2, 9, 5, 6], 1, 1, 1) == [2]
    # A byte match that straddles two tokens is no occurrence: 2**56 then 0 hold the bytes of
    # the token 1 at a misaligned offset.
    assert propose_ngram([2**56, 0, 9, 1], 2, 1, 1) == []
    assert propose_ngram([1, 5, 2**56, 0, 9, 1], 2, 1, 1) == [5, 2**56]


def test_config_defaults_bounds_and_propose() -> None:
    config = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 4})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (1, 4)
    same = SpeculativeConfig("ngram", 2, prompt_lookup_max=2, prompt_lookup_min=2)
    assert same.prompt_lookup_min == same.prompt_lookup_max == 2
    SpeculativeConfig("ngram", 16)  # the largest k
    SpeculativeConfig("ngram", 1)  # and the smallest
    with pytest.raises(ConfigurationError, match="num_speculative_tokens"):
        SpeculativeConfig("ngram", 17)
    # propose: at most k and at most max_drafts, with the config's n-gram lengths.
    loop = [7, 8, 7, 8, 7]
    assert SpeculativeConfig("ngram", 3).propose(loop, 5) == [8, 7, 8]
    assert SpeculativeConfig("ngram", 3).propose(loop, 2) == [8, 7]
    assert (
        SpeculativeConfig("ngram", 3, prompt_lookup_min=3, prompt_lookup_max=3).propose(
            [1, 2, 3, 9, 2, 3], 3
        )
        == []
    )
