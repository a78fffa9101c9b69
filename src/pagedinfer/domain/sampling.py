"""Sampling parameters of one request: a frozen, validated value object with vLLM's names.

Every field is checked when the object is built, so a bad value fails at the caller's line
with a message naming the field and the allowed range, never later inside a step. Sequences
are stored as tuples and ``logit_bias`` as a read-only mapping, so the value is hashable and
one object can be shared by every request of a batch.

**Floats the device uses.** The sampler works in float32, so every float a request hands it
must stay finite there, and so must what the sampler computes from it: logits plus
``logit_bias``, times or divided by ``repetition_penalty``, divided by ``temperature`` (at
least ``GREEDY_TEMPERATURE_EPSILON``). With ``|logit_bias| <= LOGIT_BIAS_MAX`` (1e10) and
``repetition_penalty`` in ``REPETITION_PENALTY_RANGE`` ([1e-6, 1e6]) the largest magnitude
reachable is about ``(|logit| + 1e10) * 1e6 / 1e-5 = 1e21`` for logits up to 1e10, far below
float32's 3.4e38; ``temperature`` may be any float32-finite value (a huge one flattens the
distribution; it cannot overflow). Values outside these ranges are rejected instead of
turning into inf or NaN on the device, where a NaN row samples token 0 whatever
``allowed_token_ids`` or ``min_tokens`` say. Every value vLLM users pass in practice is inside.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

from pagedinfer.domain.structured import StructuredOutputsParams
from pagedinfer.errors import InvalidSamplingParamsError

__all__ = [
    "FLOAT32_MAX",
    "GREEDY_TEMPERATURE_EPSILON",
    "LOGIT_BIAS_MAX",
    "MAX_SEED",
    "PENALTY_RANGE",
    "REPETITION_PENALTY_RANGE",
    "LogitBias",
    "SamplingParams",
]

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS). Dividing float32 logits by a
# smaller temperature overflows to inf and the softmax to NaN; greedy is what such a
# temperature means anyway.
GREEDY_TEMPERATURE_EPSILON = 1e-5
# Seeds are non-negative 63-bit integers: they fit a signed int64 on every backend.
MAX_SEED = 2**63 - 1
# presence_penalty and frequency_penalty, as vLLM and OpenAI allow them.
PENALTY_RANGE = (-2.0, 2.0)
# The largest finite float32 (torch.finfo(torch.float32).max): a larger float becomes inf.
FLOAT32_MAX = 3.4028234663852886e38
# logit_bias values and repetition_penalty: bounds under which the sampler's float32
# arithmetic cannot overflow (module docstring). OpenAI's API allows biases in [-100, 100].
LOGIT_BIAS_MAX = 1e10
REPETITION_PENALTY_RANGE = (1e-6, 1e6)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class LogitBias(Mapping[int, float]):
    """``token id -> bias``, read-only and hashable (``SamplingParams.logit_bias``)."""

    __slots__ = ("_hash", "_items")

    def __init__(self, items: Mapping[int, float]) -> None:
        self._items = dict(items)
        self._hash = hash(frozenset(self._items.items()))

    def __getitem__(self, token_id: int) -> float:
        return self._items[token_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self._items == dict(other)
        return NotImplemented

    def __repr__(self) -> str:
        return repr(self._items)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick the next tokens of one request, and when to stop (vLLM's fields).

    Decoding: ``temperature`` below ``GREEDY_TEMPERATURE_EPSILON`` (1e-5, 0 included) is
    greedy (argmax); otherwise logits are divided by it, then filtered by ``min_p``, ``top_k``
    (0 or -1: off; -1 is stored as 0) and ``top_p`` (1: off), and a token is drawn. Before
    that, ``allowed_token_ids`` restricts the vocabulary, ``logit_bias`` adds to logits,
    ``min_tokens`` holds back EOS and ``stop_token_ids`` until that many tokens exist, and the
    penalties apply: ``repetition_penalty`` (1: off) to tokens of the prompt and of the
    completion, ``presence_penalty`` / ``frequency_penalty`` (0: off) to completion tokens.
    Greedy rows see all of these except temperature and the filters.

    Stopping: ``max_tokens`` generated tokens (16 by default, as in vLLM; ``None``: until
    ``max_model_len``), EOS unless ``ignore_eos``, a sampled ``stop_token_ids`` entry (kept in
    ``token_ids``) or a ``stop`` string matched on the detokenized completion (cut from
    ``text`` unless ``include_stop_str_in_output``).

    Outputs: ``n`` completions per prompt; ``logprobs`` / ``prompt_logprobs`` ask for that
    many top log-probabilities per generated / prompt token (plus the chosen token's), of the
    model's distribution before any of the processing above; ``skip_special_tokens`` drops
    special tokens from ``text``. ``seed`` (0 ... 2**63-1) makes a request's samples
    reproducible whatever else is in the batch; completion ``i`` of ``n`` uses ``seed + i``.

    Structured outputs: ``structured_outputs`` (a
    :class:`~pagedinfer.domain.structured.StructuredOutputsParams`) constrains every
    completion to a JSON schema, regex, choice or grammar: tokens that cannot continue a valid
    output are masked before anything else, and EOS only where the output is complete, so a
    completion that ends with ``finish_reason="stop"`` on EOS matches. ``guided_decoding``
    (vLLM's older name) is accepted and stored as ``structured_outputs``. It cannot be
    combined with ``ignore_eos``, ``min_tokens`` or ``allowed_token_ids`` (each could leave
    no token allowed). Logprobs of such a request are of the model's distribution with the
    grammar's mask applied (vLLM's), before the other processing.

    Who applies what, when the :class:`~pagedinfer.domain.scheduler.Scheduler` is driven by
    an executor of your own (:mod:`pagedinfer.domain.executor`; ``Engine`` does all of it):

    ==============================  ===========================================================
    the scheduler enforces          ``max_tokens``, ``ignore_eos`` (with
                                    ``SchedulerConfig.eos_token_ids``), ``stop_token_ids``
                                    (it finishes the sequence), ``min_tokens`` for finishing
                                    (no EOS or stop-token finish before it); ``n``: runs the
                                    forks the caller adds; ``prompt_logprobs``: no prefix-cache
                                    hit, rows in ``plan.prompt_logprob_rows``
    the executor applies            ``temperature``, ``top_k``, ``top_p``, ``min_p``,
                                    the penalties (prompt tokens in ``NewRequest``),
                                    ``logit_bias``, ``allowed_token_ids``, the ``min_tokens``
                                    *mask* (EOS and stop ids must not be sampled before it, or
                                    the sequence just goes on), ``seed`` (sample index:
                                    ``positions[j] + 1 - num_prompt_tokens``), one sample per
                                    fork, ``logprobs`` and ``prompt_logprobs`` (computed),
                                    ``structured_outputs`` (mask; its state follows recorded
                                    plans only)
    the caller applies              ``n > 1``: the forks, ``make_forks`` (ids, ``seed + i``);
                                    ``stop`` strings (detokenize, match, then
                                    ``scheduler.finish(id, FinishReason.STOP)``),
                                    ``include_stop_str_in_output``, ``skip_special_tokens``
    ==============================  ===========================================================
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int | None = 16  # vLLM's (and OpenAI's completions) default
    ignore_eos: bool = False
    # Typed as the inputs they accept; stored as tuples (and logit_bias as a LogitBias).
    # None, vLLM's default for both, is accepted too and stored as ().
    stop_token_ids: Sequence[int] = ()
    stop: Sequence[str] = ()
    seed: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: Mapping[int, float] | None = None
    allowed_token_ids: Sequence[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's older name of structured_outputs: moved there (and stored as None).
    guided_decoding: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if self.guided_decoding is not None:
            if self.structured_outputs is not None and (
                self.structured_outputs != self.guided_decoding
            ):
                _fail(
                    "guided_decoding",
                    self.guided_decoding,
                    "None when structured_outputs is set (guided_decoding is vLLM's older name "
                    "of structured_outputs: set only structured_outputs)",
                )
            object.__setattr__(self, "structured_outputs", self.guided_decoding)
            object.__setattr__(self, "guided_decoding", None)
        # Lists and dicts are the natural thing to pass; store immutable forms so the value
        # stays hashable.
        stop_token_ids: object = self.stop_token_ids
        if stop_token_ids is None:  # vLLM's default
            stop_token_ids = ()
        object.__setattr__(self, "stop_token_ids", _as_tuple(stop_token_ids, "stop_token_ids"))
        stop: object = self.stop
        if stop is None:  # vLLM's default
            stop = ()
        stop = (stop,) if isinstance(stop, str) else _as_tuple(stop, "stop")
        object.__setattr__(self, "stop", stop)
        if self.allowed_token_ids is not None:
            allowed = _as_tuple(self.allowed_token_ids, "allowed_token_ids")
            object.__setattr__(self, "allowed_token_ids", allowed)
        if self.logit_bias is not None and not isinstance(self.logit_bias, LogitBias):
            if not isinstance(self.logit_bias, Mapping):
                _fail("logit_bias", self.logit_bias, "None or a dict {token_id: bias}")
            object.__setattr__(self, "logit_bias", LogitBias(self.logit_bias))
        self._validate()
        if self.top_k == -1:  # vLLM's spelling of "off"
            object.__setattr__(self, "top_k", 0)

    # ------------------------------------------------------------------ derived
    @property
    def is_greedy(self) -> bool:
        """True when the temperature is below ``GREEDY_TEMPERATURE_EPSILON``."""
        return self.temperature < GREEDY_TEMPERATURE_EPSILON

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def uses_logits_processing(self) -> bool:
        """True when logits processing beyond temperature, top-k and top-p applies."""
        return (
            self.uses_penalties
            or self.min_p > 0.0
            or self.min_tokens > 0
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
        )

    # --------------------------------------------------------------- validation
    def _validate(self) -> None:
        # Comparisons, not math.isfinite: an int too large for a float must fail here too.
        if not _is_real(self.temperature) or not (0 <= self.temperature <= FLOAT32_MAX):
            _fail(
                "temperature",
                self.temperature,
                f"a number in [0, {FLOAT32_MAX:.7g}] (finite in float32; below "
                f"{GREEDY_TEMPERATURE_EPSILON} means greedy)",
            )
        if not _is_int(self.top_k) or self.top_k < -1:
            _fail("top_k", self.top_k, "an integer >= 1, or 0 or -1 to switch top-k off")
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            _fail("top_p", self.top_p, "a number in (0, 1] (1 switches top-p off)")
        if not _is_real(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            _fail("min_p", self.min_p, "a number in [0, 1] (0 switches min-p off)")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            _fail("max_tokens", self.max_tokens, "an integer >= 1, or None for max_model_len")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            _fail("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail(
                "min_tokens",
                self.min_tokens,
                f"an integer in [0, max_tokens={self.max_tokens}]",
            )
        if not _is_int(self.n) or self.n < 1:
            _fail("n", self.n, "an integer >= 1")
        low, high = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not (low <= value <= high):
                _fail(name, value, f"a number in [{low}, {high}] (0 switches it off)")
        low, high = REPETITION_PENALTY_RANGE
        if not _is_real(self.repetition_penalty) or not (low <= self.repetition_penalty <= high):
            _fail(
                "repetition_penalty",
                self.repetition_penalty,
                f"a number in [{low:g}, {high:g}] (1 switches it off; > 1 discourages "
                "repetition; outside the range the sampler's float32 arithmetic overflows)",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                _fail(name, value, "None or an integer >= 0 (how many top tokens to return)")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "True or False")
        for token_id in self.stop_token_ids:
            if not _is_int(token_id) or token_id < 0:
                _fail("stop_token_ids", self.stop_token_ids, "a sequence of integers >= 0")
        for text in self.stop:
            if not isinstance(text, str) or not text:
                _fail("stop", self.stop, "a string or a sequence of non-empty strings")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            _fail("seed", self.seed, f"None or an integer in [0, {MAX_SEED}] (2**63 - 1)")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                _fail("allowed_token_ids", (), "None or a non-empty sequence of token ids >= 0")
            for token_id in self.allowed_token_ids:
                if not _is_int(token_id) or token_id < 0:
                    _fail(
                        "allowed_token_ids",
                        self.allowed_token_ids,
                        "None or a non-empty sequence of token ids >= 0",
                    )
        if self.logit_bias is not None:
            for token_id, bias in self.logit_bias.items():
                if not _is_int(token_id) or token_id < 0:
                    _fail("logit_bias", _shown(self.logit_bias), "token ids (keys) >= 0")
                if not _is_real(bias) or not (-LOGIT_BIAS_MAX <= bias <= LOGIT_BIAS_MAX):
                    _fail(
                        "logit_bias",
                        _shown(self.logit_bias),
                        f"biases in [-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}] (token {token_id} "
                        f"has {bias!r}; larger biases overflow the sampler's float32 logits)",
                    )

        self._validate_structured_outputs()

    def _validate_structured_outputs(self) -> None:
        constraint = self.structured_outputs
        if constraint is None:
            return
        if not isinstance(constraint, StructuredOutputsParams):
            _fail(
                "structured_outputs",
                constraint,
                "None or a StructuredOutputsParams(json=..., regex=..., choice=[...], "
                "grammar=..., json_object=True)",
            )
        conflicts = {
            "ignore_eos": (self.ignore_eos, "the output ends where the grammar ends"),
            "min_tokens": (
                self.min_tokens > 0,
                "EOS held back where the grammar allows only EOS would leave no token",
            ),
            "allowed_token_ids": (
                self.allowed_token_ids is not None,
                "the grammar decides which tokens are allowed",
            ),
        }
        for name, (conflict, why) in conflicts.items():
            if conflict:
                _fail(
                    name,
                    getattr(self, name),
                    f"its default with structured_outputs ({why}): drop {name} or "
                    "structured_outputs",
                )

    def max_token_id(self) -> int | None:
        """The largest token id any field names (the engine checks it against the vocabulary)."""
        ids = [*self.stop_token_ids, *(self.allowed_token_ids or ()), *(self.logit_bias or ())]
        return max(ids, default=None)


def _as_tuple(value: object, field: str) -> tuple[object, ...]:
    if isinstance(value, tuple):
        return value
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        _fail(field, value, "a sequence")
    return tuple(value)


def _shown(value: Mapping[int, float]) -> object:
    """A mapping for an error message: whole if small, else its size (messages stay short)."""
    return dict(value) if len(value) <= 8 else f"<{len(value)} entries>"


def _fail(field: str, value: object, allowed: str) -> NoReturn:
    shown = repr(value)
    if len(shown) > 200:  # a long list: the message names it without repeating it
        shown = f"{shown[:160]}... ({len(shown)} characters)"
    raise InvalidSamplingParamsError(
        f"SamplingParams.{field}={shown} is invalid: expected {allowed}."
    )
