"""Grammar-constrained generation: grammar specs, their compilation, and per-sequence matcher state.

The grammar engine is llguidance (chosen by measurement, see `benchmarks/grammar_libraries.py`):
it compiles a JSON schema in about a millisecond and fills a token mask in tens of microseconds,
with no dependency of its own. Its lexer is lazy: the work a hostile grammar costs (a counted
repetition like `a{1000000}` takes seconds) happens at its first mask. So compiling means building
the matcher, filling its first mask and taking one token on a copy, all on the compiler's own
threads while validation waits (llguidance drops the GIL throughout), within a `GrammarBudget`: a
grammar over budget is a `ValidationError` at validation, never a stalled engine step or a failure
mid-generation. The engine thread only copies a compiled matcher per sequence (its first mask
comes with it), fills mask rows and advances matchers, each step bounded by llguidance's fuel.

A mask is a bitmask `[R, ceil(V / 32)]` int32 (bit j of word w allows token 32 * w + j), one row
per constrained sequence; the sampler turns it into -inf logits (`ops.apply_token_bitmask`).
Once a step's tokens are accepted, `prefetch_masks` fills the next step's masks on a background
thread while the model computes the next logits; `fill_bitmasks` then only collects them.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import llguidance.torch
import numpy as np
import torch
from torch import Tensor

from inference_service.errors import GenerationError, OverloadedError, ValidationError, quoted

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of llguidance's stub only

KINDS = ("json", "regex", "lark")
# One whitespace style: flexible whitespace lets a weak model loop on blanks until max_new_tokens.
# The separators are the usual `json.dumps` ones, the spacing models most often write.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
DEFAULT_CACHE_SIZE = 256
MAX_ERROR_CHARS = 300  # the grammar engine's messages echo the grammar: only their start is told


@dataclass(frozen=True)
class GrammarBudget:
    """What compiling one grammar may cost (its first mask and first token included).

    `compile_timeout_s` is wall-clock time once its compilation starts; `max_lexer_states` caps the
    lexer's DFA (1-2 kB a state; llguidance's own cap is 250,000). At most `max_concurrent`
    grammars compile at once; one that can't start within `compile_timeout_s` is `OverloadedError`.
    """

    compile_timeout_s: float = 2.0
    max_lexer_states: int = 50_000
    max_concurrent: int = 2

    def __post_init__(self) -> None:
        if not (self.compile_timeout_s > 0 and self.max_lexer_states > 0 and self.max_concurrent > 0):
            raise ValueError("a grammar budget's timeout, state cap and concurrency must be positive")

    def limits(self) -> llguidance.LLParserLimits:
        # No parser dumps in errors: they are long and echo the grammar.
        return llguidance.LLParserLimits(max_lexer_states=self.max_lexer_states, verbose_errors=False)


class GrammarTooComplex(ValidationError):
    """A grammar over its `GrammarBudget`: the caller's error, told at validation (kept in the cache,
    so the same grammar sent again is refused at once)."""

    def __init__(self, reason: str):
        super().__init__(f"grammar is too complex: {reason}")


def _short(message: str | None, echoed: str = "") -> str:
    """A grammar engine message on one line, without the parser dump, `echoed` (the grammar, which
    messages quote) shortened, and cut to `MAX_ERROR_CHARS`."""
    text = (message or "").split("<state>")[0].replace("<non-verbose/>", "")
    if len(echoed) > 40:
        text = text.replace(echoed, echoed[:40] + "…")
    text = " ".join(text.split()) or "unknown error"
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 1] + "…"


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match. `kind`: "json" (`value` is a JSON schema as JSON text), "regex"
    (the whole output full-matches `value`) or "lark" (llguidance's Lark syntax, `%json{...}` allowed)."""

    kind: str
    value: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValidationError(
                f"grammar is not valid: unknown grammar kind {quoted(self.kind)}; expected one of {', '.join(KINDS)}"
            )
        if not isinstance(self.value, str):
            raise ValidationError(f"grammar is not valid: a {self.kind} grammar's value must be a string")


