"""Continuous batching with a token budget per step, fair to short requests beside long ones.

There are no prefill or decode phases: each request has `num_computed_tokens` and
`num_tokens`, and every step hands out a token budget so that the first catches up with the
second. A prompt longer than its share of the budget is prefilled in chunks over several steps.

How a step's budget is shared (Sarathi / vLLM v1 style), so that one request never holds back
another:

1. **Decodes first.** Every running request that has one token to compute (plus its speculative
   guesses) gets it, oldest first: a long prefill never stalls the streams already generating.
2. **Prefill chunks in two passes.** The requests still prefilling (running ones oldest first, then
   waiting ones admitted FIFO) first get a slice each, at most a quarter of the step's budget
   (`PREFILL_SLICES`): a short prompt that arrives while a long one is being prefilled is admitted
   and prefilled in the very next step, and the long one still moves on by its slice every step, so
   neither starves. What is left then tops up the requests closest to the end of their prefill
   (shortest remaining first), so a lone long prompt still uses the whole budget.

The budget bounds how long a step takes, and so how long a new arrival waits for the step in
progress; it is sized per device (engine.engine_info: small on CPU). Prefill chunks are counted in work,
not tokens (`engine.step_cost`): a chunk deep into a long prompt attends over all the keys before it,
so it gets fewer tokens for the same time. And in a step that carries streams (decodes, or a short
prompt that gives its first token in it), the chunks that leave part of their prompt for later share
only a small pool of work, one share per long prompt still prefilling: a stream's next token waits
for the weights' read plus a bounded slice of a long prefill, not for a full budget of it, and a
burst of long prompts still prefills in large steps beside its own first streams. Chunks that end
their prompt are not held to the pool: a burst of short prompts still fills the budget, and each
gets its first token in one step. The share is sized from measured step times (`StepClock`: the
scheduler times each step from its plan to `update`), so a step carrying streams stays within a set
multiple of the same step without the prefill, whatever the model, device and load.

When the KV pool runs dry, the newest running request is preempted: its blocks are freed and it is
recomputed later from its prompt and the tokens it already generated.

A running request may carry speculative guesses (`draft_token_ids`, engine.speculation): they run
after its known tokens when the budget and the pool allow it without preempting anyone, and are
dropped otherwise; the engine counts the accepted ones as computed after the step.

With prefix caching (`engine.prefix_cache`), an admitted request starts with the longest cached
prefix of its tokens already computed, and a waiting request whose prefix a running request is
computing right now is passed over until that is done.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque

from inference_service.engine.block_hash_index import cache_salt
from inference_service.engine.both_way_spans import fit_chunk
from inference_service.engine.kv_cache_manager import KVCacheManager
from inference_service.engine.prefix_cache import PrefixCache
from inference_service.engine.request import Request, RequestStatus
from inference_service.engine.step_cost import StepCost
from inference_service.engine.step_plan import PREFILL_SLICES, Chunk, StepPlan, pending
from inference_service.outputs import ScheduledRequest, SchedulerOutput


class Scheduler:
    """Decides which requests run in each step; the only writer of request status."""

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_batch_prefill_tokens: int,
        max_batch_size: int | None = None,
        prefix_cache: PrefixCache | None = None,
        cost: StepCost | None = None,
    ):
        self.kv = kv_cache_manager
        # Inert unless the KV cache manager was made with prefix caching.
        self.prefix = prefix_cache or PrefixCache(kv_cache_manager, cache_salt())
        self.max_batch_prefill_tokens = max_batch_prefill_tokens
        self.max_batch_size = max_batch_size
        self.cost = cost or StepCost()  # the default counts tokens only
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # The last plan's prefill work and when it was handed out: `update` times the step with them
        # for the cost model's clock.
        self._planned: tuple[float, bool, float] | None = None
        # Set when a step gave way to an arrival (engine/step_yield.py): the next step that carries
        # a stream gives the long prompts no share, so the arrival runs as it would alone.
        self.arrival_first = False

    # -- admission and removal ------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        request.timings.queued = time.perf_counter()
        self.waiting.append(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request (stop, length, abort, error) and free its blocks at once."""
        if request.status.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.prefix.released(request)
        self.kv.free(request.request_id)
        request.status = status
        request.timings.finished = time.perf_counter()

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_batch_prefill_tokens
        plan = StepPlan(budget, self.cost)
        preempted: list[str] = []

        # 1. Decodes (and their guesses), oldest first.
        for request in list(self.running):
            if plan.left <= 0:
                break
            if request.status is not RequestStatus.RUNNING or pending(request) != 1:
                continue  # preempted a moment ago, or still prefilling: pass 2
            block_ids = self._allocate_with_drafts(request, 1, plan.left)
            if block_ids is None:
                block_ids = self._allocate_or_preempt(request, 1, plan, preempted)
            if block_ids is None:
                break  # the request preempted itself: nothing newer is left
            plan.add_decode(request, block_ids)

        # A stream waits on this step: the chunks that leave part of their prompt share a small pool.
        slice_work = budget / PREFILL_SLICES
        if plan.chunks or self._short_arrival(budget // PREFILL_SLICES):
            num_long = self._num_long_prompts(plan, slice_work)
            plan.open_pool(0.0 if self.arrival_first else self.cost.stream_pool(budget, plan.decode_work, num_long))
        self.arrival_first = False

        # 2a. A slice each for the running prefills, oldest first (none when every running request
        # decodes: the common step)...
        for request in list(self.running) if len(plan.chunks) < len(self.running) else ():
            if plan.left <= 0 or plan.work_left <= 0:
                break
            if request.status is not RequestStatus.RUNNING or request.request_id in plan.chunks:
                continue
            request.draft_token_ids = []  # guesses ride on decodes only
            num_new = plan.fit(request.num_computed_tokens, pending(request), slice_work)
            num_new = fit_chunk(request, request.num_computed_tokens, num_new)
            if num_new == 0:
                continue  # the pool is spent: it moves on in the next step
            block_ids = self._allocate_or_preempt(request, num_new, plan, preempted)
            if block_ids is None:
                break
            plan.add_prefill(request, num_new, block_ids)

        # 2b. ...then for waiting requests, admitted FIFO. Admitting new work while preempting
        # would only thrash the pool.
        admitted: list[str] = []
        index = 0
        while not preempted and index < len(self.waiting) and plan.left > 0 and plan.work_left > 0 and self._has_seat():
            request = self.waiting[index]
            hit = self.prefix.lookup(request)
            if hit.wait:  # its prefix is being computed this very moment: reuse it in a step or two
                index += 1
                continue
            num_new = plan.fit(hit.num_tokens, request.num_tokens - hit.num_tokens, slice_work)
            num_new = fit_chunk(request, hit.num_tokens, num_new)
            if num_new == 0:
                break  # FIFO: the pool is spent, nobody skips ahead of it
            block_ids = self.kv.allocate_slots(
                request.request_id, hit.num_tokens + num_new, hit.block_ids, hit.adopted_block
            )
            if block_ids is None:
                break  # FIFO: no skipping ahead of a request the pool can't hold
            del self.waiting[index]
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = hit.num_tokens
            if request.timings.first_scheduled is None:
                request.timings.num_cached_tokens = hit.num_tokens
            self.prefix.admitted(request, hit)
            admitted.append(request.request_id)
            plan.add_prefill(request, num_new, block_ids)

        # 3. What is left tops up the prefills closest to their end (never at the cost of a preemption;
        # a decode has nothing left to top up).
        for chunk in sorted(plan.prefills.values(), key=lambda c: pending(c.request) - c.num_new):
            request = chunk.request
            rest = pending(request) - chunk.num_new
            if rest <= 0:
                continue
            extra = plan.fit(request.num_computed_tokens + chunk.num_new, rest, math.inf, top_up=True)
            extra = fit_chunk(request, request.num_computed_tokens + chunk.num_new, extra, may_grow=False)
            end = request.num_computed_tokens + chunk.num_new + extra
            block_ids = self.kv.allocate_slots(request.request_id, end) if extra > 0 else None
            if block_ids is not None:
                plan.grow(chunk, extra, block_ids)

        chunks = plan.chunks.values()
        scheduled = [self._schedule_one(chunk) for chunk in chunks]
        for chunk in chunks:
            chunk.request.timings.batch_sizes.append(len(scheduled))
        if self.cost.clock is not None:
            held = plan.pool < math.inf and any(chunk.leaves_prompt for chunk in plan.prefills.values())
            self._planned = (plan.prefill_work, held, time.perf_counter())
        return SchedulerOutput(scheduled=scheduled, preempted_ids=preempted, admitted_ids=admitted)

    def _short_arrival(self, slice_work: int) -> bool:
        """Whether the next request to admit is a prompt that gives its first token in this step."""
        return bool(self.waiting) and self._has_seat() and self.cost.work(0, self.waiting[0].num_tokens) <= slice_work

    def _num_long_prompts(self, plan: StepPlan, slice_work: float) -> int:
        """Prompts the pool holds back in this step (their rest is more than a slice): running ones
        still prefilling, and the waiting ones that have a seat."""

        if not self.waiting and len(plan.chunks) == len(self.running):
            return 0  # every running request decodes in this step (the usual decode step: no scan)

        def is_long(request: Request) -> bool:
            return self.cost.work(request.num_computed_tokens, pending(request)) > slice_work

        running = sum(1 for r in self.running if r.request_id not in plan.chunks and pending(r) > 1 and is_long(r))
        seats = len(self.waiting) if self.max_batch_size is None else self.max_batch_size - len(self.running)
        return running + sum(1 for r in itertools.islice(self.waiting, max(0, seats)) if is_long(r))

    def _has_seat(self) -> bool:
        return self.max_batch_size is None or len(self.running) < self.max_batch_size

    def _allocate_with_drafts(self, request: Request, num_new: int, budget: int) -> list[int] | None:
        """Room for the known tokens and the guesses, if the step's budget has it and the pool keeps
        a block in reserve for every running request after it; else the guesses are dropped (None):
        a guess is never worth a preemption."""
        drafts = request.draft_token_ids
        if not drafts:
            return None
        known_end = request.num_computed_tokens + num_new
        num_extra = self.kv.num_blocks_for(known_end + len(drafts)) - self.kv.num_blocks_for(known_end)
        if (
            num_new + len(drafts) <= budget
            and known_end == request.num_tokens
            and self.kv.num_free_blocks - num_extra >= len(self.running)
        ):
            block_ids = self.kv.allocate_slots(request.request_id, known_end + len(drafts))
            if block_ids is not None:
                return block_ids
        request.draft_token_ids = []
        return None

    def _allocate_or_preempt(
        self, request: Request, num_new: int, plan: StepPlan, preempted: list[str]
    ) -> list[int] | None:
        """Room for the request's next `num_new` tokens, preempting the newest running requests
        (dropping them from this step's plan) until it fits: its block table, or None if it had to
        preempt itself."""
        while True:
            block_ids = self.kv.allocate_slots(request.request_id, request.num_computed_tokens + num_new)
            if block_ids is not None:
                return block_ids
            victim = self.running[-1]
            plan.drop(victim)
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.prefix.released(request)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.draft_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.timings.num_preemptions += 1
        request.timings.preempted_at.append(time.perf_counter())
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _schedule_one(self, chunk: Chunk) -> ScheduledRequest:
        request, num_new = chunk.request, chunk.num_new
        start = request.num_computed_tokens
        end = start + num_new
        if request.timings.first_scheduled is None:
            request.timings.first_scheduled = time.perf_counter()
        wants_prompt_logprobs = (
            request.sampling.prompt_logprobs and not request.prompt_logprobs_done and start < request.num_prompt_tokens
        )
        drafts, request.draft_token_ids = request.draft_token_ids, []
        return ScheduledRequest(
            request_id=request.request_id,
            num_computed_tokens=start,
            num_new_tokens=num_new + len(drafts),
            token_ids=request.token_ids(start, end) + drafts,
            block_ids=chunk.block_ids,
            sample=end == request.num_tokens,
            prompt_logprobs=wants_prompt_logprobs,
            num_draft_tokens=len(drafts),
            encoder_token_ids=request.encoder_token_ids if start == 0 else None,
            adapter_id=request.adapter_id,
        )

    # -- after the step -------------------------------------------------------------------
    def update(self, output: SchedulerOutput, requests: dict[str, Request]) -> None:
        """Advance the computed counters of everything that ran (its known tokens; guesses count
        once accepted, through `accept_drafts`)."""
        if self._planned is not None and self.cost.clock is not None and output.scheduled:
            work, held, started = self._planned
            self.cost.clock.observe(work, time.perf_counter() - started, held)
        self._planned = None
        for item in output.scheduled:
            request = requests[item.request_id]
            request.num_computed_tokens += item.num_known_tokens
            if request.num_computed_tokens >= request.num_prompt_tokens:
                request.prompt_logprobs_done = True
            self.prefix.computed(request)

    def accept_drafts(self, request: Request, num_accepted: int) -> None:
        """After verification: the first `num_accepted` guesses became output tokens, and the K/V
        computed for them in the step is theirs. The rejected ones' slots are written over later."""
        if num_accepted and not request.status.is_finished:
            request.num_computed_tokens += num_accepted
            self.prefix.computed(request)
