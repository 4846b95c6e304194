"""The packed-weight linear kernel computes x · dequantize()ᵀ + b as float64 math does, and QuantLinear
gives the same result on every path (native kernel, native dequantize + GEMM, torch only).

Shapes cover the kernel's register blocking (1–8 rows, more in blocks of 8), output sizes that are
not multiples of its row blocks, both chunk widths of 4-bit codes (group sizes a multiple of 16, and
of 8 only), K with a partial last group and a partial last chunk (odd K: a half-used last byte), one
group over all of K, and extreme scales and codes.
"""

from __future__ import annotations

import pytest
import torch

from inference_service.worker.kernels import bindings as cpu_kernels
from inference_service.worker.kernels.packed import PackedWeight, pack_codes, quantize_rtn
from inference_service.worker.linears import quant as quant_linear
from inference_service.worker.linears.quant import QuantLinear, dequantized_linear

TOLERANCE = 1e-5  # relative to the output's magnitude


@pytest.fixture(scope="module")
def kernel() -> cpu_kernels.QuantLinearKernel:
    built = cpu_kernels.load_quant_linear()
    if built is None:
        pytest.skip("the native kernels did not build (no C++ compiler)")
    return built


def reference(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ packed.dequantize().double().T
    return out + bias.double() if bias is not None else out


def assert_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.shape == expected.shape and out.dtype == torch.float32
    scale = expected.abs().max().item() + 1.0
    assert (out.double() - expected).abs().max().item() <= TOLERANCE * scale


def random_packed(n: int, k: int, bits: int, group_size: int, seed: int) -> PackedWeight:
    generator = torch.Generator().manual_seed(seed)
    return quantize_rtn(torch.randn(n, k, generator=generator), bits, group_size)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    ("k", "group_size"),
    [
        (64, 16),
        (576, 32),
        (256, 128),
        (576, 576),
        (100, 32),
        (99, 16),
        (48, 24),
        (40, 8),
        (72, 72),
        (101, 101),
        (7, 7),
        (1536, 64),
    ],
)
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_kernel_equals_float64_math(kernel, bits, k, group_size, rows):
    packed = random_packed(37, k, bits, group_size, seed=bits * 1000 + k + group_size)
    assert kernel.supports(packed)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(37)
    assert_close(kernel(x, packed, None), reference(x, packed, None))
    assert_close(kernel(x, packed, bias), reference(x, packed, bias))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [*range(1, 34), 100])
def test_every_row_count(kernel, bits, rows):
    packed = random_packed(70, 96, bits, 32, seed=rows)  # 70 outputs: blocks of 4 and 2 with a remainder
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(70)
    assert_close(kernel(x, packed, bias), reference(x, packed, bias))


def test_threaded_large_output(kernel):
    packed = random_packed(3000, 576, 4, 32, seed=1)  # above the kernel's threading threshold
    x = torch.randn(5, 576)
    assert_close(kernel(x, packed, None), reference(x, packed, None))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("case", ["zero_scales", "tiny_scales", "huge_scales", "zero_codes", "max_codes"])
def test_extreme_values(kernel, bits, case):
    n, k, group_size = 19, 99, 16
    generator = torch.Generator().manual_seed(7)
    top = 2**bits - 1
    codes = torch.randint(0, top + 1, (n, k), generator=generator, dtype=torch.uint8)
    scales = torch.rand(n, 7, generator=generator) + 0.5
    offsets = torch.randn(n, 7, generator=generator)
    if case == "zero_scales":
        scales.zero_()
    elif case == "tiny_scales":
        scales *= 1e-30
    elif case == "huge_scales":
        scales *= 1e30
    elif case == "zero_codes":
        codes.zero_()
    else:
        codes.fill_(top)
    packed = PackedWeight(bits, pack_codes(codes, bits), scales, offsets, group_size, k)
    x = torch.randn(4, k, generator=generator)
    assert_close(kernel(x, packed, None), reference(x, packed, None))


def test_leading_dimensions_strided_input_and_zero_rows(kernel):
    packed = random_packed(40, 64, 4, 32, seed=3)
    x = torch.randn(1, 3, 128)[..., ::2]  # [1, 3, 64], not contiguous
    out = kernel(x, packed, None)
    assert out.shape == (1, 3, 40)
    assert_close(out.view(3, 40), reference(x.reshape(3, 64), packed, None))
    assert kernel(torch.randn(1, 0, 64), packed, None).shape == (1, 0, 40)


