"""GGUF blocks decoded into packed weights: the same floats as gguf-py.

The reference is `gguf.quants.dequantize` (what transformers' GGUF reader uses). Random blocks cover
every code and sub-scale pattern; the fp16 block scales are set to finite values, zeros, subnormals
and the largest fp16 included.
"""

from __future__ import annotations

import time

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from inference_service.worker.quant.gguf_blocks import (
    SUPPORTED_TYPES,
    is_quantized_type,
    is_supported_type,
    packed_from_gguf,
)

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# Byte offsets of each type's fp16 fields (d, and m or dmin), the bytes random data could make inf/NaN.
FP16_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
               Q.Q2_K: (80, 82)}
# gguf-py computes these as one product d·(q − c), which gives −0.0 where our exact sum gives +0.0.
SIGNED_ZERO_MAY_DIFFER = {Q.Q4_0, Q.Q8_0, Q.Q6_K}
LAYOUT = {Q.Q4_0: (4, 32), Q.Q4_1: (4, 32), Q.Q8_0: (8, 32), Q.Q4_K: (4, 32), Q.Q5_K: (8, 32), Q.Q6_K: (8, 16)}
# 0, −0, ±1, the largest fp16, the smallest subnormal and a negative one.
SPECIAL_FP16 = np.array([0x0000, 0x8000, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF, 0x0001, 0x8234], dtype=np.uint16)


def finite_fp16_bits(rng: np.random.Generator, count: int) -> np.ndarray:
    """`count` fp16 bit patterns: half uniformly random finite ones, half from SPECIAL_FP16."""
    bits = rng.integers(0, 1 << 16, size=count, dtype=np.uint16)
    bits[(bits & 0x7C00) == 0x7C00] &= np.uint16(0xBFFF)  # an all-ones exponent is inf/NaN
    special = rng.random(count) < 0.5
    bits[special] = rng.choice(SPECIAL_FP16, size=int(special.sum()))
    return bits


