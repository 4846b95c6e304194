"""A forward pass that may give way between decoder layers.

The engine runs a step whose rows nobody waits on (a lone long prompt's chunk) inside
`yielding(check)`; the paged attention function calls `poll` at the start of every layer, and once
`check` (given the part of the layers done) says so, the pass ends with `StepYielded`. What the pass
wrote so far is K/V of slots the scheduler does not count as computed: the chunk runs again later
and writes them again. A runner whose pass must run whole (tensor-parallel shard 0: the other
shards wait for it in collectives) runs it under `never()`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

_CHECK: contextvars.ContextVar[Callable[[float], bool] | None] = contextvars.ContextVar("step_yield", default=None)


class StepYielded(Exception):
    """The forward pass stopped between two layers: nothing it computed counts."""


@contextlib.contextmanager
def yielding(check: Callable[[float], bool]) -> Iterator[None]:
    """Forward passes run in this context stop at the first layer where `check(done)` is True
    (`done`: the part of the layers already run, 0 at the first)."""
    token = _CHECK.set(check)
    try:
        yield
    finally:
        _CHECK.reset(token)


@contextlib.contextmanager
def never() -> Iterator[None]:
    """Forward passes run in this context run whole, whoever asked for a yielding one."""
    token = _CHECK.set(None)
    try:
        yield
    finally:
        _CHECK.reset(token)


def poll(layer: int, num_layers: int) -> None:
    """Called at the start of each layer: raise `StepYielded` if the step is to give way here."""
    check = _CHECK.get()
    if check is not None and check(layer / num_layers):
        raise StepYielded(f"the step gave way before layer {layer}")
