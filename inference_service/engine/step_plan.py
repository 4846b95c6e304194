"""The plan of one scheduler step: the chunks it hands out (decodes, then prefill chunks), the tokens
and the work it has left, and the pool that bounds the chunks leaving part of their prompt for later.
The scheduler (`engine.scheduler`) decides who gets a chunk; this keeps the sums it decides with."""

from __future__ import annotations

import math
from dataclasses import dataclass

from inference_service.engine.request import Request
from inference_service.engine.step_cost import StepCost

# A request still prefilling first gets at most this share of a step's budget (1/PREFILL_SLICES):
# the rest stays for the others, and tops up the prefills afterwards if nobody else wants it.
PREFILL_SLICES = 4


@dataclass
class Chunk:
    """One request's share of a step: its next `num_new` known tokens (its guesses ride along)."""

    request: Request
    num_new: int
    block_ids: list[int]  # the request's table once this chunk's slots are allocated
    work: float = 0.0
    decode: bool = False

    @property
    def leaves_prompt(self) -> bool:
        """A prefill chunk that stops short of its prompt's end: nobody gets a token from it now."""
        return not self.decode and self.num_new < pending(self.request)


class StepPlan:
    """The chunks of one step, in step order (decodes, then prefills), its tokens and work left, and
    the pool that bounds the chunks leaving part of their prompt for later (`open_pool`).

    The decodes' and the prefills' work are kept as running sums: a step of B decodes reads them
    B times, and summing the chunks each time cost O(B²) calls per step."""

    def __init__(self, budget: int, cost: StepCost):
        self.chunks: dict[str, Chunk] = {}
        self.prefills: dict[str, Chunk] = {}  # the chunks that are not decodes
        self.left = budget
        self.budget = budget
        self.cost = cost
        self.pool = math.inf
        self.pool_slice = math.inf
        self.decode_work = 0.0
        self.prefill_work = 0.0

    def open_pool(self, pool: float) -> None:
        """A stream waits on this step: chunks that leave part of their prompt share `pool` (a slice
        each first, as the budget is shared)."""
        self.pool, self.pool_slice = pool, max(1.0, pool / PREFILL_SLICES)

    @property
    def work_left(self) -> float:
        """The prefills' work left (decodes count as tokens only, as ever: they never wait for work)."""
        return self.budget - self.prefill_work

    @property
    def pool_left(self) -> float:
        return self.pool - sum(chunk.work for chunk in self.prefills.values() if chunk.leaves_prompt)

    def add_decode(self, request: Request, block_ids: list[int]) -> None:
        num_tokens = 1 + len(request.draft_token_ids)
        work = self.cost.work(request.num_computed_tokens, num_tokens)
        self.chunks[request.request_id] = Chunk(request, 1, block_ids, work, decode=True)
        self.decode_work += work
        self.left -= num_tokens

    def add_prefill(self, request: Request, num_new: int, block_ids: list[int]) -> None:
        chunk = Chunk(request, num_new, block_ids, self.cost.work(request.num_computed_tokens, num_new))
        self.chunks[request.request_id] = self.prefills[request.request_id] = chunk
        self.prefill_work += chunk.work
        self.left -= num_new

    def grow(self, chunk: Chunk, extra: int, block_ids: list[int]) -> None:
        chunk.work += self.cost.work(chunk.request.num_computed_tokens + chunk.num_new, extra)
        chunk.num_new += extra
        chunk.block_ids = block_ids
        self.left -= extra
        self._sum_work()

    def fit(self, start: int, pending: int, work: float, top_up: bool = False) -> int:
        """Tokens for a prefill chunk from `start` (0: none this step): within `work`, the step's
        work and tokens left and, for a chunk that leaves part of its prompt, the pool."""
        if self.left <= 0 or self.work_left <= 0:
            return 0
        num = self.cost.fit(start, pending, min(work, self.work_left))
        if num < pending:
            pool_left = self.pool_left
            if pool_left <= 0:
                return 0
            num = min(num, self.cost.fit(start, pending, pool_left if top_up else min(pool_left, self.pool_slice)))
        return min(num, self.left)

    def drop(self, request: Request) -> None:
        """Take a preempted request out (before its guesses are forgotten)."""
        chunk = self.chunks.pop(request.request_id, None)
        if chunk is not None:
            self.prefills.pop(request.request_id, None)
            self.left += chunk.num_new + len(request.draft_token_ids)
            self._sum_work()

    def _sum_work(self) -> None:
        """The running sums summed again in step order after a chunk changed (rare: a preemption or
        a top-up), so they equal a fresh sum to the last bit."""
        self.decode_work = sum(chunk.work for chunk in self.chunks.values() if chunk.decode)
        self.prefill_work = sum(chunk.work for chunk in self.prefills.values())


def pending(request: Request) -> int:
    """Known tokens the request has not computed yet: 1 for a decode, more while prefilling."""
    return request.num_tokens - request.num_computed_tokens
