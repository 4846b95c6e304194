"""Heartbeats on idle streams: TGI writes an SSE comment after 15 s without an event, so proxies
and clients with idle timeouts keep a queued or slowly prefilling stream open.

The REST gateway asks for them with the KEEPALIVE_KEY header (seconds); the servicer then sends
a `StreamResponse(keep_alive=true)` whenever that long passes without output, and the gateway
turns it into the comment. gRPC callers that don't ask never see one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

import grpc

KEEPALIVE_KEY = "x-textgen-keepalive-s"

T = TypeVar("T")


def requested_interval(context: grpc.aio.ServicerContext) -> float | None:
    """Seconds between heartbeats the caller asked for; None when it did not (or asked nonsense)."""
    for key, value in context.invocation_metadata() or ():
        if key == KEEPALIVE_KEY:
            with contextlib.suppress(ValueError):
                seconds = float(value)
                if seconds > 0:
                    return seconds
    return None


async def with_keepalives(source: AsyncIterator[T], interval_s: float | None) -> AsyncIterator[T | None]:
    """The items of `source`, and None each time `interval_s` passes without one (never if None).

    The next item is awaited in a task that outlives a heartbeat, so no item is lost to a timeout;
    when this generator is closed early, that task is cancelled, which closes `source` the same way
    a cancelled caller would have.
    """
    if interval_s is None:
        async for item in source:
            yield item
        return
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(source))
            done, _ = await asyncio.wait((pending,), timeout=interval_s)
            if not done:
                yield None
                continue
            finished, pending = pending, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.wait((pending,))  # let `source` run its cleanup (abort the request)
