"""When a failed call may be sent again, and how long to wait first.

Only a call that no server took is retried: the channel could not connect, or the server (or the
gateway, when no server was reachable) answered UNAVAILABLE with the retry marker, which it sets
only before admitting a request (loading, draining). An UNAVAILABLE without it (a connection lost
under a running generation) is not retried: the generation would run twice. A stream that has
yielded a token is never re-sent, so no caller sees a token twice.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from textgen_client.errors import TextGenerationError, UnavailableError


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter for UNAVAILABLE calls.

    Waits `initial_backoff`, then `multiplier` times longer each retry up to `max_backoff`, each
    wait scaled by a random factor in [1 - jitter, 1 + jitter]. All retries of a call share its
    timeout: no retry starts once the wait would pass the call's deadline.
    """

    max_retries: int = 5
    """Retries after the first try; 0 disables retrying."""
    initial_backoff: float = 0.1
    max_backoff: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if not 0 < self.initial_backoff <= self.max_backoff:
            raise ValueError("need 0 < initial_backoff <= max_backoff")
        if self.multiplier < 1 or not 0 <= self.jitter < 1:
            raise ValueError("need multiplier >= 1 and 0 <= jitter < 1")

    def backoff(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (0 for the first retry)."""
        base = min(self.max_backoff, self.initial_backoff * self.multiplier**retry)
        return base * random.uniform(1 - self.jitter, 1 + self.jitter)


NO_RETRY = RetryPolicy(max_retries=0)


def is_retryable(error: TextGenerationError, received_any: bool) -> bool:
    """Whether a call that failed with `error` is safe to send again."""
    return isinstance(error, UnavailableError) and error.retryable and not received_any
