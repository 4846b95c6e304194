"""Grammar-constrained generation: grammar specs, their compilation, and per-sequence matcher state.

The grammar engine is llguidance (chosen by measurement, see `benchmarks/grammar_libraries.py`):
it compiles a JSON schema in about a millisecond and fills a token mask in tens of microseconds,
with no dependency of its own. Compilation runs where validation runs, on a worker thread, so a
slow schema never stalls the engine thread; the engine thread only copies a compiled matcher per
sequence, fills mask rows and advances matchers.

A mask is a bitmask `[R, ceil(V / 32)]` int32 (bit j of word w allows token 32 * w + j), one row
per constrained sequence; the sampler turns it into -inf logits (`ops.apply_token_bitmask`).
Once a step's tokens are accepted, `prefetch_masks` fills the next step's masks on a background
thread while the model computes the next logits; `fill_bitmasks` then only collects them.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from torch import Tensor

from inference_service.errors import GenerationError, ValidationError, condensed, quoted

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of llguidance's stub only

KINDS = ("json", "regex", "lark")
# One whitespace style: flexible whitespace lets a weak model loop on blanks until max_new_tokens.
# The separators are the usual `json.dumps` ones, the spacing models most often write.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
DEFAULT_CACHE_SIZE = 256
# The grammar engine's messages may quote the grammar (a regex, a schema), line by line.
GRAMMAR_ERROR_CHARS = 400


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
            reason = (self.matcher.get_error() or "rejected").splitlines()[0]  # the rest is a parser dump
            reason = condensed(reason, GRAMMAR_ERROR_CHARS)
            raise GenerationError(f"token {token_id} does not match the request's grammar: {reason}")

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


class GrammarCompiler:
    """Compiles grammar specs for one engine's tokenizer; thread-safe, with a bounded LRU cache.

    `vocab_size` is the model's logits width, which may exceed the tokenizer's: the extra ids are
    never allowed. `eos_token_ids` are all the ids that end generation (generation config and
    tokenizer); each one is allowed once the grammar is complete.
    """

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int], max_cache_size: int = DEFAULT_CACHE_SIZE
    ):
        eos_ids = sorted(set(eos_token_ids))
        if not eos_ids:
            raise ValueError("grammar support needs at least one EOS token id")
        self.vocab_size = vocab_size
        self.max_cache_size = max_cache_size
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_ids)
        self._cache: OrderedDict[GrammarSpec, Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # compilations run (cache misses), for tests and metrics

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar of `spec` (from the cache when seen before); `ValidationError` if invalid.

        Concurrent callers of one new spec wait for a single compilation; other specs don't wait.
        """
        with self._lock:
            cached = self._cache.get(spec)
            if cached is None:
                future: Future[CompiledGrammar] = Future()
                self._cache[spec] = future
                self.num_compiled += 1
                while len(self._cache) > self.max_cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(spec)
        if cached is not None:
            return cached.result()
        try:
            compiled = self._compile(spec)
        except BaseException as error:
            with self._lock:
                if self._cache.get(spec) is future:
                    del self._cache[spec]  # invalid specs are not kept: the cache holds grammars
            future.set_exception(error)
            raise
        future.set_result(compiled)
        return compiled

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        try:
            if spec.kind == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(spec.value, defaults=JSON_OPTIONS)
            elif spec.kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(spec.value)
            else:
                grammar = llguidance.LLMatcher.grammar_from_lark(spec.value)
        except ValueError as error:
            raise ValidationError(f"grammar is not valid: {condensed(str(error), GRAMMAR_ERROR_CHARS)}") from None
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValidationError(f"grammar is not valid: {condensed(matcher.get_error(), GRAMMAR_ERROR_CHARS)}")
        return CompiledGrammar(spec, matcher)
