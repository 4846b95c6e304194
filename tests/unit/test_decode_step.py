"""Fused projections of the decode step: one module over one copy of the weights.

Fusing q/k/v (or gate/up) must give each module's output side by side, bitwise, for fp32 (plain
and native few-row linears) and packed 4/8-bit weights; the modules themselves must keep
computing what they did, now over row slices of the fused storage (nothing stored twice).
Projections that can't share one packed matrix (GPTQ's per-module input order) are still
computed, one by one.
"""

from __future__ import annotations

import pytest
import torch

from inference_service.worker.kernels import bindings as cpu_kernels
from inference_service.worker.kernels.packed import quantize_rtn
from inference_service.worker.linears import native as native_linear
from inference_service.worker.linears.quant import QuantLinear
from inference_service.worker.runner.fused_projections import fuse_projections

IN_FEATURES = 64
OUT_FEATURES = (64, 32, 32)  # q, k, v of a GQA layer


def _linears(bias: bool) -> list[torch.nn.Linear]:
    torch.manual_seed(0)
    return [torch.nn.Linear(IN_FEATURES, n, bias=bias).requires_grad_(False) for n in OUT_FEATURES]


def _quant_linears(bits: int, group_size: int, bias: bool) -> list[QuantLinear]:
    return [QuantLinear(quantize_rtn(m.weight, bits=bits, group_size=group_size), m.bias) for m in _linears(bias)]


def _check_fused(modules: list[torch.nn.Module], rows: int) -> torch.nn.Module:
    x = torch.randn(rows, IN_FEATURES, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        before = [m(x) for m in modules]
        fused = fuse_projections(modules)
        after = [m(x) for m in modules]
        together = fused(x)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), "a module changed its output"
    assert torch.equal(together, torch.cat(before, dim=-1)), "the fused output is not the outputs side by side"
    return fused


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_projections_fuse_into_one_matrix_the_modules_share(rows, native, bias):
    modules = _linears(bias)
    if native:
        for module in modules:
            native_linear.install(module, cpu_kernels.load_small_batch_linear())
    fused = _check_fused(modules, rows)
    assert type(fused) is type(modules[0])
    start = fused.weight.data_ptr()
    offsets = [m.weight.data_ptr() - start for m in modules]
    assert offsets == [0, 64 * IN_FEATURES * 4, 96 * IN_FEATURES * 4], "modules do not point into the fused weight"
    assert all(m.weight.is_contiguous() for m in modules)


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize(("bits", "group_size"), [(4, 32), (8, 32), (8, IN_FEATURES), (4, 24)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_projections_fuse_into_one_packed_matrix(rows, bits, group_size, bias):
    modules = _quant_linears(bits, group_size, bias)
    fused = _check_fused(modules, rows)
    assert isinstance(fused, QuantLinear) and fused.out_features == sum(OUT_FEATURES)
    assert all(m.panelled == (bits == 8) for m in [*modules, fused])  # 8-bit codes in panels of 32 rows
    row_bytes = fused.codes.numel() // fused.out_features
    start = fused.codes.data_ptr()
    assert [m.codes.data_ptr() - start for m in modules] == [0, 64 * row_bytes, 96 * row_bytes]
    assert all(m.codes.is_contiguous() and m.scales.is_contiguous() for m in modules)


def test_projections_with_their_own_input_order_run_one_by_one():
    modules = _quant_linears(4, 32, bias=False)
    modules[1].input_perm = torch.randperm(IN_FEATURES, generator=torch.Generator().manual_seed(2))
    fused = _check_fused(modules, rows=3)
    assert not isinstance(fused, QuantLinear)
