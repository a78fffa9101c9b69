"""Sequence: a request's tokens, progress counters and block table."""

from __future__ import annotations

from pagedinfer.domain import FinishReason, SamplingParams, Sequence, SequenceStatus


def test_a_new_sequence_is_waiting_with_nothing_computed() -> None:
    seq = Sequence(7, [1, 2, 3])
    assert seq.seq_id == 7
    assert seq.status is SequenceStatus.WAITING
    assert seq.finish_reason is None
    assert not seq.is_finished
    assert seq.num_cached_tokens == 0
    assert seq.num_computed_tokens == 0
    assert seq.num_preemptions == 0
    assert seq.num_uncomputed_tokens == 3
    assert seq.block_table == []
    assert seq.block_hashes == []
    assert seq.params == SamplingParams()
    assert seq.extra_key is None


def test_prompt_and_completion_views() -> None:
    seq = Sequence(0, (10, 11, 12), SamplingParams(max_tokens=3))
    seq.token_ids.extend([20, 21])
    assert seq.num_tokens == len(seq) == 5
    assert seq.num_prompt_tokens == 3
    assert seq.prompt_token_ids == [10, 11, 12]
    assert seq.completion_token_ids == [20, 21]
    assert seq.num_completion_tokens == 2
    assert seq.last_token_id == 21
    assert seq.params.max_tokens == 3


def test_the_prompt_is_copied() -> None:
    prompt = [1, 2, 3]
    seq = Sequence(0, prompt)
    prompt.append(4)
    seq.token_ids.append(9)
    assert seq.prompt_token_ids == [1, 2, 3]
    assert prompt == [1, 2, 3, 4]


def test_views_are_copies() -> None:
    seq = Sequence(0, [1, 2])
    seq.prompt_token_ids.append(5)
    seq.completion_token_ids.append(5)
    assert seq.token_ids == [1, 2]


def test_uncomputed_tokens_follow_progress() -> None:
    seq = Sequence(0, list(range(10)))
    seq.num_computed_tokens = 8
    assert seq.num_uncomputed_tokens == 2
    seq.token_ids.append(99)
    assert seq.num_uncomputed_tokens == 3


def test_block_token_ids_slices_by_the_given_block_size() -> None:
    seq = Sequence(0, list(range(10)))
    assert seq.block_token_ids(0, 4) == [0, 1, 2, 3]
    assert seq.block_token_ids(2, 4) == [8, 9]  # the partial tail
    assert seq.block_token_ids(1, 3) == [3, 4, 5]


def test_block_size_is_not_a_class_attribute() -> None:
    # nano-vLLM wart: Sequence.block_size mutated by the engine. Ours belongs to the pool.
    assert not hasattr(Sequence, "block_size")


def test_extra_key_is_kept() -> None:
    assert Sequence(0, [1], extra_key=5).extra_key == 5


def test_is_finished_follows_status() -> None:
    seq = Sequence(0, [1])
    seq.status = SequenceStatus.FINISHED
    assert seq.is_finished


def test_finish_reason_is_a_string() -> None:
    assert str(FinishReason.STOP) == "stop"
    assert isinstance(FinishReason.LENGTH, str)
    assert FinishReason("length") is FinishReason.LENGTH
    assert f"{FinishReason.ABORT}" == "abort"


def test_repr_names_the_progress() -> None:
    text = repr(Sequence(3, [1, 2]))
    assert "id=3" in text and "waiting" in text and "tokens=2" in text
