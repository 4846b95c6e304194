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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A step carrying streams gives prefills this share of the budget: on CPU (budget 256) 16 tokens' work,
# about what reading the weights once costs (a decode step ~27 ms; one token's multiplies ~1.4 ms).
STREAM_SHARE = 1 / 16

# Attention over this many keys per unit of model width costs as much as a token's matrix multiplies.
KEYS_PER_WIDTH = 3


@dataclass(frozen=True)
class StepCost:
    context_scale: float = math.inf  # inf: a token costs the same at every position
    stream_share: float = 1.0  # 1: a step carrying streams gets the whole budget too

    @classmethod
    def for_hidden_size(cls, hidden_size: int | None) -> StepCost:
        """The engine's cost model for a model of this width (unknown width: tokens only)."""
        scale = KEYS_PER_WIDTH * hidden_size if hidden_size else math.inf
        return cls(context_scale=scale, stream_share=STREAM_SHARE)

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
        return max(budget * min(1.0, self.stream_share * max(1, num_prompts)), decode_work)
