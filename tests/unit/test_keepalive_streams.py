"""`with_keepalives`: heartbeats in idle gaps, every item kept in order, errors and early closes
passed through to the source."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from inference_service.api.keepalive import with_keepalives

GAP = 0.2  # a source pause several heartbeat intervals long
INTERVAL = 0.04


class Source:
    """Yields `items`, pausing before those listed in `pauses`; records whether it was closed early."""

    def __init__(self, items, pauses=(), error: Exception | None = None):
        self.items, self.pauses, self.error = items, set(pauses), error
        self.cleaned_up = False

    async def __call__(self):
        try:
            for index, item in enumerate(self.items):
                if index in self.pauses:
                    await asyncio.sleep(GAP)
                yield item
            if self.error is not None:
                raise self.error
        finally:
            self.cleaned_up = True


async def collect(iterator) -> list:
    return [item async for item in iterator]


async def test_heartbeats_fill_the_gaps_and_items_keep_their_order():
    events = await collect(with_keepalives(Source([1, 2, 3], pauses=[0, 2])(), INTERVAL))
    assert [e for e in events if e is not None] == [1, 2, 3]
    first_gap, second_gap = events[: events.index(1)], events[events.index(2) + 1 : events.index(3)]
    assert len(first_gap) >= 2 and set(first_gap) == {None}
    assert len(second_gap) >= 2 and set(second_gap) == {None}
    assert None not in events[events.index(1) : events.index(2) + 1]  # no pause, no heartbeat


async def test_without_an_interval_the_source_passes_through():
    assert await collect(with_keepalives(Source([1, 2], pauses=[1])(), None)) == [1, 2]


async def test_a_source_error_reaches_the_caller():
    with pytest.raises(KeyError):
        await collect(with_keepalives(Source([1], pauses=[0], error=KeyError("boom"))(), INTERVAL))


async def test_closing_early_cancels_the_waiting_source_and_runs_its_cleanup():
    source = Source([1, 2], pauses=[1])
    async with contextlib.aclosing(with_keepalives(source(), INTERVAL)) as events:
        assert await anext(events) == 1
        assert await anext(events) is None  # the source is now blocked in its pause
    assert source.cleaned_up
