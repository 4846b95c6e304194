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
progress; it is sized per device (engine.builder: small on CPU).

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

import time
from collections import deque
from dataclasses import dataclass

from inference_service.engine.block_hash_index import cache_salt
from inference_service.engine.kv_cache_manager import KVCacheManager
from inference_service.engine.prefix_cache import PrefixCache
from inference_service.engine.request import Request, RequestStatus
from inference_service.outputs import ScheduledRequest, SchedulerOutput

# A request still prefilling first gets at most this share of a step's budget (1/PREFILL_SLICES):
# the rest stays for the others, and tops up the prefills afterwards if nobody else wants it.
PREFILL_SLICES = 4


@dataclass
class _Chunk:
    """One request's share of a step: its next `num_new` known tokens (its guesses ride along)."""

    request: Request
    num_new: int


class _StepPlan:
    """The chunks of one step, in step order (decodes, then prefills), and its budget left."""

    def __init__(self, budget: int):
        self.chunks: dict[str, _Chunk] = {}
        self.left = budget

    def add(self, request: Request, num_new: int) -> None:
        self.chunks[request.request_id] = _Chunk(request, num_new)
        self.left -= num_new + len(request.draft_token_ids)

    def grow(self, chunk: _Chunk, extra: int) -> None:
        chunk.num_new += extra
        self.left -= extra

    def drop(self, request: Request) -> None:
        """Take a preempted request out (before its guesses are forgotten)."""
        chunk = self.chunks.pop(request.request_id, None)
        if chunk is not None:
            self.left += chunk.num_new + len(request.draft_token_ids)


def _pending(request: Request) -> int:
    """Known tokens the request has not computed yet: 1 for a decode, more while prefilling."""
    return request.num_tokens - request.num_computed_tokens


class Scheduler:
    """Decides which requests run in each step; the only writer of request status."""

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_batch_prefill_tokens: int,
        max_batch_size: int | None = None,
        prefix_cache: PrefixCache | None = None,
    ):
        self.kv = kv_cache_manager
        # Inert unless the KV cache manager was made with prefix caching.
        self.prefix = prefix_cache or PrefixCache(kv_cache_manager, cache_salt())
        self.max_batch_prefill_tokens = max_batch_prefill_tokens
        self.max_batch_size = max_batch_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

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
        plan = _StepPlan(self.max_batch_prefill_tokens)
        preempted: list[str] = []
        slice_size = max(1, self.max_batch_prefill_tokens // PREFILL_SLICES)

        # 1. Decodes (and their guesses), oldest first.
        for request in list(self.running):
            if plan.left <= 0:
                break
            if request.status is not RequestStatus.RUNNING or _pending(request) != 1:
                continue  # preempted a moment ago, or still prefilling: pass 2
            with_drafts = self._allocate_with_drafts(request, 1, plan.left) is not None
            if not with_drafts and not self._allocate_or_preempt(request, 1, plan, preempted):
                break  # the request preempted itself: nothing newer is left
            plan.add(request, 1)

        # 2a. A slice each for the running prefills, oldest first...
        for request in list(self.running):
            if plan.left <= 0:
                break
            if request.status is not RequestStatus.RUNNING or request.request_id in plan.chunks:
                continue
            request.draft_token_ids = []  # guesses ride on decodes only
            num_new = min(_pending(request), slice_size, plan.left)
            if not self._allocate_or_preempt(request, num_new, plan, preempted):
                break
            plan.add(request, num_new)

        # 2b. ...then for waiting requests, admitted FIFO. Admitting new work while preempting
        # would only thrash the pool.
        admitted: list[str] = []
        index = 0
        while not preempted and index < len(self.waiting) and plan.left > 0 and self._has_seat():
            request = self.waiting[index]
            hit = self.prefix.lookup(request)
            if hit.wait:  # its prefix is being computed this very moment: reuse it in a step or two
                index += 1
                continue
            num_new = min(request.num_tokens - hit.num_tokens, slice_size, plan.left)
            if self.kv.allocate_slots(request.request_id, hit.num_tokens + num_new, hit.block_ids) is None:
                break  # FIFO: no skipping ahead of a request the pool can't hold
            del self.waiting[index]
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = hit.num_tokens
            if request.timings.first_scheduled is None:
                request.timings.num_cached_tokens = hit.num_tokens
            self.prefix.admitted(request, hit)
            admitted.append(request.request_id)
            plan.add(request, num_new)

        # 3. What is left tops up the prefills closest to their end (never at the cost of a preemption).
        for chunk in sorted(plan.chunks.values(), key=lambda c: _pending(c.request) - c.num_new):
            extra = min(_pending(chunk.request) - chunk.num_new, plan.left)
            request = chunk.request
            end = request.num_computed_tokens + chunk.num_new + extra
            if extra > 0 and self.kv.allocate_slots(request.request_id, end) is not None:
                plan.grow(chunk, extra)

        chunks = plan.chunks.values()
        scheduled = [self._schedule_one(chunk.request, chunk.num_new) for chunk in chunks]
        for chunk in chunks:
            chunk.request.timings.batch_sizes.append(len(scheduled))
        return SchedulerOutput(scheduled=scheduled, preempted_ids=preempted, admitted_ids=admitted)

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

    def _allocate_or_preempt(self, request: Request, num_new: int, plan: _StepPlan, preempted: list[str]) -> bool:
        """Room for the request's next `num_new` tokens, preempting the newest running requests
        (dropping them from this step's plan) until it fits; False if it had to preempt itself."""
        while True:
            if self.kv.allocate_slots(request.request_id, request.num_computed_tokens + num_new) is not None:
                return True
            victim = self.running[-1]
            plan.drop(victim)
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False

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

    def _schedule_one(self, request: Request, num_new: int) -> ScheduledRequest:
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
            block_ids=self.kv.block_table(request.request_id),
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
