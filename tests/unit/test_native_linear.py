"""The native few-row linear computes x·Wᵀ + b as float64 math does, and swaps into a model safely.

Row counts cover every register-blocking case of the kernel (1–8 rows, more rows in chunks of 8),
output sizes that are not multiples of its row blocks, and the threaded and single-thread paths.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_config, tiny_model

from inference_service.worker.kernels import bindings as cpu_kernels
from inference_service.worker.linears import native as native_linear

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def kernel() -> cpu_kernels.SmallBatchLinear:
    built = cpu_kernels.load_small_batch_linear()
    assert built is not None, "the native kernels did not build (is a C++ compiler installed?)"
    return built


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 17, cpu_kernels.MAX_LINEAR_ROWS])
# 3000 x 40: one row of x reads W row after row in steps of 32 with a tail of 8, over threads.
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 8), (13, 64), (200, 576), (1100, 96), (3000, 40)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_equals_float64_math(kernel, rows, out_features, in_features, with_bias):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    assert kernel.supports_weight(weight)
    out = kernel(x, weight, bias)
    expected = x.double() @ weight.double().T + (bias.double() if with_bias else 0)
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    assert (out.double() - expected).abs().max().item() < TOLERANCE


def test_leading_dimensions_are_kept_and_strided_input_is_read_right(kernel):
    x = torch.randn(1, 3, 2 * 64)[..., ::2]  # [1, 3, 64], not contiguous
    weight = torch.randn(40, 64)
    out = kernel(x, weight, None)
    assert out.shape == (1, 3, 40)
    assert (out - F.linear(x, weight)).abs().max().item() < TOLERANCE


def test_zero_rows_give_an_empty_result(kernel):
    out = kernel(torch.randn(1, 0, 64), torch.randn(40, 64), torch.randn(40))
    assert out.shape == (1, 0, 40)


def test_weights_the_kernel_cannot_read_are_refused(kernel):
    assert not kernel.supports_weight(torch.randn(8, 12))  # in_features not a multiple of 8
    assert not kernel.supports_weight(torch.randn(16, 8).T)  # not contiguous
    assert not kernel.supports_weight(torch.randn(8, 16, dtype=torch.bfloat16))


def _tied_llama():
    return tiny_model(tiny_config("llama", tie_word_embeddings=True))


def test_install_switches_the_linears_and_keeps_weights_tied(kernel):
    model = _tied_llama()
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert native_linear.install(model, kernel) == len(linears) > 0
    assert all(type(m) is native_linear.NativeLinear for m in linears)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(torch.equal(state[name], tensor) for name, tensor in model.state_dict().items())


def test_a_model_with_native_linears_gives_the_same_logits(kernel):
    model = _tied_llama()
    ids = torch.randint(0, model.config.vocab_size, (1, 40))
    with torch.inference_mode():
        expected = model(ids).logits  # 40 rows per projection
        last_expected = model(ids[:, :5]).logits
    native_linear.install(model, kernel)
    with torch.inference_mode():
        assert (model(ids).logits - expected).abs().max().item() < TOLERANCE  # torch's GEMM (too many rows)
        assert (model(ids[:, :5]).logits - last_expected).abs().max().item() < TOLERANCE  # native


def test_native_linear_uses_the_kernel_for_few_rows_only(kernel, monkeypatch):
    layer = torch.nn.Linear(64, 24)
    native_linear.install(layer, kernel)
    calls = []
    monkeypatch.setattr(layer, "native_kernel", lambda *args: calls.append(args) or kernel(*args))
    most = cpu_kernels.MAX_LINEAR_ROWS
    with torch.inference_mode():
        few = layer(torch.randn(most, 64))
        many = layer(torch.randn(most + 1, 64))
    assert len(calls) == 1 and few.shape == (most, 24) and many.shape == (most + 1, 24)
    x = torch.randn(2, 64, requires_grad=True)
    layer(x).sum().backward()  # autograd wanted: torch's path, gradients flow
    assert len(calls) == 1 and x.grad is not None
