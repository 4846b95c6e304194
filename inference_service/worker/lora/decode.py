"""LoRA inside the decode plan (runner/decode_step.py): the plan runs its own projections and adds the
step's updates right after each one, instead of calling LoRA linears wrapped around them.

Why not wrap: a wrapper is a module call and a step lookup on every projection of every step, four
per layer, with or without an adapter in the step, and a wrapped projection is no longer the plain
module the bf16 one-call layer plan (runner/bf16_layers.py) checks for, so a LoRA-enabled engine ran
its base-only steps slower than the base engine. Here a step with no adapter row runs the plan exactly
as the base engine does; a step with one adds one kernel call per projection (fused q|k|v and gate|up
parts in one call), its arguments read once per step, and a one-row step (one stream) computes each
panelled projection and its update in a single call (StepAdder.project). An fp32 decode step whose
layers run in one native call (runner/fused_layers.py) takes the adder's plan into that call, which
makes the same kernel calls in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from inference_service.worker.linears.panelled import PanelledLinear
from inference_service.worker.lora import native
from inference_service.worker.lora.batch import LoraStep
from inference_service.worker.lora.linear import add_lora
from inference_service.worker.lora.native import NativeParts, NativePlan, parts_of, plan_of
from inference_service.worker.lora.weights import MLP_TARGETS, Site

# The decode plan's projections of a layer, in the order DecodeLora.layers keeps them.
QKV, O_PROJ, GATE_UP, DOWN = range(4)


@dataclass
class _Projection:
    """One of the plan's projections: its sites' columns (torch path) and the kernel's part table."""

    parts: list[tuple[Site, slice]]
    native: NativeParts
    in_features: int


def _projection(sites: list[tuple[Site, int]], in_features: int) -> _Projection:
    parts, start = [], 0
    for site, width in sites:
        parts.append((site, slice(start, start + width)))
        start += width
    return _Projection(parts, parts_of([(site, c.start, c.stop - c.start) for site, c in parts]), in_features)


class DecodeLora:
    """The LoRA sites of the decode plan's layers; `adder(step, hidden)` binds a step's groups."""

    def __init__(self, layer_indices: list[int], shapes: dict[Site, tuple[int, int]]):
        def sites(index: int, targets: tuple[str, ...]) -> list[tuple[Site, int]]:
            return [((index, t), shapes[(index, t)][1]) for t in targets]

        self.layers: list[list[_Projection]] = []
        for index in layer_indices:
            in_attn, in_down = shapes[(index, "q_proj")][0], shapes[(index, "down_proj")][0]
            self.layers.append(
                [
                    _projection(sites(index, ("q_proj", "k_proj", "v_proj")), in_attn),
                    _projection(sites(index, ("o_proj",)), shapes[(index, "o_proj")][0]),
                    _projection(sites(index, MLP_TARGETS[:2]), in_attn),
                    _projection(sites(index, ("down_proj",)), in_down),
                ]
            )
        self._all_in_multiple_of_8 = all(p.in_features % 8 == 0 for layer in self.layers for p in layer)

    def adder(self, step: LoraStep, hidden: torch.Tensor) -> StepAdder:
        """The step's adder: the native kernel's arguments bound once when the whole step can take it
        (fp32 on CPU, few enough rows), else the torch path per call."""
        plan = None
        if (
            hidden.dtype == torch.float32
            and hidden.device.type == "cpu"
            and hidden.shape[0] <= native.MAX_NATIVE_ROWS
            and self._all_in_multiple_of_8
        ):
            plan = plan_of(step, hidden)
        return StepAdder(self.layers, plan)


class StepAdder:
    """`project(module, x, layer, projection)`: the projection's output with the step's updates added;
    `add(x, y, layer, projection)`: y [T, out] += the step's updates of x [T, in] at that projection."""

    def __init__(self, layers: list[list[_Projection]], plan: NativePlan | None):
        self.layers = layers
        self.plan = plan  # keeps the tables the bound addresses point into alive
        self.native = plan is not None
        self._call: Any = None  # the kernel's ctypes function and the step's arguments after x, y's
        self._row: Any = None  # one row, one adapter: the fused kernel and the adapter's table
        if plan is not None:
            if plan.single is not None:
                self._row = (plan.kernel.panel_row_raw, plan.single.data_ptr(), plan.single.shape[0])
                self._call = (plan.kernel.bgmv_raw, False, (plan.single.data_ptr(), plan.single.shape[0]))
            else:
                rows = plan.rows.data_ptr() if plan.rows is not None else None
                args = (rows, plan.groups.data_ptr(), plan.groups.shape[0])
                self._call = (plan.kernel.sgmv_raw, True, args, plan.max_rank)

    def project(self, module: torch.nn.Module, x: torch.Tensor, layer: int, projection: int) -> torch.Tensor:
        """module(x) plus the step's updates. A one-row step over panelled fp32 weights (the plan
        checked fp32 on CPU) runs both in one kernel call, the update split over the threads with the
        base's columns (csrc/lora_sgmv.cpp lora_panel_row_f32); else the module, then `add`.
        Measured on the busy 2-core machine, demo model, one stream, rank 16 on all seven
        projections, 7 interleaved rounds of the main thread's CPU time per decode token with idle
        threads sleeping: module then `add` 1.10x the step without an adapter (median), this 0.96x
        (it also skips PanelledLinear's Python checks)."""
        row = self._row
        if row is not None and type(module) is PanelledLinear and module.kernel is not None and x.is_contiguous():
            panels, bias, parts = module.weight_panels, module.bias, self.layers[layer][projection].native
            y = torch.empty(1, module.out_features)
            status = row[0](
                x.data_ptr(),
                x.shape[1],
                panels.data_ptr(),
                None if bias is None else bias.data_ptr(),
                y.data_ptr(),
                module.out_features,
                row[1],
                row[2],
                parts.address,
                parts.count,
            )
            if status != 0:
                raise RuntimeError(f"LoRA kernel refused x {list(x.shape)} at layer {layer}")
            return y
        y = module(x)
        self.add(x, y, layer, projection)
        return y

    def add(self, x: torch.Tensor, y: torch.Tensor, layer: int, projection: int) -> None:
        proj = self.layers[layer][projection]
        call = self._call
        if call is None or not (x.is_contiguous() and y.is_contiguous()):
            add_lora(x, y, proj.parts, proj.native)
            return
        parts = proj.native
        if call[1]:  # sgmv: every group's rows
            status = call[0](
                x.data_ptr(), x.shape[1], y.data_ptr(), y.shape[1], *call[2], parts.address, parts.count, call[3]
            )
        else:  # bgmv: one row
            status = call[0](x.data_ptr(), x.shape[1], y.data_ptr(), *call[2], parts.address, parts.count)
        if status != 0:
            raise RuntimeError(f"LoRA kernel refused x {list(x.shape)} at layer {layer}")
