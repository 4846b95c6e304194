"""fp32 projections stored in panels (worker/panelled_linear.py) compute x·Wᵀ + b as float64 math does
at every row count, replace exactly the linears they should, and leave a model's logits as they were."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_config, tiny_model

from inference_service.worker import cpu_kernels, native_linear, panelled_linear
from inference_service.worker.decode_step import fuse_projections
from inference_service.worker.panelled_linear import PanelledLinear

TOLERANCE = 1e-5  # relative to the output's magnitude


@pytest.fixture(scope="module")
def panel() -> cpu_kernels.PanelLinear:
    built = cpu_kernels.load_panel_linear()
    assert built is not None, "the native kernels did not build (is a C++ compiler installed?)"
    return built


def assert_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.shape == expected.shape and out.dtype == torch.float32
    scale = expected.abs().max().item() + 1.0
    assert (out.double() - expected).abs().max().item() <= TOLERANCE * scale


@pytest.mark.parametrize("rows", [1, 2, 11, 12, 13, 16, 40, 100])
@pytest.mark.parametrize(("out_features", "in_features"), [(32, 8), (64, 96), (96, 17), (320, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_equals_float64_math(panel, rows, out_features, in_features, with_bias):
    generator = torch.Generator().manual_seed(rows * 100 + out_features)
    linear = torch.nn.Linear(in_features, out_features, bias=with_bias)
    module = PanelledLinear.from_weight(linear.weight, linear.bias, panel)
    x = torch.randn(3, rows, in_features, generator=generator)
    expected = x.double() @ linear.weight.double().T + (linear.bias.double() if with_bias else 0)
    with torch.no_grad():
        assert_close(module(x), expected)
        assert_close(PanelledLinear.from_weight(linear.weight, linear.bias, None)(x), expected)  # torch's path
    assert torch.equal(module.weight, linear.weight)


def test_install_replaces_exactly_the_eligible_linears(panel):
    model = tiny_model(tiny_config("llama", tie_word_embeddings=True))
    model.model.layers[0].mlp.extra = torch.nn.Linear(8, 40)  # 40 rows: not whole panels
    linears = {name for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    count = panelled_linear.install(model, panel)
    panelled = {name for name, m in model.named_modules() if type(m) is PanelledLinear}
    assert count == len(panelled) > 0 and panelled < linears
    assert "lm_head" not in panelled and "model.layers.0.mlp.extra" not in panelled  # tied; 40 rows
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_model_keeps_its_logits_and_fused_modules_share_writes(panel):
    model = tiny_model(tiny_config("llama"))
    ids = torch.randint(0, model.config.vocab_size, (1, 70))
    with torch.no_grad():
        expected = model(ids).logits
        panelled_linear.install(model, panel)
        native_linear.install(model, cpu_kernels.load_small_batch_linear(), panel)
        assert (model(ids).logits - expected).abs().max().item() < 1e-4
        attention = model.model.layers[0].self_attn
        fused = fuse_projections([attention.q_proj, attention.k_proj, attention.v_proj])
        assert isinstance(fused, PanelledLinear)
        x = torch.randn(5, attention.q_proj.in_features)
        before = fused(x)
        attention.k_proj.copy_weight_(torch.zeros_like(attention.k_proj.weight))
        q_rows, k_rows = attention.q_proj.out_features, attention.k_proj.out_features
        after = fused(x)
        assert torch.equal(after[:, :q_rows], before[:, :q_rows])
        assert after[:, q_rows:q_rows + k_rows].abs().max().item() == 0  # the fused module sees the write
