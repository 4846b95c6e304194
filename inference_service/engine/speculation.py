"""Speculative decoding, the engine's side: which requests get guesses before a step, and how many.

Before each step every running request that is decoding (its one unknown token is next) asks the
proposer (sample/ngram_proposer.py, or later a draft model) for up to `speculate` guesses. The
scheduler runs them after the request's known token when the step has room, and the engine
verifies them row by row with the ordinary sampler (llm_engine `_sample_step`): row j is sampled
with the request's state after the j tokens before it, exactly as plain decoding would sample it;
guess j+1 is kept while it equals the token sampled at row j.

For sampled requests this is rejection sampling with a deterministic proposal: keeping guess d
with probability p(d) and otherwise drawing from p without d yields p, and so does drawing from p
and comparing with d; drawing with the request's own generator (one uniform per token, as plain
decoding) keeps a seeded request's output the same with and without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence

from inference_service.engine.request import Request
from inference_service.sample.ngram_proposer import Proposer

# Above this many running requests nobody gets guesses: the batch already keeps the hardware busy,
# so extra rows cost compute rather than idle bandwidth, and proposing costs per request (vLLM's
# disable-by-batch-size does the same).
MAX_BATCH = 16


class Speculator:
    """Sets `draft_token_ids` on the requests that can use guesses this step."""

    def __init__(self, proposer: Proposer, num_speculative_tokens: int, max_total_tokens: int):
        if num_speculative_tokens <= 0:
            raise ValueError(f"speculate must be > 0, not {num_speculative_tokens}")
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.max_total_tokens = max_total_tokens

    def propose(self, running: Sequence[Request]) -> None:
        guessing = len(running) <= MAX_BATCH
        for request in running:
            request.draft_token_ids = []
            if not guessing or request.num_computed_tokens != request.num_tokens - 1:
                continue  # still prefilling (or recomputing): its next step is not a decode
            # A step adds at most guesses + 1 tokens: never past max_new_tokens or the context.
            room = min(
                self.num_speculative_tokens,
                request.stopping.max_new_tokens - request.num_output_tokens - 1,
                self.max_total_tokens - request.num_tokens - 1,
            )
            if room > 0:
                request.draft_token_ids = self.proposer.propose(request.all_token_ids(), room)
