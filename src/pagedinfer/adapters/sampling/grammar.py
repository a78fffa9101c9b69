"""Structured outputs on the sampling rank: compiled grammars, matchers by slot, the bitmask.

The grammar engine is llguidance (docs/structured-outputs.md compares it with xgrammar and
says why). Three pieces:

* :class:`GrammarCompiler` turns a :class:`~pagedinfer.domain.structured.StructuredOutputsParams`
  into a compiled grammar for one tokenizer and vocabulary, and keeps the last
  ``cache_size`` of them by :attr:`~StructuredOutputsParams.cache_key` (LRU), under the
  engine's :class:`~pagedinfer.domain.grammar_limits.GrammarLimits` (text size, schema depth,
  llguidance's lexer fuel, states and items). The engine calls :meth:`GrammarCompiler.compile`
  in the submitting thread, before it takes its lock, so a schema that does not compile, is
  too big or too complex, or accepts no string (the probe: ``grammar_probe.py``) is refused at
  submission, and a slow one never stalls the step loop. The compiled grammar travels with the
  request (``StructuredOutputsParams.compiled``), so the sampling rank never compiles in the
  step loop whatever the cache evicted meanwhile (a rank in another process, Ray's, compiles
  on a miss). Refusals are cached too (a repeated hostile constraint costs a dict lookup).
  Thread-safe: the lock guards only the caches, compiling runs outside it (two threads may
  compile one key at once; the second result is dropped).
* :class:`GrammarMatchers` keeps one matcher (the grammar's parser state) per constrained
  slot, installed and released with the sampling table's deltas (like the logits processors).
  A preempted request keeps its slot and so its matcher: the tokens it generated stay
  accepted, and its recomputation samples the next one from the same state. Each completion
  of ``n > 1`` has its own slot, hence its own matcher. A constraint with a
  ``reasoning_end`` gets its matcher behind a gate (``reasoning_gate.py``) that lets the
  reasoning pass unconstrained.
* Per step, :meth:`GrammarMatchers.fill` writes the constrained rows' allowed tokens as a
  bitmask on the host (1 bit per token, int32 words, llguidance's layout) and copies it to the
  device; :func:`apply_token_bitmask` turns it into ``-inf`` for every forbidden token of those
  rows (one masked fill for the batch). After the step's tokens reach the host,
  :meth:`GrammarMatchers.accept` advances each matcher. A step without a constrained row does
  none of this (``fill`` returns ``None`` after one dict lookup per row).

A matcher that fails at run time (a limit hit, any matcher error, or a dead end: no token
allowed) fails its own row only: ``fill`` and ``accept`` report it in
:attr:`GrammarStep.failed` (sample index -> reason) and the engine ends that request with
``finish_reason="error"``; the other rows of the step go on.

EOS is in a row's mask only where the grammar accepts the output as complete, so a completion
that ends on EOS is valid: ``"stop"`` on a constrained request means the grammar accepted it.
"""

from __future__ import annotations

import copy
import ctypes
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedinfer.adapters.sampling.grammar_probe import probe_grammar
from pagedinfer.adapters.sampling.reasoning_gate import gated
from pagedinfer.adapters.sampling.table import InstalledRequest
from pagedinfer.domain.grammar_limits import DEFAULT_GRAMMAR_LIMITS, GrammarLimits
from pagedinfer.domain.json_depth import json_depth_exceeds
from pagedinfer.domain.structured import StructuredOutputsParams
from pagedinfer.errors import (
    InvalidRequestError,
    InvalidStructuredOutputError,
    MissingDependencyError,
    install_hint,
)

__all__ = [
    "DEFAULT_GRAMMAR_CACHE_SIZE",
    "GrammarCompiler",
    "GrammarMatchers",
    "GrammarStep",
    "apply_token_bitmask",
    "grammar_text",
]

DEFAULT_GRAMMAR_CACHE_SIZE = 256
"""Compiled grammars kept (LRU) to share compiles between requests."""
_REFUSALS_KEPT = 1024  # refused constraints remembered (LRU), by cache key

