"""Beam search's parameters and its ranking of beams (vLLM's ``BeamSearchParams`` and
``get_beam_search_score``), pure Python.

:class:`BeamSearchParams` is a frozen, validated value: a bad field fails where the object is
built, naming the field and what is allowed. :func:`beam_score` is the key beams are ranked
by: the cumulative log-probability divided by ``length ** length_penalty``, where ``length``
counts the prompt's tokens and the generated ones without a final EOS (vLLM's rule, taken
from transformers). Beams of one step all have the same length, so within a step the score
orders them as their cumulative log-probabilities do; ``length_penalty`` matters when
finished beams of different lengths are ranked at the end (above 1 favours longer ones,
below 1 shorter ones).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NoReturn

from pagedinfer.domain.sampling import FLOAT32_MAX
from pagedinfer.errors import InvalidSamplingParamsError

__all__ = ["BeamSearchParams", "beam_score"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """How ``LLM.beam_search`` searches (vLLM's fields and defaults).

    ``beam_width`` beams are kept per prompt and at most ``beam_width`` sequences returned;
    each step extends every live beam by one token, for at most ``max_tokens`` steps. A beam
    that generates EOS is finished (``ignore_eos=True``: EOS is a token like any other).
    ``temperature`` is the one-token requests' (vLLM's; the candidates are the top
    ``2 * beam_width`` tokens of the model's log-probabilities, which temperature does not
    change, so 0 is the usual value). ``length_penalty`` ranks finished beams
    (:func:`beam_score`). ``include_stop_str_in_output`` keeps a finishing EOS's text in
    ``text`` (its id is in ``tokens`` either way).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.beam_width) or self.beam_width < 1:
            _fail("beam_width", self.beam_width, "an integer >= 1 (the beams kept per prompt)")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            _fail("max_tokens", self.max_tokens, "an integer >= 1 (the most tokens generated)")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                _fail(name, value, "True or False")
        # Comparisons, not math.isfinite: an int too large for a float must fail here too.
        if not _is_real(self.temperature) or not (0 <= self.temperature <= FLOAT32_MAX):
            _fail("temperature", self.temperature, f"a number in [0, {FLOAT32_MAX:.7g}]")
        if not _is_real(self.length_penalty) or not (
            -FLOAT32_MAX <= self.length_penalty <= FLOAT32_MAX
        ):
            _fail("length_penalty", self.length_penalty, "a finite number (1.0: no penalty)")

    @property
    def num_candidates(self) -> int:
        """Candidates asked for per live beam and step (the top ``2 * beam_width`` tokens, as
        transformers and vLLM do, so that ``beam_width`` survive beams that end in EOS)."""
        return 2 * self.beam_width


def beam_score(cum_logprob: float, length: int, length_penalty: float) -> float:
    """vLLM's ``get_beam_search_score``: ``cum_logprob / length ** length_penalty``, where
    ``length`` counts the prompt and the generated tokens but not a final EOS.

    Never raises: a penalty so large (or so negative) that the power leaves the float range
    gives the limit of the quotient (``-0.0`` or ``-inf`` for a negative ``cum_logprob``)."""
    try:
        denominator = math.pow(length, length_penalty)
    except OverflowError:
        denominator = math.inf
    if denominator == 0.0:
        return 0.0 if cum_logprob == 0.0 else math.copysign(math.inf, cum_logprob)
    return cum_logprob / denominator


def _fail(field: str, value: object, allowed: str) -> NoReturn:
    raise InvalidSamplingParamsError(
        f"BeamSearchParams.{field}={value!r} is invalid: expected {allowed}."
    )