def random_blocks(rng: np.random.Generator, quant_type: Q, shape: tuple[int, int],
                  fp16: np.ndarray | None = None) -> np.ndarray:
    """Random uint8 `[N, row bytes]` for an `[N, K]` tensor, its fp16 fields finite (or from `fp16`)."""
    n, k = shape
    block_size, type_size = GGML_QUANT_SIZES[quant_type]
    raw = rng.integers(0, 256, size=(n, k // block_size * type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, type_size)
    for start in FP16_FIELDS[quant_type]:
        values = finite_fp16_bits(rng, len(blocks)) if fp16 is None else rng.choice(fp16, len(blocks)).view(np.uint16)
        blocks[:, start:start + 2] = values.view(np.uint8).reshape(-1, 2)
    return raw


def assert_same_as_gguf(raw: np.ndarray, quant_type: Q, shape: tuple[int, int]) -> None:
    """`packed_from_gguf(...).dequantize()` holds gguf-py's floats, bit for bit (see SIGNED_ZERO_MAY_DIFFER)."""
    packed = packed_from_gguf(raw, quant_type, shape)
    assert (packed.bits, packed.group_size) == LAYOUT[quant_type]
    ours = packed.dequantize().numpy()
    expected = gguf.quants.dequantize(raw, quant_type).reshape(shape)
    assert np.isfinite(expected).all()
    np.testing.assert_array_equal(ours, expected)  # −0.0 == +0.0 here
    if quant_type in SIGNED_ZERO_MAY_DIFFER:  # adding +0.0 turns −0.0 into +0.0 and changes nothing else
        ours, expected = ours + np.float32(0), expected + np.float32(0)
    np.testing.assert_array_equal(ours.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("quant_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows, blocks_per_row", [(1, 1), (3, 3), (17, 4), (2, 32)])
def test_random_blocks_decode_to_gguf_pys_floats(quant_type, rows, blocks_per_row):
    rng = np.random.default_rng([int(quant_type), rows, blocks_per_row])
    shape = (rows, GGML_QUANT_SIZES[quant_type][0] * blocks_per_row)
    assert_same_as_gguf(random_blocks(rng, quant_type, shape), quant_type, shape)


@pytest.mark.parametrize("quant_type", TYPES, ids=lambda t: t.name)
def test_degenerate_scales(quant_type):
    """All-zero, all-largest and all-negative block scales, where signs of zeros and overflow would show."""
    rng = np.random.default_rng(int(quant_type))
    shape = (4, 2 * GGML_QUANT_SIZES[quant_type][0])
    for value in (0.0, -0.0, 65504.0, -65504.0, -3.5e-3):
        raw = random_blocks(rng, quant_type, shape, fp16=np.array([value], dtype=np.float16))
        assert_same_as_gguf(raw, quant_type, shape)


@pytest.mark.parametrize("quant_type", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
def test_round_trip_of_real_data_quantized_by_gguf_py(quant_type):
    """gguf-py quantizes these types itself: its blocks of a real weight decode to its floats."""
    weight = np.random.default_rng(0).standard_normal((48, 320)).astype(np.float32) * 0.05
    raw = gguf.quants.quantize(weight, quant_type)
    assert_same_as_gguf(raw, quant_type, weight.shape)
    decoded = packed_from_gguf(raw, quant_type, weight.shape).dequantize().numpy()
    step = np.abs(weight).max() / (127 if quant_type == Q.Q8_0 else 7)
    np.testing.assert_allclose(decoded, weight, rtol=0, atol=step)


@pytest.mark.parametrize("quant_type", TYPES, ids=lambda t: t.name)
def test_codes_fit_their_bits(quant_type):
    rng = np.random.default_rng(1)
    shape = (8, 512)
    packed = packed_from_gguf(random_blocks(rng, quant_type, shape), quant_type, shape)
    top = {Q.Q5_K: 31, Q.Q6_K: 63}.get(quant_type, 2**packed.bits - 1)
    codes = packed.unpacked_codes()
    assert int(codes.max()) == top and int(codes.min()) == 0  # random blocks use every code


def test_raw_of_any_shape_and_read_only():
    """A GGUFReader memmap is read-only and `[N, row bytes]`; a flat buffer works too."""
    rng = np.random.default_rng(2)
    raw = random_blocks(rng, Q.Q4_K, (3, 512))
    raw.flags.writeable = False
    packed = packed_from_gguf(raw, Q.Q4_K, (3, 512))
    assert torch.equal(packed.codes, packed_from_gguf(raw.ravel(), Q.Q4_K, (3, 512)).codes)


@pytest.mark.parametrize("quant_type", TYPES, ids=lambda t: t.name)
def test_a_vocabulary_sized_tensor_decodes_well_under_a_second(quant_type):
    """SmolLM2's 49152×576 embedding size (768 wide for the K-quants): vectorized, no loop over blocks."""
    shape = (49152, 576 if GGML_QUANT_SIZES[quant_type][0] == 32 else 768)
    raw = random_blocks(np.random.default_rng(3), quant_type, shape)
    start = time.perf_counter()
    packed_from_gguf(raw, quant_type, shape)
    assert time.perf_counter() - start < 2.0  # about 0.1 s on 2 cores; the margin is for loaded CI


def test_type_checks_and_refusals():
    assert not any(is_quantized_type(t) for t in (Q.F32, Q.F16, Q.BF16))
    assert all(is_quantized_type(t) for t in (*TYPES, Q.Q2_K, Q.IQ4_XS))
    assert set(TYPES) == SUPPORTED_TYPES and not is_supported_type(Q.Q2_K) and not is_supported_type(Q.F16)
    raw = np.zeros((2, 18), dtype=np.uint8)
    with pytest.raises(ValueError, match="Q2_K is not supported"):
        packed_from_gguf(np.zeros((1, 84), dtype=np.uint8), Q.Q2_K, (1, 256))
    with pytest.raises(ValueError, match="whole blocks of 32"):
        packed_from_gguf(raw, Q.Q4_0, (2, 16))
    with pytest.raises(ValueError, match="36 uint8 bytes, got 18"):
        packed_from_gguf(raw[:1], Q.Q4_0, (2, 32))
