"""The step's LoRA groups as the native kernel reads them (kernels/lora_bindings.py): each adapter's
table of sites made once, each step's groups made once, so a projection's update is one call.

The torch path in linear.py stays the reference and the fallback (bf16/fp16 or GPU tensors, no
compiler, `in` not a multiple of 8, and prefills of more rows than MAX_NATIVE_ROWS, where torch's
GEMMs win).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference_service.worker.kernels.lora_bindings import (
    MAX_RANK,
    LoraKernel,
    entry_table,
    group_table,
    load_lora_kernel,
    part_table,
)
from inference_service.worker.lora.batch import LoraStep
from inference_service.worker.lora.weights import TARGETS, AdapterWeights, Site

# Up to this many rows a step's updates go through the kernel. Measured per layer of the demo model's
# shapes (rank 16, all seven projections, 4 adapters, best of many calls on a busy 2-core CPU), torch
# path / kernel: 1 row 66/33 µs, 16 rows 587/140 µs, 256 rows 4.0/1.2 ms, 1024 rows 1.1 s/0.11 s (torch
# threaded, noisy); 16 rows of one adapter tie (132/129 µs: torch's path is one addmm there). Longer
# prefills were not measured, so they keep torch's GEMMs.
MAX_NATIVE_ROWS = 1024


def site_index(site: Site) -> int:
    layer, target = site
    return layer * len(TARGETS) + TARGETS.index(target)


class NativeParts:
    """A projection's parts for the kernel, (site, first column, width) each, with the table's address
    read once: a decode step makes 4 calls per layer, and each saved attribute read counts."""

    def __init__(self, parts: list[tuple[Site, int, int]]):
        self.table = part_table([(site_index(site), start, width) for site, start, width in parts])
        self.address: int = self.table.data_ptr()
        self.count: int = self.table.shape[0]


def parts_of(parts: list[tuple[Site, int, int]]) -> NativeParts:
    """A projection's parts for the kernel: (site, first column, width) each."""
    return NativeParts(parts)


@dataclass
class NativePlan:
    """A step's groups as the kernel takes them, made once per step and used by its every call."""

    kernel: LoraKernel
    rows: torch.Tensor | None  # the step row of each position the groups name; None: position = row
    groups: torch.Tensor  # [G, 4] kernel Groups
    max_rank: int
    single: torch.Tensor | None  # the one adapter's table when the step is one row (BGMV)

    def add(self, x2: torch.Tensor, y2: torch.Tensor, parts: NativeParts) -> None:
        if self.single is not None:
            self.kernel.bgmv(x2, y2, self.single, parts.address, parts.count)
        else:
            self.kernel.sgmv(x2, y2, self.rows, self.groups, parts.address, parts.count, self.max_rank)


def adapter_table(adapter: AdapterWeights) -> torch.Tensor:
    """The adapter's kernel table (one entry per site, made on first use and kept with it)."""
    if adapter.native_table is None:
        keep: list[torch.Tensor] = []
        num_sites = 1 + max((site_index(site) for site in adapter.pairs), default=-1)
        entries: list[tuple[torch.Tensor, torch.Tensor, float] | None] = [None] * num_sites
        for site, pair in adapter.pairs.items():
            a_rows = pair.a.t().contiguous()  # [rank, in]: a view of the stored A when it is kept so
            b = pair.b.contiguous()
            keep += [a_rows, b]  # the table points into these
            entries[site_index(site)] = (a_rows, b, 1.0)  # the scale is folded into b
        adapter.native_table = (entry_table(entries), keep)
    return adapter.native_table[0]


def plan_of(step: LoraStep, x2: torch.Tensor) -> NativePlan | None:
    """The step's plan (made on its first call, from that call's x [T, in]); None when the kernel
    cannot take the step (no kernel, not on CPU, a rank over its bound)."""
    if step.native is None:
        step.native = _make_plan(step, x2) or False
    return step.native or None


def _make_plan(step: LoraStep, x2: torch.Tensor) -> NativePlan | None:
    kernel = load_lora_kernel() if x2.device.type == "cpu" else None
    max_rank = max(group.adapter.rank for group in step.groups)
    if kernel is None or max_rank > MAX_RANK or any(g.adapter.pairs and g.adapter.rank < 1 for g in step.groups):
        return None
    num_rows = x2.shape[0]
    tables = [adapter_table(group.adapter) for group in step.groups]
    if len(step.groups) == 1 and step.groups[0].rows is None:
        single = tables[0] if num_rows == 1 else None
        return NativePlan(kernel, None, group_table([(tables[0], 0, num_rows)]), max_rank, single)
    rows, spans, start = [], [], 0
    for group, table in zip(step.groups, tables, strict=True):
        assert group.rows is not None  # several groups: each names its rows
        rows.append(group.rows.to(torch.int64))
        spans.append((table, start, start + group.num_rows))
        start += group.num_rows
    return NativePlan(kernel, torch.cat(rows).contiguous(), group_table(spans), max_rank, None)


def add_native(x2: torch.Tensor, y2: torch.Tensor, step: LoraStep, parts: NativeParts) -> bool:
    """y2 [T, out] += the step's updates of x2 [T, in] over `parts`, in one kernel call; False (nothing
    done) where the kernel does not apply and the torch path must run."""
    if x2.shape[0] > MAX_NATIVE_ROWS or not LoraKernel.supports(x2, y2):
        return False
    plan = step.native if step.native is not None else plan_of(step, x2)
    if not plan:
        return False
    plan.add(x2, y2, parts)
    return True
