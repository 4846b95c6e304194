"""Draft tokens for speculative decoding: prompt lookup (n-gram) over a sequence's own tokens.

Editing, extraction and code-rewriting answers copy long spans of their prompt: when the last n
tokens of the sequence occurred before, the tokens that followed that occurrence are a good guess
of what comes next. The guess costs no model: the engine verifies it in the next forward pass (the
draft tokens run as extra rows beside the ordinary decode row) and keeps the longest prefix the
sampler agrees with.

`Proposer` is the contract the engine calls; a draft model would implement the same method.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class Proposer(Protocol):
    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` guesses of the tokens that follow `token_ids` (may be none)."""


class NgramProposer:
    """The most recent earlier occurrence of the sequence's last n tokens (longest n first, from
    `max_ngram` down to `min_ngram`) proposes the tokens that followed it.

    The most recent occurrence, not the first: in an edit the nearest copy is usually the one being
    reproduced; when it overlaps the end (a repeating loop), the guess continues the repetition.
    Only the last `window` tokens are searched, which bounds the cost per step.

    At least 2 tokens must match: in free text one recurring token ("the", a comma) is followed by
    something else nearly always, and a wrong guess still costs its row in the forward pass (about
    13% of a one-row step each, on the demo model on CPU). In benchmarks/speculation_bench.py,
    min_ngram=1 made text without repetition 12% slower, 2 makes it 1% slower; editing gains alike.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2, window: int = 4096):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min ({min_ngram}) <= max ({max_ngram})")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.window = window

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        if max_tokens <= 0 or len(token_ids) <= self.min_ngram:
            return []
        tokens = np.asarray(token_ids[-self.window :], dtype=np.int64)  # [L]
        length = len(tokens)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            # Earlier windows of n tokens (each followed by at least one token) equal to the suffix.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # [L - n, n]
            matches = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
            if len(matches):
                start = int(matches[-1]) + n  # first token after the latest occurrence
                return _continuation(tokens, start, max_tokens)
        return []


def _continuation(tokens: np.ndarray, start: int, max_tokens: int) -> list[int]:
    """`max_tokens` from `start` on; past the end, the guess goes on copying itself: the match says
    the sequence repeats with period `len(tokens) - start`, so the guess does too."""
    guess = tokens[start : start + max_tokens].tolist()
    period = len(tokens) - start
    while len(guess) < max_tokens:
        guess.append(guess[len(guess) - period])
    return guess