def test_unsupported_group_sizes_are_refused_and_still_computed(kernel):
    packed = random_packed(9, 40, 4, 12, seed=4)  # groups of 12: chunks of 8 would straddle them
    assert not kernel.supports(packed)
    module = QuantLinear.from_packed(packed)
    x = torch.randn(2, 40)
    assert_close(module(x), reference(x, packed, None))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [16, 32, 99, 5])
def test_native_dequantize_equals_reference(kernel, bits, group_size):
    packed = random_packed(23, 99, bits, group_size, seed=group_size)
    assert torch.allclose(kernel.dequantize(packed), packed.dequantize(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 7, 9, 17, 100])
def test_all_paths_agree(kernel, monkeypatch, bits, rows):
    """Kernel (few rows), panel GEMM (many rows), native dequantize + GEMM (in slices), torch only: one
    answer."""
    monkeypatch.setattr(quant_linear, "DEQUANT_SLICE_ELEMENTS", 1000)  # several slices of output rows
    packed = random_packed(50, 100, bits, 32, seed=rows)
    bias = torch.randn(50)
    x = torch.randn(rows, 100)
    expected = reference(x, packed, bias)
    with torch.no_grad():
        assert_close(QuantLinear.from_packed(packed, bias)(x), expected)
    assert_close(cpu_kernels.load_panel_linear().quant(x, packed, bias), expected)
    assert_close(dequantized_linear(x, packed, bias, kernel), expected)
    assert_close(dequantized_linear(x, packed, bias), expected)


def test_switched_off_uses_torch(kernel, monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "off")
    packed = random_packed(30, 64, 4, 32, seed=5)
    module = QuantLinear.from_packed(packed)
    x = torch.randn(2, 64)
    with torch.no_grad():
        assert_close(module(x), reference(x, packed, None))
    assert module._native_kernels() == (None, False, None, None)


def test_input_perm(kernel):
    packed = random_packed(24, 64, 4, 16, seed=6)
    perm = torch.randperm(64)
    module = QuantLinear.from_packed(packed, input_perm=perm)
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert_close(module(x), reference(x[:, perm], packed, None))


def test_module_buffers_repr_and_moves(kernel):
    packed = random_packed(16, 32, 8, 32, seed=8)
    module = QuantLinear.from_packed(packed, torch.zeros(16))
    names = {name for name, _ in module.named_buffers()}
    assert names == {"codes", "scales", "offsets", "bias"}
    assert module.packed.codes is module.codes and module.packed.bits == 8
    assert "bits=8" in repr(module) and "group_size=32" in repr(module)
    assert set(module.state_dict()) == names
    moved = module.to(torch.bfloat16)  # the bias follows; scales and offsets stay fp32 (no precision lost)
    assert moved.scales.dtype == moved.offsets.dtype == torch.float32 and moved.bias.dtype == torch.bfloat16
    assert torch.equal(moved.scales, packed.scales)
    x = torch.randn(2, 32)
    with torch.no_grad():
        assert moved(x.bfloat16()).dtype == torch.bfloat16
        assert_close(moved(x), reference(x, packed, None))  # fp32 input, bf16 bias: the torch path


@pytest.mark.parametrize(
    ("k", "group_size"),
    [(32, 32), (33, 32), (95, 32), (160, 64), (200, 128), (31, 31), (63, 64), (576, 128), (1000, 32)],
)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9])
def test_4bit_groups_of_32_and_more(kernel, k, group_size, rows):
    """The 16-lane path's shapes (AVX-512: 4-bit, groups a multiple of 32 or one group): a partial last
    chunk and group, K under one chunk, every register blocking, output rows not a multiple of it."""
    packed = random_packed(45, k, 4, group_size, seed=k * 7 + group_size + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k + rows))
    bias = torch.randn(45)
    assert_close(kernel(x, packed, bias), reference(x, packed, bias))


def test_4bit_offsets_large_against_scales(kernel):
    """The offsets multiply each group's sum of x apart from the codes: still float64's result when
    they dominate the weights (GGUF Q4_1's min is often the larger term)."""
    n, k, group_size = 33, 256, 32
    generator = torch.Generator().manual_seed(11)
    codes = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8)
    scales = torch.rand(n, k // group_size, generator=generator) * 1e-3
    offsets = torch.randn(n, k // group_size, generator=generator) * 10
    packed = PackedWeight(4, pack_codes(codes, 4), scales, offsets, group_size, k)
    x = torch.randn(3, k, generator=generator)
    assert_close(kernel(x, packed, None), reference(x, packed, None))
