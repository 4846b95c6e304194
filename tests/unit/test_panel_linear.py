"""The panel GEMM (many rows of x) computes x·Wᵀ + b as float64 math does, from fp32 weights and from
packed 4- and 8-bit codes, and the modules route prefill-sized inputs to it. Weights stored in the
panel layout (worker/kernels/panels.py), 8-bit codes in QuantLinear and fp32 ones in PanelledLinear, compute
the same at every row count; PanelledLinear replaces exactly the linears it should and leaves a
model's logits as they were.

Row counts cover whole register tiles and every leftover (the tile is 12 rows with AVX-512, 14 for
prompt-sized inputs over weights stored in panels, 6 with AVX2), prompt-sized inputs whose rows are
packed in several blocks, output sizes with a partial last panel, K not a multiple of the 8x8
transpose, group sizes that do not divide K, and enough output columns to run both threads.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_config, tiny_model

from inference_service.worker.kernels import bindings as cpu_kernels
from inference_service.worker.kernels import panels
from inference_service.worker.kernels.packed import PackedWeight, quantize_rtn
from inference_service.worker.linears import native as native_linear
from inference_service.worker.linears import panelled as panelled_linear
from inference_service.worker.linears.panelled import PanelledLinear
from inference_service.worker.linears.quant import QuantLinear
from inference_service.worker.runner.fused_projections import fuse_projections

TOLERANCE = 1e-5  # relative to the output's magnitude
ROWS = [1, 5, 12, 13, 23, 24, 35, 100]
SHAPES = [(1, 8), (40, 17), (64, 576), (97, 96), (700, 64)]


@pytest.fixture(scope="module")
def panel() -> cpu_kernels.PanelLinear:
    built = cpu_kernels.load_panel_linear()
    assert built is not None, "the native kernels did not build (is a C++ compiler installed?)"
    return built


def assert_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.shape == expected.shape and out.dtype == torch.float32
    scale = expected.abs().max().item() + 1.0
    assert (out.double() - expected).abs().max().item() <= TOLERANCE * scale


def expected(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out + bias.double() if bias is not None else out


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_fp32_weights(panel, rows, out_features, in_features):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    assert_close(panel(x, weight, None), expected(x, weight, None))
    assert_close(panel(x, weight, bias), expected(x, weight, bias))


@pytest.mark.parametrize("rows", [13, 35])
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
@pytest.mark.parametrize(("bits", "group_size"), [(8, None), (8, 32), (4, 32), (4, 16), (4, 24), (8, 5)])
def test_packed_weights(panel, rows, out_features, in_features, bits, group_size):
    generator = torch.Generator().manual_seed(rows + out_features + bits)
    packed = quantize_rtn(torch.randn(out_features, in_features, generator=generator), bits, group_size or in_features)
    x = torch.randn(rows, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    assert_close(panel.quant(x, packed, bias), expected(x, packed.dequantize(), bias))


def test_extreme_codes_and_scales(panel):
    """All-zero and all-max codes, zero and huge scales: the widened floats are dequantize()'s."""
    n, k = 64, 96
    codes = torch.zeros(n, k, dtype=torch.uint8)
    codes[1::2] = 255
    scales = torch.ones(n, 3)
    scales[:8] = 0.0
    scales[8:16] = 1e30
    packed = PackedWeight(8, codes, scales, torch.full((n, 3), -1.5), 32, k)
    x = torch.randn(20, k) * 1e-6
    assert_close(panel.quant(x, packed, None), expected(x, packed.dequantize(), None))


def test_leading_dimensions_strided_input_and_zero_rows(panel):
    x = torch.randn(2, 20, 2 * 64)[..., ::2]  # [2, 20, 64], not contiguous
    weight = torch.randn(40, 64)
    out = panel(x, weight, None)
    assert out.shape == (2, 20, 40)
    assert_close(out, expected(x, weight, None))
    assert panel(torch.randn(1, 0, 64), weight, None).shape == (1, 0, 40)


