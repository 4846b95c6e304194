"""Grammar-constrained generation: the compilation of grammar specs, within a budget.

The grammar engine is llguidance (chosen by measurement, see `benchmarks/grammar_libraries.py`):
it compiles a JSON schema in about a millisecond and fills a token mask in tens of microseconds,
with no dependency of its own. Its lexer is lazy: the work a hostile grammar costs (a counted
repetition like `a{1000000}` takes seconds) happens at its first mask. So compiling means building
the matcher, filling its first mask and taking one token on a copy, all on the compiler's own
threads while validation waits (llguidance drops the GIL throughout), within a `GrammarBudget`: a
grammar over budget is a `ValidationError` at validation, never a stalled engine step or a failure
mid-generation. The engine thread only copies a compiled matcher per sequence (its first mask
comes with it), fills mask rows and advances matchers, each step bounded by llguidance's fuel.

The specs are `grammar_spec`'s, the per-sequence state and the masks `grammar_state`'s; both are
re-exported here for callers.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import numpy as np
import torch
from torch import Tensor

from inference_service.errors import OverloadedError, ValidationError
from inference_service.sample.grammar_spec import JSON_OPTIONS, KINDS, GrammarSpec, grammar_spec_from_tgi, lark_json
from inference_service.sample.grammar_state import GrammarState, fill_bitmasks, prefetch_masks
from inference_service.sample.grammar_state import short_error as _short
from inference_service.sample.heap_usage import heap_in_use

__all__ = [
    "JSON_OPTIONS",
    "KINDS",
    "CompiledGrammar",
    "GrammarBudget",
    "GrammarCompiler",
    "GrammarSpec",
    "GrammarState",
    "GrammarTooComplex",
    "fill_bitmasks",
    "grammar_spec_from_tgi",
    "lark_json",
    "prefetch_masks",
]

DEFAULT_CACHE_SIZE = 256
# What the cached grammars may hold, all together. A grammar's lexer is native memory, and a short
# spec can hold a lot of it: `a{20000}` (8 bytes) holds 9 MiB, so 256 distinct ones held 2.3 GiB in
# each process that validates or runs grammars. Typical tool schemas hold 0.1-1.5 MiB.
DEFAULT_CACHE_BYTES = 64 * 2**20
MIN_CHARGE = 16 * 2**10  # an entry's least charge (its spec, its matcher's own objects)


@dataclass(frozen=True)
class GrammarBudget:
    """What compiling one grammar may cost (its first mask and first token included).

    `compile_timeout_s` is how long a caller waits once its compilation starts, and the CPU time a
    compilation may use (CPU, so that one slowed by a busy machine is not kept as too complex);
    `max_lexer_states` caps the lexer's DFA (1-2 kB a state; llguidance's own cap is 250,000). At
    most `max_concurrent` grammars compile at once; one that can't start within `compile_timeout_s`
    is `OverloadedError`. Compiler threads run `niceness` below the server (Linux): a hostile grammar burning its
    budget gets the CPU the engine and the API leave, not theirs (at 0, two of them took a 2-core
    machine's steps from the other requests).
    """

    compile_timeout_s: float = 2.0
    max_lexer_states: int = 50_000
    max_concurrent: int = 2
    niceness: int = 10

    def __post_init__(self) -> None:
        if not (self.compile_timeout_s > 0 and self.max_lexer_states > 0 and self.max_concurrent > 0):
            raise ValueError("a grammar budget's timeout, state cap and concurrency must be positive")
        if not 0 <= self.niceness <= 19:
            raise ValueError("a grammar budget's niceness is 0 to 19")

    def limits(self) -> llguidance.LLParserLimits:
        # No parser dumps in errors: they are long and echo the grammar.
        return llguidance.LLParserLimits(max_lexer_states=self.max_lexer_states, verbose_errors=False)


class GrammarTooComplex(ValidationError):
    """A grammar over its `GrammarBudget`: the caller's error, told at validation (kept in the cache,
    so the same grammar sent again is refused at once)."""

    def __init__(self, reason: str):
        super().__init__(f"grammar is too complex: {reason}")


class CompiledGrammar:
    """A checked grammar, bound to the engine's tokenizer; immutable and shared by its requests."""

    def __init__(self, spec: GrammarSpec, matcher: llguidance.LLMatcher):
        self.spec = spec
        self._initial = matcher  # never advanced: each sequence advances its own copy

    def new_state(self) -> GrammarState:
        return GrammarState(self._initial.deep_copy())


