"""The bf16 decode-step ops (csrc/bf16_glue.cpp) round where transformers' bf16 modules round: each is
float64's math rounded to bf16 at the same points (within one bf16 unit where a sum's order may
differ), and the rotary embedding and residual add are bitwise torch's bf16 ops."""

from __future__ import annotations

import pytest
import torch

from inference_service.worker.kernels.bf16_glue import BF16DecodeGlue, load_bf16_decode_glue

BF16_ULP = 2.0**-7  # one unit in the last place, relative


@pytest.fixture(scope="module")
def glue() -> BF16DecodeGlue:
    built = load_bf16_decode_glue()
    assert built is not None, "the native kernels did not build (is a C++ compiler installed?)"
    return built


def _bf16(*shape: int, seed: int, spread: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * spread).bfloat16()


def _within_one_unit(out: torch.Tensor, expected: torch.Tensor) -> bool:
    assert out.dtype == torch.bfloat16 and out.shape == expected.shape
    return bool(((out.double() - expected).abs() <= BF16_ULP * expected.abs() + 1e-30).all())


def _rms_norm_reference(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm on bf16 input: in float64, rounded to bf16 where the module rounds."""
    x = h.double()
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).bfloat16().double()
    return weight.double() * normed


@pytest.mark.parametrize("dim", [8, 64, 576, 1000])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_equals_float64_math(glue, dim, with_delta):
    hidden, weight = _bf16(3, dim, seed=dim, spread=4.0), _bf16(dim, seed=1)
    delta = _bf16(3, dim, seed=2, spread=4.0) if with_delta else None
    added = hidden + delta if delta is not None else hidden.clone()  # torch's bf16 add: the residual
    out = glue.add_rms_norm(hidden, delta, weight, 1e-5)
    assert torch.equal(hidden, added)
    assert _within_one_unit(out, _rms_norm_reference(added, weight, 1e-5))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@pytest.mark.parametrize("with_norms", [False, True])
def test_rope_kv_write_equals_torchs_bf16_ops(glue, with_norms):
    rows, heads, kv_heads, dim = 3, 6, 2, 64
    qkv = _bf16(rows, heads + 2 * kv_heads, dim, seed=5, spread=3.0)
    angles = torch.rand(rows, dim // 2, generator=torch.Generator().manual_seed(6)) * 40
    cos, sin = torch.cat([angles.cos()] * 2, -1).bfloat16(), torch.cat([angles.sin()] * 2, -1).bfloat16()
    q_norm, k_norm = (_bf16(dim, seed=7), _bf16(dim, seed=8)) if with_norms else (None, None)
    key_cache = torch.zeros(10, kv_heads, dim, dtype=torch.bfloat16)
    value_cache = torch.zeros(10, kv_heads, dim, dtype=torch.bfloat16)
    slots = torch.tensor([7, 2, 9])
    q, k, v = qkv[:, :heads].clone(), qkv[:, heads : heads + kv_heads].clone(), qkv[:, heads + kv_heads :].clone()
    if with_norms:
        q, k = _rms_norm_reference(q, q_norm, 1e-6).bfloat16(), _rms_norm_reference(k, k_norm, 1e-6).bfloat16()
    c, s = cos[:, None], sin[:, None]
    q, k = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s  # transformers' apply_rotary_pos_emb
    glue.rope_kv_write(qkv, cos, sin, q_norm, k_norm, 1e-6, key_cache, value_cache, slots, heads, kv_heads)
    if with_norms:  # the norm's sum may round differently: one unit, then the rotation on top
        assert (qkv[:, :heads].double() - q.double()).abs().max() <= 4 * BF16_ULP * q.double().abs().max()
    else:
        assert torch.equal(qkv[:, :heads], q) and torch.equal(qkv[:, heads : heads + kv_heads], k)
    assert torch.equal(key_cache[slots], qkv[:, heads : heads + kv_heads])
    assert torch.equal(value_cache[slots], v)
    assert not key_cache[[0, 1, 3, 4, 5, 6, 8]].any()


def test_rope_without_caches_leaves_them_to_the_caller(glue):
    qkv = _bf16(2, 4, 8, seed=9)
    before = qkv.clone()
    ones, zeros = torch.ones(2, 8, dtype=torch.bfloat16), torch.zeros(2, 8, dtype=torch.bfloat16)
    glue.rope_kv_write(qkv, ones, zeros, None, None, 0.0, None, None, torch.tensor([0, 1]), 2, 1)
    assert torch.equal(qkv, before)  # cos 1, sin 0: the identity


@pytest.mark.parametrize("width", [1, 13, 1536])
@pytest.mark.parametrize("spread", [0.01, 1.0, 40.0])
def test_silu_mul_equals_float64_math(glue, width, spread):
    gate_up = _bf16(4, 2 * width, seed=width, spread=spread)
    gate, up = gate_up.double().split(width, dim=-1)
    expected = torch.nn.functional.silu(gate).bfloat16().double() * up  # transformers: bf16(silu) * up
    assert _within_one_unit(glue.silu_mul(gate_up), expected)


def test_nan_stays_nan(glue):
    gate_up = torch.tensor([[float("nan"), 1.0, 2.0, 3.0]], dtype=torch.bfloat16)
    out = glue.silu_mul(gate_up)
    assert out[0, 0].isnan() and not out[0, 1].isnan()