_INSTALL_HINT = (
    f"structured outputs need the llguidance package: {install_hint('structured')} (or "
    "pip install llguidance)"
)


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as error:
        raise MissingDependencyError(_INSTALL_HINT) from error
    return llguidance


def grammar_text(params: StructuredOutputsParams) -> str:
    """llguidance's grammar for ``params`` (not yet checked against a tokenizer).

    Raises :class:`InvalidStructuredOutputError` where the text itself cannot be read (a
    GBNF grammar that does not convert, a structural tag llguidance refuses).
    """
    llg = _llguidance()
    matcher = llg.LLMatcher
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.schema if kind == "json" else {"type": "object"}
        assert schema is not None
        if params.disable_additional_properties:
            schema = _closed_objects(schema)
        options: dict[str, Any] = {"whitespace_flexible": not params.disable_any_whitespace}
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        try:
            return str(matcher.grammar_from_json_schema(schema, overrides=options))
        except ValueError as error:
            raise InvalidStructuredOutputError(f"the JSON schema is invalid: {error}") from None
    if kind == "regex":
        assert params.regex is not None
        return str(matcher.grammar_from_regex(params.regex))
    if kind == "choice":
        assert params.choice is not None
        # JSON string literals are Lark string literals (same escapes).
        alternatives = " | ".join(json.dumps(choice) for choice in params.choice)
        return str(matcher.grammar_from_lark(f"start: {alternatives}"))
    if kind == "grammar":
        assert params.grammar is not None
        try:  # Lark as it is; GBNF (``::=``) converted to Lark
            return str(llg.grammar_from("grammar", params.grammar))
        except ValueError as error:
            raise InvalidStructuredOutputError(
                f"the grammar is neither Lark nor GBNF that converts to Lark: {error}"
            ) from None
    assert kind == "structural_tag" and params.structural_tag is not None
    tag = json.loads(params.structural_tag)
    tags = [
        llg.StructTag(
            trigger=next(t for t in tag["triggers"] if s["begin"].startswith(t)),
            begin=s["begin"],
            grammar=s["schema"],
            end=s["end"],
        )
        for s in tag["structures"]
    ]
    return str(llg.StructTag.to_grammar(tags))


def _closed_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that sets none
    (``disable_additional_properties``). A new value; the argument is not changed. Iterative
    (an explicit stack): any depth is safe."""
    root: list[Any] = [None]
    stack: list[tuple[Any, Any, Any]] = [(schema, root, 0)]
    while stack:
        value, parent, key = stack.pop()
        if isinstance(value, list):
            copied: Any = [None] * len(value)
            stack.extend((item, copied, index) for index, item in enumerate(value))
        elif isinstance(value, dict):
            copied = dict(value)
            stack.extend((item, copied, name) for name, item in value.items())
            is_object = value.get("type") == "object" or "properties" in value
            if is_object and "additionalProperties" not in value:
                copied["additionalProperties"] = False
        else:
            copied = value
        parent[key] = copied
    return root[0]


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A validated grammar: a matcher in its start state, copied for every request."""

    template: Any  # llguidance.LLMatcher, in its start state (the probe resets it)
    text: str
    owner: object = None  # the identity of the compiler that made it

    def new_matcher(self) -> Any:
        return self.template.deep_copy()


