"""What a step's chunks cost, so that the scheduler's budget bounds a step's time, not its tokens.

A token's work is its share of the weights' matrix multiplies (the same at every position) plus its
attention over the keys before it (growing with its position). In units of the first, a chunk of `n`
tokens starting at position `s` costs

    work(s, n) = sum over p in s..s+n-1 of (1 + (p + 1) / context_scale)

where `context_scale` is how many keys of attention cost as much as one token's matrix multiplies.
A 256-token chunk at position 3,000 attends over ~3,000 keys per token: with a fixed token budget its
step took 2.5× the time of the same chunk at position 0 (SmolLM2-135M on CPU), and everyone in that
step waited for it; counted in work, the chunk shrinks as its context grows and the step stays put.

`context_scale` comes from the model's width (`for_hidden_size`): a layer's matrix multiplies do
~24·h² flops per token (attention projections 8h², the MLP 16h²) and its attention 4·h per key, so
6·h keys match one token; attention kernels run at about half the multiplies' rate, hence 3·h
(SmolLM2-135M, h = 576: 1,728 predicted, ~1,800 measured on CPU).

`stream_share`: a step that carries streams (decodes, or a short prompt about to give its first
token) costs at least the weights' read once, whatever it computes; a long prefill beside it at most
doubles it when its work is held to about that cost. So in such a step each prompt still prefilling
gets that share: the chunks share `max(budget × stream_share × prompts, the decodes' own work)`, at
most the budget, and the full budget when no stream waits on the step. One long prompt beside a
stream moves by one share per step; a burst of 16 image prompts, whose first ones already stream,
is not held to one share among them all (each step would then be mostly the weights' read, and the
burst's prefill would take ~16× the steps). The default (1) leaves the budget whole: tokens only.

`clock` (`StepClock`): the share in seconds, not in a fixed count. What a unit of work costs against
a step's fixed cost (the weights' read, the per-step bookkeeping) depends on the model, the device, the
threads and the load; a fixed 1/16 of the budget made a stream beside a long prefill take 2.7× its
idle per-token time on a busy CPU. The clock learns, from the steps the engine runs, a step's fixed
time and a unit of prefill work's time, and sizes each share so that a step carrying streams takes at
most `STREAM_STEP_RATIO` times the same step without the prefill (Sarathi-Serve's token budget chosen
for a latency target, kept up to date as the load changes), never below `MIN_SHARE_OF_STATIC` of the
static share. Until it has seen both kinds of step it falls back to `stream_share`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# A step carrying streams gives prefills this share of the budget: on CPU (budget 256) 16 tokens' work,
# about what reading the weights once costs (a decode step ~27 ms; one token's multiplies ~1.4 ms).
STREAM_SHARE = 1 / 16

# Attention over this many keys per unit of model width costs as much as a token's matrix multiplies.
KEYS_PER_WIDTH = 3

# A step that carries streams takes at most this many times the same step without its prefill chunks:
# a stream's tokens come within 2× their idle pace with room for the clock's error.
STREAM_STEP_RATIO = 1.6
# ...but a learned share is never below this part of the static one: a small chunk deep in a long
# prompt pays per-chunk costs (its context's K/V) that no share removes, and below a few tokens a
# step the prompt would crawl beside a stream for no gain to it (measured on a busy CPU: 2 units).
MIN_SHARE_OF_STATIC = 1 / 4


class StepClock:
    """A step's time learned from the steps run, each figure a moving average so that it follows the
    load: `fixed_s`, a step of decodes or a tiny prompt (the weights' read, the bookkeeping);
    `per_work_s`, what a unit of prefill work adds in a large step; `beside_per_work_s`, what it adds
    in a step carrying streams, where a long prompt's small chunk also pays per-chunk costs (reading
    its whole context's K/V) that a large step spreads over many tokens. The share is sized with the
    latter once seen, so a misjudged share corrects itself from the very steps it sized."""

    SMALL_WORK = 8  # prefill work up to this: the step's time is its fixed cost
    LARGE_WORK = 32  # prefill work from this: its time beyond the fixed cost is the work's
    SMOOTHING = 0.2  # the weight of the newest step in each average

    def __init__(self) -> None:
        self.fixed_s: float | None = None
        self.per_work_s: float | None = None
        self.beside_per_work_s: float | None = None

    def observe(self, prefill_work: float, seconds: float, beside_streams: bool = False) -> None:
        """One step's time and its prefill chunks' work (decodes count in the fixed cost);
        `beside_streams`: a long prompt's chunk was held to the share in it. Steps of a size in
        between teach nothing (their split is ambiguous)."""
        if beside_streams:
            if self.fixed_s is not None and prefill_work > 0:
                rate = max(seconds - self.fixed_s, 0.0) / prefill_work
                self.beside_per_work_s = self._average(self.beside_per_work_s, rate)
        elif prefill_work <= self.SMALL_WORK:
            self.fixed_s = self._average(self.fixed_s, seconds)
        elif prefill_work >= self.LARGE_WORK and self.fixed_s is not None:
            self.per_work_s = self._average(self.per_work_s, max(seconds - self.fixed_s, 0.0) / prefill_work)

    def share(self) -> float | None:
        """The prefill work a step carrying streams may add (None: not learned yet)."""
        rate = self.beside_per_work_s or self.per_work_s
        if self.fixed_s is None or not rate:
            return None
        return (STREAM_STEP_RATIO - 1) * self.fixed_s / rate

    def _average(self, mean: float | None, value: float) -> float:
        return value if mean is None else mean + self.SMOOTHING * (value - mean)


@dataclass(frozen=True)
class StepCost:
    context_scale: float = math.inf  # inf: a token costs the same at every position
    stream_share: float = 1.0  # 1: a step carrying streams gets the whole budget too
    clock: StepClock | None = field(default=None, compare=False)  # None: `stream_share` only

    @classmethod
    def for_hidden_size(cls, hidden_size: int | None) -> StepCost:
        """The engine's cost model for a model of this width (unknown width: tokens only)."""
        scale = KEYS_PER_WIDTH * hidden_size if hidden_size else math.inf
        return cls(context_scale=scale, stream_share=STREAM_SHARE, clock=StepClock())

    def work(self, start: int, num_tokens: int) -> float:
        """The work of `num_tokens` tokens from position `start` (1 per token at position 0)."""
        keys = num_tokens * start + num_tokens * (num_tokens + 1) / 2  # summed over the chunk
        return num_tokens + keys / self.context_scale

    def fit(self, start: int, pending: int, work: float) -> int:
        """The most tokens (at most `pending`, at least 1: a chunk always moves on) from `start`
        whose work is within `work`."""
        if pending <= 1 or work <= 0:
            return min(pending, 1)
        if math.isinf(work):
            return pending
        if math.isinf(self.context_scale):
            num = int(work)
        else:  # n²/2C + n(1 + (s + ½)/C) = work, solved for n
            linear = 1 + (start + 0.5) / self.context_scale
            num = int(self.context_scale * (math.sqrt(linear * linear + 2 * work / self.context_scale) - linear))
            while num > 1 and self.work(start, num) > work:  # float rounding
                num -= 1
            while num < pending and self.work(start, num + 1) <= work:
                num += 1
        return max(1, min(num, pending))

    def stream_pool(self, budget: int, decode_work: float, num_prompts: int = 1) -> float:
        """What the prefill chunks of a step carrying streams may cost together, `num_prompts`
        prompts still prefilling (running or waiting): a share each, at most the budget."""
        learned = self.clock.share() if self.clock is not None else None
        static = budget * self.stream_share
        share = static if learned is None else max(learned, static * MIN_SHARE_OF_STATIC)
        return max(min(float(budget), share * max(1, num_prompts)), decode_work)
