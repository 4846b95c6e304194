"""The decode step's native SiLU·mul (csrc/decode_glue.cpp, a vectorised exp) is float64's silu · up
to a few ulp, on the vector body and the scalar tail alike, and stays finite at extreme gates."""

from __future__ import annotations

import pytest
import torch

from inference_service.worker.kernels import bindings as cpu_kernels


@pytest.fixture(scope="module")
def glue() -> cpu_kernels.DecodeGlue:
    built = cpu_kernels.load_decode_glue()
    assert built is not None, "the native kernels did not build (is a C++ compiler installed?)"
    return built


@pytest.mark.parametrize("width", [1, 8, 13, 1536])
@pytest.mark.parametrize("spread", [0.01, 1.0, 8.0, 40.0])
def test_silu_mul_equals_float64_math(glue, width, spread):
    generator = torch.Generator().manual_seed(width)
    gate_up = torch.randn(5, 2 * width, generator=generator) * spread
    gate, up = gate_up.double().split(width, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    out = glue.silu_mul(gate_up)
    assert out.shape == (5, width)
    assert ((out.double() - expected).abs() <= 1e-6 * expected.abs() + 1e-30).all()


def test_silu_mul_at_extreme_gates(glue):
    gate = torch.tensor([0.0, -0.0, 87.0, -87.0, 100.0, -100.0, 1e30, -1e30, 3.0, -3.0])
    out = glue.silu_mul(torch.cat([gate, torch.ones(10)])[None])[0]
    expected = torch.nn.functional.silu(gate.double())
    assert torch.isfinite(out).all()
    assert ((out.double() - expected).abs() <= 1e-6 * expected.abs() + 1e-30).all()
