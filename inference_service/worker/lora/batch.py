"""A step's rows grouped by adapter (Punica's SGMV idea: one shrink and one expand per group),
handed to the LoRA linears through a contextvar as the attention metadata is."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from inference_service.worker.lora.weights import AdapterWeights, LoraTable


@dataclass
class LoraGroup:
    """The packed token rows of one adapter in this step."""

    adapter: AdapterWeights
    rows: torch.Tensor | None  # [n] long; None: every row of the step
    num_rows: int


@dataclass
class LoraStep:
    groups: list[LoraGroup]
    native: Any = None  # the native kernel's plan of these groups, made on first use (lora/native.py)


_STEP: contextvars.ContextVar[LoraStep | None] = contextvars.ContextVar("lora_step", default=None)


def current_step() -> LoraStep | None:
    return _STEP.get()


@contextlib.contextmanager
def lora_context(step: LoraStep | None) -> Iterator[None]:
    token = _STEP.set(step)
    try:
        yield
    finally:
        _STEP.reset(token)


def group_rows(
    table: LoraTable, spans: Sequence[tuple[str | None, int, int]], num_rows: int, device: torch.device
) -> LoraStep | None:
    """The step's groups from (adapter name or None, first packed row, row count) per request;
    None when no row uses an adapter (the base-only step does no LoRA work at all)."""
    rows_of: dict[str, list[int]] = {}
    for name, start, count in spans:
        if name is not None:
            rows_of.setdefault(name, []).extend(range(start, start + count))
    if not rows_of:
        return None
    groups = []
    for name, rows in rows_of.items():
        whole = len(rows) == num_rows  # one adapter for the whole step: no gather, no scatter
        index = None if whole else torch.tensor(rows, dtype=torch.long, device=device)
        groups.append(LoraGroup(table.get(name), index, len(rows)))
    return LoraStep(groups)
