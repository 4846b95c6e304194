"""The native bf16 linear (bf16 weights and inputs, fp32 accumulation) computes x·Wᵀ + b as float64
math does, rounded once to bf16, on both of its paths (AVX512-BF16 dot products where the build has
them, and the portable widen-to-fp32 path, built here on purpose), and swaps into a bf16 model.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest
import torch
from tiny_models import tiny_config, tiny_model

from inference_service.worker.kernels import bindings as cpu_kernels
from inference_service.worker.linears import bf16 as bf16_linear

# fp32 sums of exact bf16 products, rounded to bf16 once: within one bf16 ulp (2^-8 relative) of
# the float64 result, plus fp32 rounding of the sums (relative to the sum of |terms|).
BF16_ULP = 2.0**-8


def _portable_kernel(tmp_path_factory) -> cpu_kernels.BF16Linear:
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.fail("no C++ compiler: the native kernels need one")
    folder = tmp_path_factory.mktemp("bf16-portable")
    library = folder / "bf16_portable.so"
    source = cpu_kernels.CSRC / "bf16_linear.cpp"
    subprocess.run(
        [
            compiler,
            *cpu_kernels.COMPILE_FLAGS,
            *cpu_kernels.LINK_FLAGS,
            "-DBF16_PORTABLE",
            str(source),
            "-o",
            str(library),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return cpu_kernels.BF16Linear(ctypes.CDLL(str(library)))


@pytest.fixture(scope="module", params=["built", "portable"])
def kernel(request, tmp_path_factory) -> cpu_kernels.BF16Linear:
    if request.param == "portable":
        built = _portable_kernel(tmp_path_factory)
        assert not built.uses_dot_product
        return built
    built = cpu_kernels.load_bf16_linear()
    assert built is not None, "the native kernels did not build (is a C++ compiler installed?)"
    return built


def _bf16(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).bfloat16()


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17, cpu_kernels.MAX_BF16_LINEAR_ROWS])
# 4000 x 576 and 3 x 512: one row of x reads W row after row (whole 128-wide steps only at 512), and
# is split across threads (over the kernel's threading threshold).
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(1, 8), (13, 72), (200, 576), (70, 1544), (3, 512), (4000, 576)]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_equals_float64_math_rounded_to_bf16(kernel, rows, out_features, in_features, with_bias):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x, weight = _bf16(rows, in_features, generator=generator), _bf16(out_features, in_features, generator=generator)
    bias = _bf16(out_features, generator=generator) if with_bias else None
    assert kernel.supports_weight(weight)
    out = kernel(x, weight, bias)
    assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
    expected = x.double() @ weight.double().T + (bias.double() if with_bias else 0)
    magnitude = x.double().abs() @ weight.double().abs().T + (bias.double().abs() if with_bias else 0)
    error = (out.double() - expected).abs()
    assert (error <= BF16_ULP * expected.abs() + 1e-6 * magnitude + 1e-30).all()


def test_rounding_is_to_nearest_even_and_nan_stays_nan(kernel):
    # One input row of ones against weight rows whose sums land between two bf16 values.
    x = torch.zeros(1, 8, dtype=torch.bfloat16)
    x[0, 0] = 1.0
    weight = torch.zeros(3, 8, dtype=torch.bfloat16)
    weight[:, 0] = torch.tensor([1.0, 1.0, float("nan")])
    bias = torch.tensor([2.0**-8, 3 * 2.0**-8, 0.0]).bfloat16()  # 1 + half an ulp: ties to even
    out = kernel(x, weight, bias).float()
    assert out[0, 0].item() == 1.0 and out[0, 1].item() == 1.0 + 2.0**-6 and out[0, 2].isnan()


def test_weights_the_kernel_cannot_read_are_refused(kernel):
    assert not kernel.supports_weight(torch.randn(8, 12).bfloat16())  # in_features not a multiple of 8
    assert not kernel.supports_weight(torch.randn(16, 8).bfloat16().T)  # not contiguous
    assert not kernel.supports_weight(torch.randn(8, 16))  # fp32


def test_the_build_uses_the_dot_product_where_the_cpu_has_it():
    built = cpu_kernels.load_bf16_linear()
    assert built is not None
    with open("/proc/cpuinfo") as cpuinfo:
        flags = next((line for line in cpuinfo if line.startswith("flags")), "").split()
    assert built.uses_dot_product == ("avx512_bf16" in flags and "avx512bw" in flags)


def test_kernel_is_chosen_for_bf16_on_cpu_only():
    cpu = torch.device("cpu")
    assert cpu_kernels.bf16_linear_kernel_for(cpu, torch.bfloat16) is not None
    assert cpu_kernels.bf16_linear_kernel_for(cpu, torch.float32) is None
    assert cpu_kernels.bf16_linear_kernel_for(torch.device("cuda"), torch.bfloat16) is None


def test_a_bf16_model_with_native_linears_gives_torchs_logits(kernel):
    model = tiny_model(tiny_config("llama", tie_word_embeddings=True)).to(torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    with torch.inference_mode():
        expected = model(ids).logits.float()
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert bf16_linear.install(model, kernel) == len(linears) > 0
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.inference_mode():
        got = model(ids).logits.float()
    # Both sum exact products in fp32 and round to bf16; only the order of the sums differs.
    assert (got - expected).abs().max().item() <= 4 * BF16_ULP * expected.abs().max().item()


def test_many_rows_and_autograd_go_to_torch(kernel, monkeypatch):
    layer = torch.nn.Linear(64, 24).to(torch.bfloat16)
    bf16_linear.install(layer, kernel)
    calls = []
    monkeypatch.setattr(layer, "bf16_kernel", lambda *args: calls.append(args) or kernel(*args))
    most = cpu_kernels.MAX_BF16_LINEAR_ROWS
    with torch.inference_mode():
        layer(torch.randn(most, 64).bfloat16())
        layer(torch.randn(most + 1, 64).bfloat16())
    assert len(calls) == 1
    x = torch.randn(2, 64, dtype=torch.bfloat16, requires_grad=True)
    layer(x).sum().backward()  # autograd wanted: torch's path, gradients flow
    assert len(calls) == 1 and x.grad is not None