def grammar_spec_from_tgi(grammar: dict) -> GrammarSpec:
    """TGI's `parameters.grammar`: `{"type": "json" | "json_object", "value": schema or its JSON text}`,
    `{"type": "json_schema", "value": {"name"?: str, "schema": {...}}}` or `{"type": "regex", "value": str}`.

    Unlike TGI, any schema is accepted (no top-level `properties` needed): `{"type": "object"}` is JSON mode.
    """
    if not isinstance(grammar, dict):
        raise ValidationError("grammar is not valid: expected an object with `type` and `value`")
    kind, value = grammar.get("type"), grammar.get("value")
    if kind in ("json", "json_object"):
        return GrammarSpec("json", _schema_text(value))
    if kind == "json_schema":
        if not isinstance(value, dict) or "schema" not in value:
            raise ValidationError(
                'grammar is not valid: a json_schema grammar\'s value must be {"name"?: string, "schema": {...}}'
            )
        if not isinstance(value.get("name", ""), str):
            raise ValidationError("grammar is not valid: a json_schema grammar's `name` must be a string")
        return GrammarSpec("json", _schema_text(value["schema"]))
    if kind == "regex":
        if not isinstance(value, str):
            raise ValidationError("grammar is not valid: a regex grammar's value must be a string")
        return GrammarSpec("regex", value)
    raise ValidationError(
        f"grammar is not valid: unknown grammar type {quoted(kind)}; expected json, json_object, json_schema or regex"
    )


def lark_json(schema: Any) -> str:
    """A Lark rule body matching `schema`'s JSON, in the same whitespace style as the "json" kind."""
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}
    return f"%json {json.dumps(schema)}"


def _schema_text(value: Any) -> str:
    """A schema object, or a string holding one, as compact JSON text. Keys keep their order: the
    output's properties come in the schema's order."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise ValidationError(f"grammar is not valid: the schema is not JSON: {error}") from None  # no echo
    if not isinstance(value, (dict, bool)):
        raise ValidationError("grammar is not valid: a JSON schema must be an object")
    return json.dumps(value, separators=(",", ":"))


class CompiledGrammar:
    """A checked grammar, bound to the engine's tokenizer; immutable and shared by its requests."""

    def __init__(self, spec: GrammarSpec, matcher: llguidance.LLMatcher):
        self.spec = spec
        self._initial = matcher  # never advanced: each sequence advances its own copy

    def new_state(self) -> GrammarState:
        return GrammarState(self._initial.deep_copy())


class GrammarState:
    """One sequence's position in its grammar: fills its mask row, accepts its sampled tokens."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher
        # The mask of the current position, being filled in the background: (done, bitmask, row).
        self._prefetched: tuple[Future, Tensor, int] | None = None

    def fill_bitmask(self, bitmask: Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (CPU int32, contiguous)."""
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token; a token the grammar rejects is a `GenerationError`."""
        self._take_prefetched()  # the matcher is never read and advanced at once
        if not self.matcher.consume_token(token_id):
            raise GenerationError(
                f"token {token_id} does not match the request's grammar: {_short(self.matcher.get_error())}"
            )

    @property
    def is_complete(self) -> bool:
        """The grammar is satisfied and allows nothing but EOS: the sequence is done."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    def _take_prefetched(self) -> Tensor | None:
        """The prefetched mask row `[W]` of the current position (waiting for it), or None.

        None too when the background fill failed: it filled a group of rows at once, so one bad
        row fails them all; each row is then filled again on its own, where only the bad one fails.
        """
        if self._prefetched is None:
            return None
        done, bitmask, row = self._prefetched
        self._prefetched = None
        return bitmask[row] if done.exception() is None else None


