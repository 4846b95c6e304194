"""Fusing a decoder layer's projections (q|k|v, gate|up) into one module over one copy of their weights,
for the decode plan (runner/decode_step.py): one matrix multiply where there were two or three."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol, TypeVar, cast

import torch

from inference_service.worker.kernels import panels
from inference_service.worker.kernels.packed import PackedWeight
from inference_service.worker.linears import bf16, native
from inference_service.worker.linears.bf16 import BF16NativeLinear
from inference_service.worker.linears.native import NativeLinear
from inference_service.worker.linears.panelled import PanelledLinear
from inference_service.worker.linears.quant import QuantLinear


def fuse_projections(modules: list[torch.nn.Module]) -> torch.nn.Module:
    """One module computing the modules' outputs side by side, from one copy of their weights.

    The weights are concatenated along the output rows and each module is re-pointed at its row
    slice (contiguous, so its kernels still take it). Modules that can't be fused this way (mixed
    kinds, biases on some only, GPTQ's per-module input orders) are returned as a module that calls
    each in turn.
    """
    if len({m.bias is None for m in modules}) == 1:
        # The checks establish the modules' class; the casts tell the type checker.
        if all(type(m) is type(modules[0]) for m in modules) and all(_plain_linear(m) for m in modules):
            return _fuse_linears(cast(list[torch.nn.Linear], modules))
        if all(isinstance(m, QuantLinear) for m in modules) and _same_packing(cast(list[QuantLinear], modules)):
            return _fuse_quant_linears(cast(list[QuantLinear], modules))
        if all(type(m) is PanelledLinear for m in modules):
            return _fuse_panelled_linears(cast(list[PanelledLinear], modules))
    return _Concatenated(modules)


def _plain_linear(module: torch.nn.Module) -> bool:
    """nn.Linear itself or our NativeLinear / BF16NativeLinear: not a library's subclass with its own
    weight format (bitsandbytes' int8 and 4-bit layers)."""
    plain = type(module) in (torch.nn.Linear, NativeLinear, BF16NativeLinear)
    return plain and cast(torch.nn.Linear, module).weight.is_contiguous()


def _same_packing(modules: list[QuantLinear]) -> bool:
    first = modules[0]
    return all(
        m.input_perm is None
        and (m.bits, m.group_size, m.in_features, m.panelled)
        == (first.bits, first.group_size, first.in_features, first.panelled)
        for m in modules
    )


class _HasOutputRows(Protocol):
    out_features: int


_M = TypeVar("_M", bound=_HasOutputRows)


def _row_slices(
    modules: Sequence[_M], fused: torch.Tensor, rows_per_entry: int = 1
) -> Iterator[tuple[_M, torch.Tensor]]:
    """(module, its share of `fused`), for tensors concatenated in the modules' order along a first
    dimension whose entries hold `rows_per_entry` output rows each."""
    start = 0
    for module in modules:
        length = module.out_features // rows_per_entry
        yield module, fused[start : start + length]
        start += length


def _fuse_linears(modules: list[torch.nn.Linear]) -> torch.nn.Module:
    weight = torch.cat([m.weight.detach() for m in modules])
    bias = torch.cat([m.bias.detach() for m in modules]) if modules[0].bias is not None else None
    fused = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    fused.__class__ = type(modules[0])  # NativeLinear and BF16NativeLinear keep their kernels
    kernels = native.KERNELS + bf16.KERNELS
    fused.__dict__.update({k: v for k, v in modules[0].__dict__.items() if k in kernels})
    fused.weight = torch.nn.Parameter(weight, requires_grad=False)
    fused.bias = torch.nn.Parameter(bias, requires_grad=False) if bias is not None else None
    for module, rows in _row_slices(modules, weight):
        module.weight = torch.nn.Parameter(rows, requires_grad=False)
    if bias is not None:
        for module, rows in _row_slices(modules, bias):
            module.bias = torch.nn.Parameter(rows, requires_grad=False)
    return fused


def _fuse_panelled_linears(modules: list[PanelledLinear]) -> PanelledLinear:
    """Panels concatenate panel after panel: each module's share is a run of whole panels."""
    first = modules[0]
    # fuse_projections fuses only modules that all have a bias or all have none
    bias = torch.cat([cast(torch.Tensor, m.bias) for m in modules]) if first.bias is not None else None
    fused = PanelledLinear(torch.cat([m.weight_panels for m in modules]), bias, first.kernel)
    _repoint_at_shares(modules, fused, ("weight_panels",), panels.PANEL)
    return fused


def _fuse_quant_linears(modules: list[QuantLinear]) -> QuantLinear:
    """The fused module holds the one copy, in the modules' layout (panelled: every module's rows
    fill panels, so each one's share is a run of whole panels)."""
    first = modules[0]
    packed = [m.packed for m in modules]
    parts = {name: torch.cat([getattr(p, name) for p in packed]) for name in ("codes", "scales", "offsets")}
    # fuse_projections fuses only modules that all have a bias or all have none
    bias = torch.cat([cast(torch.Tensor, m.bias) for m in modules]) if first.bias is not None else None
    fused = QuantLinear(
        PackedWeight(
            first.bits, parts["codes"], parts["scales"], parts["offsets"], first.group_size, first.in_features
        ),
        bias,
        panelled=first.panelled,
    )
    _repoint_at_shares(modules, fused, tuple(parts), first.rows_per_entry)
    return fused


def _repoint_at_shares(
    modules: Sequence[PanelledLinear | QuantLinear],
    fused: PanelledLinear | QuantLinear,
    names: tuple[str, ...],
    rows_per_entry: int,
) -> None:
    """Re-point each module at its share of the fused module's buffers `names` and bias."""
    shares: dict[PanelledLinear | QuantLinear, dict[str, torch.Tensor]] = {m: {} for m in modules}
    for name in names:
        for module, entries in _row_slices(modules, getattr(fused, name), rows_per_entry):
            shares[module][name] = entries
    if fused.bias is not None:
        for module, rows in _row_slices(modules, fused.bias):
            shares[module]["bias"] = rows
    for module, buffers in shares.items():
        module.repoint(**buffers)


class _Concatenated(torch.nn.Module):
    """The modules' outputs side by side, each module called on its own."""

    def __init__(self, modules: list[torch.nn.Module]):
        super().__init__()
        self.parts = modules

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([m(x) for m in self.parts], dim=-1)
