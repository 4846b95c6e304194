"""When a stopping server closes its port: once requests stopped arriving for QUIET_S, at once when
none came lately, never past MAX_LINGER_S, at once on a second stop signal."""

from __future__ import annotations

import asyncio
import time

from inference_service.api import linger


def _linger_s(last_arrival_at: float | None, not_serving_since: float, cut: bool = False) -> float:
    async def run() -> float:
        stop_now = asyncio.Event()
        if cut:
            stop_now.set()
        started = time.monotonic()
        await linger.until_callers_stop(lambda: last_arrival_at, not_serving_since, stop_now)
        return time.monotonic() - started

    return asyncio.run(run())


def test_a_server_nobody_called_lately_stops_at_once():
    now = time.monotonic()
    assert _linger_s(None, now) < linger.QUIET_S / 2
    assert _linger_s(now - linger.QUIET_S, now) < linger.QUIET_S / 2


def test_a_server_called_just_now_waits_until_the_quiet_has_lasted():
    now = time.monotonic()
    waited = _linger_s(now - 0.5, now)
    assert linger.QUIET_S - 0.5 - 0.1 <= waited < linger.QUIET_S + 1


def test_no_longer_than_the_cap_after_not_serving_nor_after_a_second_signal():
    now = time.monotonic()
    assert _linger_s(now, now - linger.MAX_LINGER_S + 0.2) < linger.QUIET_S / 2  # the cap comes first
    assert _linger_s(now, now, cut=True) < linger.QUIET_S / 2