class _Compilation:
    """One spec's compilation: when it started (on a compiler thread) and how it ended."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.started_at = 0.0  # time.monotonic() once `started` is set
        self.done: Future[CompiledGrammar] = Future()
        self.task: Future[None] | None = None  # the compiler pool's task, cancelled while still queued
        self.charge = 0  # bytes the cache counts for it, once its compilation ended


class GrammarCompiler:
    """Compiles grammar specs for one engine's tokenizer; thread-safe, with an LRU cache bounded in
    entries and in bytes.

    `vocab_size` is the model's logits width, which may exceed the tokenizer's: the extra ids are
    never allowed. `eos_token_ids` are all the ids that end generation (generation config and
    tokenizer); each one is allowed once the grammar is complete. Compilations run on the
    compiler's own threads under `budget`; the caller waits at most the budget for one.

    Each cached grammar is charged the C heap's growth across its compilation (heap_usage.py: the
    lexer and matcher llguidance built) plus its spec's length; the oldest entries go while the
    charges pass `max_cache_bytes`. Two compilations at once, or the engine's own allocations meanwhile,
    blur a charge either way; the count bound stays the backstop.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        max_cache_size: int = DEFAULT_CACHE_SIZE,
        budget: GrammarBudget | None = None,
        max_cache_bytes: int = DEFAULT_CACHE_BYTES,
    ):
        eos_ids = sorted(set(eos_token_ids))
        if not eos_ids:
            raise ValueError("grammar support needs at least one EOS token id")
        self.vocab_size = vocab_size
        self.max_cache_size = max_cache_size
        self.max_cache_bytes = max_cache_bytes
        self.cache_bytes = 0  # the charges of the cached entries
        self.budget = budget or GrammarBudget()
        self._eos_ids = [i for i in eos_ids if i < vocab_size]
        self._limits = self.budget.limits()
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_ids)
        # Its own threads: a compilation past its budget runs on (bounded by llguidance's fuel) without
        # holding a validation thread, and hostile grammars never take more than `max_concurrent` cores.
        self._pool = ThreadPoolExecutor(
            self.budget.max_concurrent,
            thread_name_prefix="grammar-compile",
            initializer=_lower_priority,
            initargs=(self.budget.niceness,),
        )
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
                self._evict()
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
            error = job.done.exception(timeout=max(0.0, job.started_at + timeout - time.monotonic()))
        except FutureTimeout:
            raise self._over_budget() from None
        if error is not None:
            raise _without_frames(error)  # a fresh one: the cached one must not keep this caller's frames
        return job.done.result()

    def _over_budget(self) -> GrammarTooComplex:
        return GrammarTooComplex(f"compiling it takes longer than {self.budget.compile_timeout_s * 1000:.0f} ms")

    def _forget(self, spec: GrammarSpec, job: _Compilation) -> None:
        with self._lock:
            if self._cache.get(spec) is job:
                del self._cache[spec]
                self.cache_bytes -= job.charge

    def _charge(self, spec: GrammarSpec, job: _Compilation, heap_before: int | None) -> None:
        """Count what the ended compilation holds against the cache's bytes (see the class)."""
        heap_after = heap_in_use()
        grown = heap_after - heap_before if heap_after is not None and heap_before is not None else 0
        with self._lock:
            if self._cache.get(spec) is job:
                job.charge = max(MIN_CHARGE, grown) + len(spec.value)
                self.cache_bytes += job.charge
                self._evict()

    def _evict(self) -> None:
        """The oldest entries out while over either bound; the newest stays (under the lock)."""
        while len(self._cache) > self.max_cache_size or (
            self.cache_bytes > self.max_cache_bytes and len(self._cache) > 1
        ):
            _, evicted = self._cache.popitem(last=False)
            self.cache_bytes -= evicted.charge

    def _run(self, spec: GrammarSpec, job: _Compilation) -> None:
        job.started_at = time.monotonic()
        job.started.set()
        with self._lock:
            self.num_running += 1
        heap_before = heap_in_use()
        try:
            compiled = self._compile(spec, deadline=time.thread_time() + self.budget.compile_timeout_s)
        except BaseException as error:
            # Kept in the cache (as a too-complex verdict) or handed to waiters: without its traceback,
            # whose frames hold the compilation's matcher (170 MiB for `((a{100}){100}){100}`).
            error = _without_frames(error)
            if isinstance(error, GrammarTooComplex):
                self._charge(spec, job, None)  # kept as its error: the spec's bytes
            else:
                self._forget(spec, job)  # invalid specs are not kept: the cache holds grammars
            job.done.set_exception(error)
        else:
            self._charge(spec, job, heap_before)
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
        """Past `deadline`: this thread's CPU time (`time.thread_time`)."""
        if time.thread_time() > deadline:
            raise self._over_budget()

    def _first_allowed_token(self, bitmask_row: Tensor) -> int | None:
        """The lowest id the mask row allows other than EOS, or None (only EOS: the grammar is done)."""
        allowed = np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")[: self.vocab_size]
        allowed[self._eos_ids] = 0
        ids = np.flatnonzero(allowed)
        return int(ids[0]) if len(ids) else None


def _without_frames(error: BaseException) -> BaseException:
    """A copy of `error` (its class, arguments and attributes) with no traceback, cause or context."""
    copy = error.__class__.__new__(error.__class__)
    copy.args = error.args
    copy.__dict__.update(error.__dict__)
    return copy


def _lower_priority(niceness: int) -> None:
    """This compiler thread `niceness` below the thread that started it (Linux sets it per thread;
    elsewhere it would be the whole process's)."""
    if niceness and sys.platform == "linux":
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + niceness))