def test_modules_send_many_rows_to_the_panel_gemm(panel, monkeypatch):
    """NativeLinear and QuantLinear above their few-row limits compute through the panel GEMM (a
    broken panel kernel shows in their output), and still equal float64 math."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    linear_holder = torch.nn.Sequential(linear)
    assert native_linear.install(linear_holder, cpu_kernels.load_small_batch_linear(), panel) == 1
    packed = quantize_rtn(torch.randn(48, 64), 8, 64)
    quant = QuantLinear.from_packed(packed, torch.randn(48))
    x = torch.randn(3, 30, 64)  # 90 rows: above MAX_LINEAR_ROWS and MAX_QUANT_ROWS
    with torch.no_grad():
        assert_close(linear_holder(x), expected(x, linear.weight, linear.bias))
        assert_close(quant(x), expected(x, packed.dequantize(), quant.bias))
        calls = []

        def recorder(kind: str):
            return lambda self, x, *rest: calls.append(kind) or x[..., :48]

        monkeypatch.setattr(cpu_kernels.PanelLinear, "__call__", recorder("fp32"))
        monkeypatch.setattr(cpu_kernels.PanelLinear, "quant", recorder("packed"))
        linear_holder(x)
        quant(x)
        linear_holder(x[:, :1])  # 3 rows: the few-row kernel
    assert calls == ["fp32", "packed"]


def test_a_tiny_model_prefills_the_same_through_the_panel_gemm(panel):
    """A whole prefill (every projection above the few-row limit) equals torch's GEMM's logits."""
    model = tiny_model(tiny_config("llama"))
    ids = torch.randint(0, model.config.vocab_size, (1, 70))
    with torch.no_grad():
        reference = model(ids).logits
        native_linear.install(model, cpu_kernels.load_small_batch_linear(), panel)
        assert (model(ids).logits - reference).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    ("out_features", "in_features", "group_size"), [(32, 8, 8), (64, 96, 32), (96, 100, 7), (320, 576, 576)]
)
def test_panel_layout_round_trips(out_features, in_features, group_size):
    packed = quantize_rtn(torch.randn(out_features, in_features), 8, group_size)
    assert panels.takes(packed)
    codes, scales, offsets = panels.to_panels(packed)
    assert codes.shape == (out_features // panels.PANEL, in_features, panels.PANEL)
    assert torch.equal(codes[-1, 3], packed.codes[-panels.PANEL :, 3])  # a panel's k-th line: its rows' codes
    back = panels.from_panels(codes, scales, offsets, group_size, in_features)
    assert all(torch.equal(getattr(back, n), getattr(packed, n)) for n in ("codes", "scales", "offsets"))


def test_only_8_bit_codes_filling_panels_are_panelled():
    assert QuantLinear.from_packed(quantize_rtn(torch.randn(64, 32), 8, 32)).panelled
    assert not QuantLinear.from_packed(quantize_rtn(torch.randn(48, 32), 8, 32)).panelled
    assert not QuantLinear.from_packed(quantize_rtn(torch.randn(64, 32), 4, 32)).panelled
    with pytest.raises(ValueError, match="fill panels"):
        QuantLinear(quantize_rtn(torch.randn(48, 32), 8, 32), panelled=True)


@pytest.mark.parametrize("rows", [1, 2, 7, 12, 13, 24, 64, 65, 100])
@pytest.mark.parametrize(("out_features", "in_features", "group_size"), [(64, 96, 96), (96, 100, 32), (32, 17, 5)])
def test_panelled_codes_at_every_row_count(panel, rows, out_features, in_features, group_size):
    """Decode-sized inputs (tiles widening codes as they go) and prefill-sized ones (each panel
    widened once, above 64 rows) alike, with and without a bias; `.packed` gives the codes back."""
    generator = torch.Generator().manual_seed(rows * 7 + out_features)
    packed = quantize_rtn(torch.randn(out_features, in_features, generator=generator), 8, group_size)
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    for module_bias in (None, bias):
        module = QuantLinear.from_packed(packed, module_bias)
        assert module.panelled
        with torch.no_grad():
            assert_close(module(x), expected(x, packed.dequantize(), module_bias))
    assert torch.equal(module.packed.codes, packed.codes)
    assert_close(
        panel.codes(x, module.codes, module.scales, module.offsets, bias, group_size),
        expected(x, packed.dequantize(), bias),
    )


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("factors", ["fp32", "fp16", "q8_0"])
@pytest.mark.parametrize(("out_features", "in_features", "group_size"), [(64, 96, 32), (96, 100, 32), (32, 17, 5)])
def test_few_rows_of_panelled_codes_read_compact_factors(panel, rows, factors, out_features, in_features, group_size):
    """An LM head's: up to MAX_FEW_PANEL_ROWS rows go to the few-row kernel, which reads fp16 factors where they
    are exact and no offsets where each is -128 * its scale (Q8_0); more rows to the tiles. Groups that
    do not divide K and groups of odd size included."""
    generator = torch.Generator().manual_seed(rows * 13 + out_features)
    packed = quantize_rtn(torch.randn(out_features, in_features, generator=generator), 8, group_size)
    if factors != "fp32":
        scales = packed.scales.half().float()
        offsets = scales * -128 if factors == "q8_0" else packed.offsets.half().float()
        packed = PackedWeight(8, packed.codes, scales, offsets, group_size, in_features)
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    for module_bias in (None, bias):
        module = QuantLinear.from_packed(packed, module_bias)
        assert module._native_kernels()[3] is None  # a layer's panels: the tiles, as the fused layers
        module.use_few_row_panels()  # an LM head's
        few_rows = module._native_kernels()[3]
        assert isinstance(few_rows, cpu_kernels.PanelCodesFewRows)
        assert module.native_calls()[1] is None
        assert few_rows.factor_dtype == (torch.float32 if factors == "fp32" else torch.float16)
        assert few_rows.symmetric == (factors == "q8_0")
        with torch.no_grad():
            assert_close(module(x), expected(x, packed.dequantize(), module_bias))
            if rows <= cpu_kernels.MAX_FEW_PANEL_ROWS:
                assert_close(few_rows(x), expected(x, packed.dequantize(), module_bias))


def test_panelled_codes_without_the_native_library_take_torchs_path(monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "off")
    packed = quantize_rtn(torch.randn(64, 40), 8, 8)
    module = QuantLinear.from_packed(packed, torch.randn(64))
    x = torch.randn(3, 40)
    with torch.no_grad():
        assert_close(module(x), expected(x, packed.dequantize(), module.bias))
    assert module._native_kernels() == (None, False, None, None)


@pytest.mark.parametrize("rows", [1, 2, 11, 12, 13, 16, 40, 100])
@pytest.mark.parametrize(("out_features", "in_features"), [(32, 8), (64, 96), (96, 17), (320, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_panelled_fp32_weights_equal_float64_math(panel, rows, out_features, in_features, with_bias):
    generator = torch.Generator().manual_seed(rows * 100 + out_features)
    linear = torch.nn.Linear(in_features, out_features, bias=with_bias)
    module = PanelledLinear.from_weight(linear.weight, linear.bias, panel)
    x = torch.randn(3, rows, in_features, generator=generator)
    expected = x.double() @ linear.weight.double().T + (linear.bias.double() if with_bias else 0)
    with torch.no_grad():
        assert_close(module(x), expected)
        assert_close(PanelledLinear.from_weight(linear.weight, linear.bias, None)(x), expected)  # torch's path
    assert torch.equal(module.weight, linear.weight)


@pytest.mark.parametrize(
    ("rows", "in_features"),
    [(47, 576), (48, 576), (61, 576), (69, 576), (1000, 576), (455, 1024), (100, 1025), (60, 1536), (56, 2048)],
)
def test_panelled_fp32_prompt_rows_equal_float64_math(panel, rows, in_features):
    """Prompt-sized inputs in tiles of 14 rows (AVX-512): x packed in blocks of rows (one block with a
    partial last tile at 61 and 69 rows; several blocks and a partial last one at 1,000 rows of 576,
    blocks of 448), at the edges of packing (48 rows, 1,024 columns), and read in place past them
    (whole tiles at 56 rows)."""
    generator = torch.Generator().manual_seed(rows + in_features)
    linear = torch.nn.Linear(in_features, 96)
    module = PanelledLinear.from_weight(linear.weight, linear.bias, panel)
    x = torch.randn(rows, in_features, generator=generator)
    with torch.no_grad():
        assert_close(module(x), x.double() @ linear.weight.double().T + linear.bias.double())


def test_panelled_linear_install_replaces_exactly_the_eligible_linears(panel):
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
        assert after[:, q_rows : q_rows + k_rows].abs().max().item() == 0  # the fused module sees the write
