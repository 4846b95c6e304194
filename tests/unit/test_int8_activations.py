"""The opt-in int8-activation kernel for 4-bit codes (kernels/int8_activations.py).

Two references, both float64:
- the kernel's own rounding, redone in float64 (x rounded to int8 per block of 32 with scale
  max|x| / 127, then the exact product with the rounded x): equal to fp32 accuracy, so every
  shape, register block and tail is computed as stated;
- the exact product with unrounded x: within the stated tolerance of the rounding
  (RELATIVE_RMS_ERROR of the output's rms; measured ~0.4% on Gaussian inputs).
Scales and offsets that are exactly fp16 (GGUF's) are read as fp16 copies: the same results bit for bit.
And QuantLinear takes this path only when asked (INFERENCE_SERVICE_QUANT_ACTIVATIONS=int8), only for
the few-row shapes it fits, and gives greedy tokens that agree with the fp32 path on a small model.
"""

from __future__ import annotations

import pytest
import torch

from inference_service.worker.kernels import bindings, int8_activations
from inference_service.worker.kernels.packed import PackedWeight, quantize_rtn
from inference_service.worker.linears.quant import QuantLinear

EXACT = 1e-5  # against the float64 redo of the kernel's rounding, relative to the output's magnitude
RELATIVE_RMS_ERROR = 0.01  # against the exact product: the stated tolerance of int8 activations


@pytest.fixture(scope="module")
def kernel() -> int8_activations.Int8ActivationLinear:
    built = int8_activations.load()
    if built is None:
        pytest.skip("the native kernels did not build (no C++ compiler)")
    probe = quantize_rtn(torch.randn(4, 64), 4, 32)
    if not built.supports(probe):
        pytest.skip("this CPU has no AVX-512 VNNI: the int8-activation kernel is not compiled in")
    return built


def random_packed(n: int, k: int, group_size: int, seed: int) -> PackedWeight:
    generator = torch.Generator().manual_seed(seed)
    return quantize_rtn(torch.randn(n, k, generator=generator), 4, group_size)


