"""How long a stopping server keeps its port open after it stopped admitting requests.

A gateway routes requests here until its health checks see NOT_SERVING (Envoy's: within a second or
two). Until then the engine refuses each one before admission, typed and marked retryable, and the
gateway tries another replica. Once the gRPC server stops, a call that arrives reaches no handler:
gRPC ends it CANCELLED, which does not say whether it ran, so nobody may retry it (a 503 while another
replica served). So the port stays open until no request has arrived for `QUIET_S`, at most
`MAX_LINGER_S` after the server reported NOT_SERVING; a server nobody called lately stops at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

QUIET_S = 1.5  # longer than the shipped gateway's health-check interval (1 s)
MAX_LINGER_S = 5.0  # a caller that never looks at health (or a gateway in panic mode) waits no longer
_POLL_S = 0.05


async def until_callers_stop(
    last_arrival_at: Callable[[], float | None], not_serving_since: float, cut: asyncio.Event | None = None
) -> None:
    """Return once no request arrived for `QUIET_S` (`last_arrival_at`: time.monotonic of the
    latest), `MAX_LINGER_S` after `not_serving_since`, or when `cut` is set (a second stop signal)."""
    deadline = not_serving_since + MAX_LINGER_S
    while time.monotonic() < deadline and not (cut is not None and cut.is_set()):
        arrived_at = last_arrival_at()
        if arrived_at is None or time.monotonic() - arrived_at >= QUIET_S:
            return
        await asyncio.sleep(_POLL_S)
