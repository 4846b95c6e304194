"""Progress a person can follow while a model gets ready: a bar per phase, one summary line each.

Every slow phase (downloading, converting a GGUF file, loading weights, checking the model, building
kernels, warming up) runs inside `phase(...)`: it draws a tqdm bar on stderr while a person watches
(stdout and stderr are terminals and logs are text, not `--json-output`), and always logs one line
with the time it took ("loaded weights in 12.3s"). Without a terminal, or with JSON logs, no bar is
drawn, and the hub's and transformers' own bars are off too.

Imports nothing heavy (tqdm only when a bar is drawn), so every layer can use it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

logger = logging.getLogger("inference_service.progress")

T = TypeVar("T")

# Test-only: hold one phase this many seconds, e.g. "warming up=30", so a test can signal the
# process while it is in that phase. The wait runs torch ops (where a signal used to abort the
# process at exit); unset in any real deployment.
TEST_DELAY_ENV = "INFERENCE_SERVICE_TEST_PHASE_DELAY"

_json_logs = False


def configure(json_logs: bool) -> None:
    """Called when logging is set up: JSON logs never get bars, nor do logs that are not a terminal."""
    global _json_logs
    _json_logs = json_logs
    if not bars_enabled():  # read when the hub and transformers are imported, which is later
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"


def bars_enabled() -> bool:
    """A person watches: text logs, stdout and stderr both terminals."""
    return not _json_logs and _is_terminal(sys.stdout) and _is_terminal(sys.stderr)


def _is_terminal(stream: Any) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


class Phase:
    """The running phase: `update()` its bar, `track()` an iterable through it."""

    def __init__(self, bar: Any):
        self._bar = bar

    def update(self, steps: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(steps)

    def track(self, items: Iterable[T]) -> Iterator[T]:
        """`items`, one step each (the bar's total becomes their number when it has none)."""
        if self._bar is not None and self._bar.total is None and hasattr(items, "__len__"):
            self._bar.total = len(items)  # type: ignore[arg-type]
            self._bar.refresh()
        for item in items:
            yield item
            self.update()


@contextlib.contextmanager
def phase(title: str, done: str, total: int | None = None, unit: str = "step", bar: bool = True) -> Iterator[Phase]:
    """Run one phase: `title` labels its bar ("loading weights"), `done` starts its summary line
    ("loaded weights" → "loaded weights in 1.2s"). `bar=False` where a tool draws its own (pip)."""
    logger.debug("%s", title)
    _test_delay(title)
    started = time.monotonic()
    drawn = None
    if bar and bars_enabled():
        from tqdm import tqdm

        drawn = tqdm(total=total, desc=title, unit=unit, leave=False, file=sys.stderr, dynamic_ncols=True)
    try:
        yield Phase(drawn)
    finally:
        if drawn is not None:
            drawn.close()
    logger.info("%s in %.1fs", done, time.monotonic() - started)


@contextlib.contextmanager
def library_bars_off() -> Iterator[None]:
    """Turn transformers' own bars off (its "Loading weights" bar is instant, then says nothing of
    what takes the time): our phases draw the bars."""
    from transformers.utils import logging as hf_logging

    were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if were_on:
            hf_logging.enable_progress_bar()


def _test_delay(title: str) -> None:
    name, _, seconds = os.environ.get(TEST_DELAY_ENV, "").partition("=")
    if not name or name != title:
        return
    import torch

    deadline = time.monotonic() + float(seconds)
    a = torch.ones(256, 256)
    while time.monotonic() < deadline:
        a = torch.mm(a, a).clamp_(max=1.0)