def exact(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ packed.dequantize().double().T
    return out + bias.double() if bias is not None else out


def rounded_reference(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's math in float64, with x's int8 rounding computed here (not by the kernel)."""
    m, k = x.shape
    blocks = x.double().view(m, k // 32, 32)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    codes = torch.where(scale > 0, torch.round(blocks / scale), torch.zeros_like(blocks))
    rounded = (codes * scale).view(m, k)
    out = rounded @ packed.dequantize().double().T
    return out + bias.double() if bias is not None else out


def assert_exact(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.shape == expected.shape and out.dtype == torch.float32
    assert (out.double() - expected).abs().max().item() <= EXACT * (expected.abs().max().item() + 1.0)


def relative_rms(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.double() - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize(
    ("k", "group_size"),
    [(32, 32), (96, 32), (576, 32), (1536, 128), (160, 160), (224, 32)],
)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13])
def test_kernel_equals_its_rounding_in_float64(kernel, k, group_size, rows):
    packed = random_packed(37, k, group_size, seed=k + group_size)  # 37: register blocks with a remainder
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(37)
    assert kernel.supports(packed)
    assert_exact(kernel(x, packed, None), rounded_reference(x, packed, None))
    assert_exact(kernel(x, packed, bias), rounded_reference(x, packed, bias))
    assert relative_rms(kernel(x, packed, bias), exact(x, packed, bias)) <= RELATIVE_RMS_ERROR


def test_threaded_large_output_and_leading_dimensions(kernel):
    packed = random_packed(3000, 576, 32, seed=1)  # over the threading threshold
    x = torch.randn(2, 3, 576)
    out = kernel(x, packed, None)
    assert out.shape == (2, 3, 3000)
    assert_exact(out.view(6, 3000), rounded_reference(x.view(6, 576), packed, None))
    assert kernel(torch.randn(0, 576), packed, None).shape == (0, 3000)


def test_quantize_rounds_each_block_to_int8(kernel):
    x = torch.randn(3, 96) * torch.tensor([0.01, 1.0, 100.0]).repeat_interleave(32)  # blocks of other scales
    x[1, 32:64] = 0.0  # an all-zero block: scale 0, codes 0
    codes, scales = kernel.quantize(x)
    assert codes.dtype == torch.int8 and codes.shape == (3, 96) and scales.shape == (3, 3)
    expected_scales = x.view(3, 3, 32).abs().amax(dim=-1) / 127
    assert torch.allclose(scales, expected_scales, rtol=1e-6, atol=0)
    assert codes.abs().max().item() <= 127 and codes[1, 32:64].eq(0).all()
    error = (codes.float().view(3, 3, 32) * scales.unsqueeze(-1) - x.view(3, 3, 32)).abs()
    assert (error <= scales.unsqueeze(-1) / 2 * (1 + 1e-5) + 1e-12).all()


def test_extreme_values(kernel):
    packed = random_packed(16, 64, 32, seed=2)
    packed.scales.mul_(1e4)
    x = torch.randn(2, 64) * 1e3
    x[0, :32] = 0.0
    out = kernel(x, packed, None)
    assert torch.isfinite(out).all()
    assert_exact(out, rounded_reference(x, packed, None))


@pytest.mark.parametrize(("bits", "k", "group_size"), [(8, 64, 32), (4, 48, 16), (4, 100, 32), (4, 64, 16)])
def test_unsupported_shapes_are_refused(kernel, bits, k, group_size):
    packed = quantize_rtn(torch.randn(8, k), bits, group_size)
    assert not kernel.supports(packed)
    with pytest.raises(RuntimeError, match="int8-activation kernel refused"):
        kernel(torch.randn(1, k), packed, None)


def test_requested_reads_the_environment(monkeypatch):
    monkeypatch.delenv(int8_activations.ENV_SWITCH, raising=False)
    assert int8_activations.requested() == "fp32"
    monkeypatch.setenv(int8_activations.ENV_SWITCH, " INT8 ")
    assert int8_activations.requested() == "int8"
    monkeypatch.setenv(int8_activations.ENV_SWITCH, "int4")
    with pytest.raises(ValueError, match="must be one of fp32, int8"):
        int8_activations.requested()


def test_quant_linear_uses_it_only_when_asked_and_for_few_rows(kernel, monkeypatch):
    packed = random_packed(64, 576, 32, seed=3)
    bias = torch.randn(64)
    few, many = torch.randn(1, 576), torch.randn(40, 576)
    fp32_kernel = bindings.load_quant_linear()
    assert fp32_kernel is not None
    monkeypatch.delenv(int8_activations.ENV_SWITCH, raising=False)
    default = QuantLinear(packed, bias)
    assert torch.equal(default(few), fp32_kernel(few, packed, bias))
    monkeypatch.setenv(int8_activations.ENV_SWITCH, "int8")
    asked = QuantLinear(packed, bias)
    assert torch.equal(asked(few), kernel(few, packed, bias))
    assert not torch.equal(asked(few), default(few))  # the rounding shows: the path really changed
    assert torch.equal(asked(many), default(many))  # prefill rows keep the fp32 path
    eight_bit = QuantLinear(quantize_rtn(torch.randn(37, 576), 8, 32))  # 37 rows: no panels
    assert torch.equal(eight_bit(few), fp32_kernel(few, eight_bit.packed, None))


def fp16_exact(packed: PackedWeight) -> PackedWeight:
    """The weight with its scales and offsets rounded to fp16 values (as GGUF stores them), kept fp32."""
    return PackedWeight(
        packed.bits,
        packed.codes,
        packed.scales.half().float(),
        packed.offsets.half().float(),
        packed.group_size,
        packed.in_features,
    )


@pytest.mark.parametrize(("k", "group_size"), [(576, 32), (96, 32), (1536, 128), (160, 160), (224, 32)])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_fp16_factors_give_the_fp32_factors_results(kernel, monkeypatch, k, group_size, rows):
    """Factors that are all fp16 values are read as fp16 copies (both the adjacent-pair loads of groups
    of 32 and the per-group ones): bitwise the fp32 factors' results, and the float64 redo's."""
    packed = fp16_exact(random_packed(37, k, group_size, seed=k + rows))
    bias = torch.randn(37)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    monkeypatch.setenv(int8_activations.ENV_SWITCH, "int8")
    linear = QuantLinear(packed, bias)
    out = linear(x)
    few_rows = linear._native_kernels()[3]
    assert few_rows is not None and all(f.dtype == torch.float16 for f in few_rows.factors)
    assert torch.equal(out, kernel(x, packed, bias))
    assert_exact(out, rounded_reference(x, packed, bias))


def test_factors_that_are_not_fp16_values_stay_fp32(kernel, monkeypatch):
    packed = random_packed(64, 576, 32, seed=4)  # RTN scales: fp32 values that fp16 would round
    monkeypatch.setenv(int8_activations.ENV_SWITCH, "int8")
    assert int8_activations.Int8ActivationLinear.compact_factors(packed) is None
    offset_only = fp16_exact(packed)
    offset_only.offsets[3, 5] += 1e-6  # one value off the fp16 grid keeps both fp32
    assert int8_activations.Int8ActivationLinear.compact_factors(offset_only) is None
    linear = QuantLinear(packed)
    x = torch.randn(2, 576)
    out = linear(x)
    few_rows = linear._native_kernels()[3]
    assert few_rows is not None and all(f.dtype == torch.float32 for f in few_rows.factors)
    assert torch.equal(out, kernel(x, packed, None))


def test_greedy_tokens_agree_with_the_fp32_path(kernel, monkeypatch):
    """A small random Llama (transformers' initialisation), every projection 4-bit, decoded as the server
    does (the prompt, then one row per step: the few-row path): 24 greedy tokens with int8 activations
    are the fp32 path's, and its logits differ from them (the path is used) by a small fraction of
    their spread. Deterministic: both kernels sum in a fixed order."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config).eval()
    for layer in model.model.layers:
        sites = [(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        sites += [(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
        for parent, name in sites:
            setattr(parent, name, QuantLinear(quantize_rtn(getattr(parent, name).weight.detach(), 4, 32)))
    prompt = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(1))

    def greedy(steps: int) -> tuple[list[int], torch.Tensor]:
        for module in model.modules():  # resolve the kernels again under the current environment
            if isinstance(module, QuantLinear):
                module.repoint()
        tokens, first_logits, ids, past = [], None, prompt, None
        with torch.no_grad():
            for _ in range(steps):
                output = model(ids, past_key_values=past, use_cache=True)
                logits, past = output.logits[0, -1], output.past_key_values
                first_logits = logits if first_logits is None else first_logits
                tokens.append(int(logits.argmax()))
                ids = torch.tensor([[tokens[-1]]])
        return tokens, first_logits

    monkeypatch.delenv(int8_activations.ENV_SWITCH, raising=False)
    reference, reference_logits = greedy(24)
    monkeypatch.setenv(int8_activations.ENV_SWITCH, "int8")
    tokens, logits = greedy(24)
    assert tokens == reference
    difference = (logits - reference_logits).abs().max().item()
    assert 0 < difference <= 0.05 * reference_logits.std().item()


def test_the_load_probe_allows_the_rounding_only_when_asked(monkeypatch):
    """The paged-attention probe compares decode rows (int8 when asked) with a plain forward (more rows:
    fp32): with int8 activations it allows bf16's margin, else fp32's."""
    from inference_service.errors import ModelLoadError
    from inference_service.models import registry

    expected = torch.linspace(-10, 10, 50)
    rounded = expected + 0.05
    monkeypatch.delenv(int8_activations.ENV_SWITCH, raising=False)
    with pytest.raises(ModelLoadError, match="paged logits differ"):
        registry._compare("llama", rounded, expected, torch.float32)
    monkeypatch.setenv(int8_activations.ENV_SWITCH, "int8")
    registry._compare("llama", rounded, expected, torch.float32)
    with pytest.raises(ModelLoadError, match="paged logits differ"):
        registry._compare("llama", expected + 5.0, expected, torch.float32)
