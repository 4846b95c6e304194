"""How long the model's OpenMP threads spin after a parallel op before they sleep: 10,000 polls
(about half a millisecond), not libgomp's default 300,000 (several milliseconds).

Between two ops of a forward pass a thread is back well within that. Between steps (sampling, the
outputs' send, the next commands) it spun instead of sleeping, and on a host with more runnable
threads than cores that spinning took the cores the engine's own step loop, the API process and the
gateway needed: in the hostile soak on a 2-vCPU machine at load ~12, back to back, the engine core's
worker thread used 68 CPU-s beside its step loop's 67 with the default, 25 beside 73 with 10,000,
and an innocent stream's idle latency was 0.68 s against 0.089 s.

libgomp reads the variable once, when it is loaded (torch's import), so the package sets it on
import, before anything imports torch; a value the operator set is kept.
"""

from __future__ import annotations

import os

SPIN_COUNT = "10000"


def bound_spinning() -> None:
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