class GrammarCompiler:
    """Compiles structured-output constraints for one tokenizer (see the module docstring).

    ``tokenizer`` is the engine's Hugging Face tokenizer (a fast tokenizer: its
    ``backend_tokenizer`` gives llguidance every token's bytes); ``vocab_size`` the width of
    the model's logits (ids the tokenizer does not know are never allowed; a tokenizer with
    more ids than the logits widens the bitmask to its own count, as llguidance needs a bit
    per token it knows, and the columns past the logits are dropped when a mask is applied,
    so those ids are never sampled); ``eos_token_ids``
    the model's EOS ids, allowed where an output is complete. Nothing is imported or built
    until the first :meth:`compile`.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        cache_size: int = DEFAULT_GRAMMAR_CACHE_SIZE,
        limits: GrammarLimits = DEFAULT_GRAMMAR_LIMITS,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = max(vocab_size, _token_count(tokenizer))  # the bitmask's width
        self.eos_token_ids = tuple(eos_token_ids)
        self.cache_size = cache_size
        self.limits = limits
        self._lock = threading.Lock()
        self._identity = object()  # marks the grammars compiled here (see pinned)
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[tuple[object, ...], CompiledGrammar] = OrderedDict()
        self._refused: OrderedDict[tuple[object, ...], str] = OrderedDict()
        self.num_compiled = 0  # compilations run (cache misses), for tests and stats
        self.num_refused = 0  # constraints refused (each distinct one once), for tests and stats

    @property
    def bitmask_words(self) -> int:
        """int32 words of one row's bitmask."""
        return (self.vocab_size + 31) // 32

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of ``params`` (from the cache, or compiled now).

        Raises :class:`InvalidStructuredOutputError` naming the problem when the schema,
        regex or grammar does not compile, passes a limit (:attr:`limits`) or accepts no
        string (the same message again, from a cache, when the same constraint comes back);
        ``InvalidRequestError`` when this engine cannot constrain outputs at all (no
        tokenizer, no EOS token); ``MissingDependencyError`` without llguidance.
        """
        pinned = self.pinned(params)
        if pinned is not None:  # carried by the request since its submission
            return pinned
        key = params.cache_key
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return found
            refused = self._refused.get(key)
        if refused is not None:
            raise InvalidStructuredOutputError(refused)
        try:
            compiled = self._compile(params)
        except InvalidStructuredOutputError as error:
            with self._lock:
                if key not in self._refused:
                    self.num_refused += 1
                self._refused[key] = str(error)
                self._refused.move_to_end(key)
                while len(self._refused) > _REFUSALS_KEPT:
                    self._refused.popitem(last=False)
            raise
        with self._lock:
            found = self._cache.get(key)
            if found is not None:  # another thread compiled it meanwhile
                self._cache.move_to_end(key)
                return found
            self._cache[key] = compiled
            self.num_compiled += 1
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def pinned(self, params: StructuredOutputsParams) -> CompiledGrammar | None:
        """The grammar ``params`` carries (``compiled``) if this compiler made it (the same
        tokenizer and limits); ``None`` otherwise (another engine's, or none)."""
        compiled = params.compiled
        if isinstance(compiled, CompiledGrammar) and compiled.owner is self._identity:
            return compiled
        return None

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        llg = _llguidance()
        tokenizer = self._tokenizer()
        self._check_size(params)
        text = grammar_text(params)
        limits = self.parser_limits()
        error = llg.LLMatcher.validate_grammar(text, tokenizer, limits=limits)
        if not error:
            template = llg.LLMatcher(tokenizer, text, log_level=0, limits=limits)
            error = template.get_error() if template.is_error() else ""
        if error:
            raise InvalidStructuredOutputError(
                f"StructuredOutputsParams.{params.kind} does not compile: {_first_lines(error)}"
            )
        reason = probe_grammar(template, tokenizer, self.eos_token_ids, self.limits.probe_tokens)
        if reason is not None:
            raise InvalidStructuredOutputError(
                f"StructuredOutputsParams.{params.kind} is refused: {reason}."
            )
        return CompiledGrammar(template, text, self._identity)

    def parser_limits(self) -> Any:
        """llguidance's ``LLParserLimits`` of :attr:`limits`."""
        return _llguidance().LLParserLimits(**self.limits.engine_limits(), verbose_errors=False)

    def _check_size(self, params: StructuredOutputsParams) -> None:
        """The text-size and schema-depth limits, before any grammar is built."""
        limits = self.limits
        size = params.text_size
        if size > limits.max_chars:
            raise InvalidStructuredOutputError(
                f"StructuredOutputsParams.{params.kind} is {size} characters long; this engine "
                f"takes at most {limits.max_chars} (GrammarLimits.max_chars, "
                "--grammar-max-chars): shorten it."
            )
        schema = params.schema
        if schema is not None and json_depth_exceeds(schema, limits.max_json_depth) is not None:
            raise InvalidStructuredOutputError(
                f"StructuredOutputsParams.json nests deeper than {limits.max_json_depth} "
                "levels (objects and arrays); this engine takes at most that "
                "(GrammarLimits.max_json_depth, --grammar-max-json-depth): flatten it (use "
                "$defs and $ref for repeated parts)."
            )

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is not None:
                return self._ll_tokenizer
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "structured outputs need the model's tokenizer (the grammar is matched on "
                    "token text), and this engine has none (skip_tokenizer_init=True, or no "
                    "tokenizer files): load one with Engine(tokenizer=DIR)."
                )
            if not self.eos_token_ids:
                raise InvalidRequestError(
                    "structured outputs need an EOS token (it ends a completed output), and "
                    "the model's config.json / generation_config.json name none."
                )
            backend = getattr(self.tokenizer, "backend_tokenizer", None)
            if backend is None:
                raise InvalidRequestError(
                    f"structured outputs need a fast (Rust) Hugging Face tokenizer; this "
                    f"engine's is a {type(self.tokenizer).__name__}. Convert it to "
                    "tokenizer.json (transformers' PreTrainedTokenizerFast)."
                )
            backend = copy.copy(backend)
            backend.no_padding()
            backend.no_truncation()
            llg = _llguidance()
            self._ll_tokenizer = llg.LLTokenizer(
                backend.to_str(), n_vocab=self.vocab_size, eos_token=list(self.eos_token_ids)
            )
            return self._ll_tokenizer