_executor: llguidance.LLExecutor | None = None
_prefetcher: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def fill_bitmasks(states: Sequence[GrammarState], vocab_size: int) -> Tensor:
    """The masks of all constrained rows of a step `[R, ceil(V / 32)]`: the prefetched rows collected,
    the others filled together in llguidance's thread pool (a single row in place: no hand-off)."""
    bitmask = torch.empty(len(states), (vocab_size + 31) // 32, dtype=torch.int32)  # [R, W]
    missing = []
    for row, state in enumerate(states):
        prefetched = state._take_prefetched()
        if prefetched is None:
            missing.append(row)
        else:
            bitmask[row] = prefetched
    _fill([(states[row], row) for row in missing], bitmask)
    return bitmask


def prefetch_masks(states: Sequence[GrammarState], vocab_size: int) -> None:
    """Start filling the masks of `states`' current positions on the background thread; the next
    `fill_bitmasks` (or `accept`) of each state waits for its row. Complete grammars are skipped."""
    states = [s for s in states if s._prefetched is None and not s.is_complete]
    if not states:
        return
    bitmask = torch.empty(len(states), (vocab_size + 31) // 32, dtype=torch.int32)  # [R, W]
    done = _background().submit(_fill, [(state, row) for row, state in enumerate(states)], bitmask)
    for row, state in enumerate(states):
        state._prefetched = (done, bitmask, row)


def _fill(rows: list[tuple[GrammarState, int]], bitmask: Tensor) -> None:
    """Fill each (state, row): one row in place, several in llguidance's thread pool."""
    if len(rows) == 1:
        rows[0][0].fill_bitmask(bitmask, rows[0][1])
    elif rows:
        llguidance.torch.fill_next_token_bitmask_par(
            _shared_executor(), [(state.matcher, row) for state, row in rows], bitmask
        )


def _background() -> ThreadPoolExecutor:
    global _prefetcher
    with _executor_lock:
        if _prefetcher is None:
            _prefetcher = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return _prefetcher


def _shared_executor() -> llguidance.LLExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()
        return _executor


class _Compilation:
    """One spec's compilation: when it started (on a compiler thread) and how it ended."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.started_at = 0.0  # time.monotonic() once `started` is set
        self.done: Future[CompiledGrammar] = Future()
        self.task: Future[None] | None = None  # the compiler pool's task, cancelled while still queued


class GrammarCompiler:
    """Compiles grammar specs for one engine's tokenizer; thread-safe, with a bounded LRU cache.

    `vocab_size` is the model's logits width, which may exceed the tokenizer's: the extra ids are
    never allowed. `eos_token_ids` are all the ids that end generation (generation config and
    tokenizer); each one is allowed once the grammar is complete. Compilations run on the
    compiler's own threads under `budget`; the caller waits at most the budget for one.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        max_cache_size: int = DEFAULT_CACHE_SIZE,
        budget: GrammarBudget | None = None,
    ):
        eos_ids = sorted(set(eos_token_ids))
        if not eos_ids:
            raise ValueError("grammar support needs at least one EOS token id")
        self.vocab_size = vocab_size
        self.max_cache_size = max_cache_size
        self.budget = budget or GrammarBudget()
        self._eos_ids = [i for i in eos_ids if i < vocab_size]
        self._limits = self.budget.limits()
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_ids)
        # Its own threads: a compilation past its budget runs on (bounded by llguidance's fuel) without
        # holding a validation thread, and hostile grammars never take more than `max_concurrent` cores.
        self._pool = ThreadPoolExecutor(self.budget.max_concurrent, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[GrammarSpec, _Compilation] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # compilations run (cache misses), for tests and metrics
        self.num_running = 0  # compilations under way now, for tests and metrics

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar of `spec` (from the cache when seen before); `ValidationError` if invalid,
        `GrammarTooComplex` over budget, `OverloadedError` when no compiler thread frees up in time.

        Concurrent callers of one new spec wait for a single compilation; other specs don't wait.
        """
        with self._lock:
            job = self._cache.get(spec)
            if job is None:
                job = self._cache[spec] = _Compilation()
                self.num_compiled += 1
                while len(self._cache) > self.max_cache_size:
                    self._cache.popitem(last=False)
                job.task = self._pool.submit(self._run, spec, job)
            else:
                self._cache.move_to_end(spec)
        return self._wait(spec, job)

    def _wait(self, spec: GrammarSpec, job: _Compilation) -> CompiledGrammar:
        timeout = self.budget.compile_timeout_s
        if not job.started.wait(timeout):
            assert job.task is not None
            if job.task.cancel():  # still queued behind other grammars: none of it ran
                self._forget(spec, job)
                with self._lock:
                    if not job.done.done():
                        job.done.set_exception(OverloadedError("too many grammars are compiling; retry later"))
            else:
                job.started.wait()  # it started just as the wait ended
        try:
            return job.done.result(timeout=max(0.0, job.started_at + timeout - time.monotonic()))
        except FutureTimeout:
            raise self._over_budget() from None

    def _over_budget(self) -> GrammarTooComplex:
        return GrammarTooComplex(f"compiling it takes longer than {self.budget.compile_timeout_s * 1000:.0f} ms")

    def _forget(self, spec: GrammarSpec, job: _Compilation) -> None:
        with self._lock:
            if self._cache.get(spec) is job:
                del self._cache[spec]

    def _run(self, spec: GrammarSpec, job: _Compilation) -> None:
        job.started_at = time.monotonic()
        job.started.set()
        with self._lock:
            self.num_running += 1
        try:
            compiled = self._compile(spec, deadline=job.started_at + self.budget.compile_timeout_s)
        except BaseException as error:
            if not isinstance(error, GrammarTooComplex):
                self._forget(spec, job)  # invalid specs are not kept: the cache holds grammars
            job.done.set_exception(error)
        else:
            job.done.set_result(compiled)
        finally:
            with self._lock:
                self.num_running -= 1

    def _compile(self, spec: GrammarSpec, deadline: float) -> CompiledGrammar:
        """The matcher, its first mask filled (where llguidance's lazy lexer does its expensive work)
        and one allowed token taken on a copy (a lexer out of fuel only says so at the next token)."""
        try:
            if spec.kind == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(spec.value, defaults=JSON_OPTIONS)
            elif spec.kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(spec.value)
            else:
                grammar = llguidance.LLMatcher.grammar_from_lark(spec.value)
        except ValueError as error:
            raise ValidationError(f"grammar is not valid: {_short(str(error), spec.value)}") from None
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise ValidationError(f"grammar is not valid: {_short(matcher.get_error(), spec.value)}")
        self._check_deadline(deadline)
        bitmask = torch.empty(1, (self.vocab_size + 31) // 32, dtype=torch.int32)  # [1, W]
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        if matcher.is_error():
            reason = _short(matcher.get_error())
            if reason.startswith("NoExtension"):  # nothing can start: e.g. the regex `[^\s\S]`
                raise ValidationError("grammar is not valid: no text matches it")
            raise GrammarTooComplex(reason)
        self._check_deadline(deadline)
        token_id = self._first_allowed_token(bitmask[0])
        if token_id is not None:
            probe = matcher.deep_copy()
            if not probe.consume_token(token_id):
                raise GrammarTooComplex(_short(probe.get_error()))
            self._check_deadline(deadline)
        return CompiledGrammar(spec, matcher)

    def _check_deadline(self, deadline: float) -> None:
        if time.monotonic() > deadline:
            raise self._over_budget()

    def _first_allowed_token(self, bitmask_row: Tensor) -> int | None:
        """The lowest id the mask row allows other than EOS, or None (only EOS: the grammar is done)."""
        allowed = np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")[: self.vocab_size]
        allowed[self._eos_ids] = 0
        ids = np.flatnonzero(allowed)
        return int(ids[0]) if len(ids) else None