def _token_count(tokenizer: Any) -> int:
    """The ids a Hugging Face tokenizer knows, added tokens included (0 without one)."""
    try:
        return len(tokenizer) if tokenizer is not None else 0
    except TypeError:  # not a sized tokenizer: llguidance reads its count itself
        return 0


class _FailedMatcher:
    """Stands for a matcher that could not be built: allows nothing, reports its error."""

    def __init__(self, error: str) -> None:
        self.error = error

    def unsafe_compute_mask_ptr(self, pointer: int, size: int) -> None:
        ctypes.memset(pointer, 0, size)

    def is_error(self) -> bool:
        return True

    def get_error(self) -> str:
        return self.error

    def stop_reason(self) -> str:
        return "InternalError"

    def consume_token(self, token: int) -> bool:
        return False

    def rollback(self, num_tokens: int) -> bool:
        return False


def _runtime_reason(matcher: Any) -> str:
    """Why a matcher failed during generation, in one line."""
    lines = str(matcher.get_error()).strip().splitlines()
    first = lines[0] if lines else str(matcher.stop_reason())
    return (
        f"the structured-output constraint failed during generation ({_first_lines(first, 200)}); "
        "it is too complex for the engine's grammar limits or cannot continue"
    )


def _first_lines(message: str, limit: int = 600) -> str:
    text = message.strip()
    return text if len(text) <= limit else f"{text[:limit]}..."


@dataclass(frozen=True, slots=True)
class GrammarStep:
    """One step's constrained rows: ``rows`` (indices into the step's samples, on the host and
    as a device tensor, or ``None`` when every row is constrained) and their bitmask
    ``[len(rows), words]`` int32 on the device. ``failed`` maps the sample index of each row
    whose matcher failed (in ``fill`` or ``accept``) to why: those requests end with an
    error, the other rows go on."""

    row_indices: tuple[int, ...]
    matchers: tuple[Any, ...]
    rows: torch.Tensor | None
    bitmask: torch.Tensor
    failed: dict[int, str] = field(default_factory=dict)


class GrammarMatchers:
    """One grammar matcher per constrained slot, and the per-step bitmask (module docstring).

    Follows the sampling table: :meth:`install` and :meth:`release` are its callbacks.
    """

    def __init__(self, compiler: GrammarCompiler, device: torch.device) -> None:
        self.compiler = compiler
        self.device = device
        self._matchers: dict[int, Any] = {}
        self._host: torch.Tensor | None = None  # [rows, words] int32, pinned on CUDA

    def __len__(self) -> int:
        """Live constrained requests."""
        return len(self._matchers)

    def install(self, request: InstalledRequest) -> None:
        """The sampling table's install callback: a new matcher for a constrained request."""
        self._matchers.pop(request.slot, None)
        constraint = request.params.structured_outputs
        if constraint is not None:
            try:  # pinned at submission (no compile here), or a cache hit or miss (Ray)
                matcher = self.compiler.compile(constraint).new_matcher()
                matcher = gated(matcher, constraint.reasoning_end)  # after the reasoning
            except InvalidStructuredOutputError as error:  # fails its own row at fill
                matcher = _FailedMatcher(str(error))
            self._matchers[request.slot] = matcher

    def release(self, slot: int) -> None:
        """The sampling table's release callback."""
        self._matchers.pop(slot, None)

    def fill(self, sample_slots: Sequence[int]) -> GrammarStep | None:
        """The bitmask of this step's constrained rows (sample ``j`` uses ``sample_slots[j]``),
        copied to the device; ``None`` when no row is constrained."""
        if not self._matchers:
            return None
        matchers = self._matchers
        indices: list[int] = []
        row_matchers: list[Any] = []
        for index, slot in enumerate(sample_slots):
            matcher = matchers.get(slot)
            if matcher is not None:
                indices.append(index)
                row_matchers.append(matcher)
        if not indices:
            return None
        host = self._host_rows(len(indices))
        row_bytes = host.shape[1] * 4
        base = host.data_ptr()
        failed: dict[int, str] = {}
        for position, matcher in enumerate(row_matchers):
            # Writes the allowed tokens of the matcher's next step (releases the GIL).
            matcher.unsafe_compute_mask_ptr(base + position * row_bytes, row_bytes)
            if matcher.is_error():
                failed[indices[position]] = _runtime_reason(matcher)
        empty = ~host.bool().any(dim=1)
        if bool(empty.any()):  # a dead end: no token continues the output, EOS included
            for position in empty.nonzero().flatten().tolist():
                failed.setdefault(
                    indices[position],
                    "the constraint reached a dead end: no token continues the output and it "
                    "is not complete",
                )
        device = self.device
        every_row = len(indices) == len(sample_slots)
        bitmask = host.to(device, non_blocking=True) if device.type == "cuda" else host.clone()
        rows = None
        if not every_row:
            rows = torch.tensor(indices, dtype=torch.int64).to(device, non_blocking=True)
        return GrammarStep(tuple(indices), tuple(row_matchers), rows, bitmask, failed)

    def undo(self, step: GrammarStep) -> None:
        """Take back :meth:`accept` of ``step`` (its tokens were never recorded: the step
        runs again). Matchers released since are left alone."""
        live = {id(matcher) for matcher in self._matchers.values()}
        for matcher in step.matchers:
            if id(matcher) in live:
                matcher.rollback(1)

    def accept(self, step: GrammarStep, sampled: Sequence[int]) -> None:
        """Advance each constrained row's matcher by its sampled token; a matcher that
        fails (a limit hit while consuming it) fails its row only (``step.failed``)."""
        failed = step.failed
        for index, matcher in zip(step.row_indices, step.matchers, strict=True):
            token = sampled[index]
            if index in failed or token < 0:
                continue
            if not matcher.consume_token(token):
                failed[index] = _runtime_reason(matcher)

    def _host_rows(self, num_rows: int) -> torch.Tensor:
        """``num_rows`` rows of the host bitmask buffer (grown by doubling)."""
        host = self._host
        if host is None or host.shape[0] < num_rows:
            capacity = max(num_rows, 2 * host.shape[0] if host is not None else 8)
            pin = self.device.type == "cuda"
            host = torch.empty(
                (capacity, self.compiler.bitmask_words), dtype=torch.int32, pin_memory=pin
            )
            self._host = host
        return host[:num_rows]


def apply_token_bitmask(logits: torch.Tensor, step: GrammarStep) -> None:
    """Set every token a constrained row's bitmask forbids to ``-inf``, in place.

    ``logits [n, vocab]``; the rows of ``step`` (all rows when ``step.rows`` is None). Bit
    ``t % 32`` of word ``t // 32`` is token ``t``; ids past the bitmask's words are forbidden.
    One masked fill over the constrained rows (plus a gather and a scatter when only some rows
    are constrained).
    """
    vocab = logits.shape[-1]
    bitmask = step.bitmask
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:  # a wider model than the mask: the rest is forbidden
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    if step.rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
        return
    rows = logits.index_select(0, step.rows)
    rows.masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, step.rows, rows)
