"""GGUF (ggml) quantized blocks decoded straight into the canonical `PackedWeight`, never through fp32.

Each supported ggml type is a group-wise affine code, so its blocks only need their codes
re-laid-out and their fp16 block scales folded into fp32 `scales` / `offsets`:

| type | group | codes        | scale    | offset      | ggml's formula       |
|------|-------|--------------|----------|-------------|----------------------|
| Q4_0 | 32    | 4-bit q      | d        | -8·d        | d·(q − 8)            |
| Q4_1 | 32    | 4-bit q      | d        | m           | d·q + m              |
| Q8_0 | 32    | 8-bit q+128  | d        | -128·d      | d·q (q int8)         |
| Q4_K | 32    | 4-bit q      | d·sc     | -(dmin·m)   | (d·sc)·q − dmin·m    |
| Q5_K | 32    | 8-bit q (5b) | d·sc     | -(dmin·m)   | (d·sc)·q − dmin·m    |
| Q6_K | 16    | 8-bit q (6b) | d·sc     | -32·(d·sc)  | (d·sc)·(q − 32)      |

Exactness against `gguf.quants.dequantize` (`PackedWeight.dequantize` computes `code·scale + offset`
in fp32, a multiply then an add): the block scales are fp16 and the codes and sub-scales small
integers, so every product above is exact in fp32 (at most 11 + 7 + 6 significant bits).
- Q4_1, Q4_K, Q5_K round exactly where gguf-py does (its one rounding is the final add/subtract),
  so they are bit-identical, signed zeros included.
- Q4_0, Q8_0, Q6_K: gguf-py computes `d·(q − c)` in one exact product; ours adds two exact terms
  whose exact sum is representable, so the value is identical too. Only the sign of a zero can
  differ: where gguf-py gets −0.0 (e.g. q = c with d < 0) the sum gives +0.0. Both compare equal
  and act identically in a matmul; no affine `code·scale + offset` can produce that −0.0.

F32, F16 and BF16 tensors (and the other block-size-1 types) are not quantized: the loader keeps them
as dense tensors; `is_quantized_type` tells the two kinds apart.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from inference_service.worker.kernels.packed import PackedWeight

QK_K = 256  # elements per K-quant super-block

# A decoder takes the tensor's blocks `[B, type_size]` uint8 and returns, per block, the codes in the
# canonical layout (`[B, block_size]` for 8-bit, `[B, block_size // 2]` for 4-bit) and the
# fp32 `scales` and `offsets` of its groups (`[B, groups_per_block]`).
Decoded = tuple[np.ndarray, np.ndarray, np.ndarray]


def is_quantized_type(quant_type: GGMLQuantizationType | int) -> bool:
    """Whether tensors of this ggml type are stored as quantized blocks (F32/F16/BF16 are not)."""
    block_size, _ = GGML_QUANT_SIZES[GGMLQuantizationType(quant_type)]
    return block_size > 1


def is_supported_type(quant_type: GGMLQuantizationType | int) -> bool:
    """Whether `packed_from_gguf` can decode this ggml type."""
    return GGMLQuantizationType(quant_type) in _DECODERS


def packed_from_gguf(raw: np.ndarray, quant_type: GGMLQuantizationType | int, shape: tuple[int, int]) -> PackedWeight:
    """The `[N, K]` weight held in `raw` (the tensor's blocks, uint8, any shape) as a `PackedWeight`.

    `shape` is in torch order (`[N, K]`, rows of K), the reverse of GGUF's `ne`. Rows of a ggml
    tensor are whole blocks, so each row's blocks end to end are that row of the packed weight.
    """
    quant_type = GGMLQuantizationType(quant_type)
    if quant_type not in _DECODERS:
        raise ValueError(
            f"GGUF type {quant_type.name} is not supported for packed weights "
            f"(supported: {', '.join(t.name for t in _DECODERS)})"
        )
    n, k = (int(size) for size in shape)
    block_size, type_size = GGML_QUANT_SIZES[quant_type]
    if k % block_size:
        raise ValueError(f"{quant_type.name} rows hold whole blocks of {block_size}, not {k} elements")
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.size != n * (k // block_size) * type_size:
        raise ValueError(
            f"a {quant_type.name} [{n}, {k}] tensor is {n * (k // block_size) * type_size} "
            f"uint8 bytes, got {raw.size} {raw.dtype}"
        )
    blocks = np.ascontiguousarray(raw).reshape(-1, type_size)  # [B, type_size]; a view of a memmap
    codes, scales, offsets = _DECODERS[quant_type](blocks)
    bits, group_size = _LAYOUT[quant_type]
    return PackedWeight(
        bits=bits,
        codes=_torch(codes.reshape(n, -1)),
        scales=_torch(scales.reshape(n, -1)),
        offsets=_torch(offsets.reshape(n, -1)),
        group_size=group_size,
        in_features=k,
    )


def _torch(array: np.ndarray) -> torch.Tensor:
    """The array as a torch tensor sharing its memory (arrays here are fresh, never views of the file)."""
    return torch.from_numpy(np.ascontiguousarray(array))


def _fp16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 field at byte `start` of every block, as fp32 `[B, 1]` (exact)."""
    return blocks[:, start : start + 2].view(np.float16).astype(np.float32)


def _repack_nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """ggml's 4-bit order → the canonical one, per block.

    ggml packs each run of `2·run` elements into `run` bytes: element j in the low nibble of byte j,
    element run + j in its high nibble. The canonical order puts elements 2i and 2i + 1 in byte i
    (low, high). qs `[B, C·run]` → `[B, C·run]`.
    """
    chunks = qs.reshape(qs.shape[0], -1, run)  # [B, C, run]
    even, odd = chunks[..., 0::2], chunks[..., 1::2]  # [B, C, run/2]: elements 2i and 2i+1 of each half
    first_half = (even & 0x0F) | (odd << 4)  # elements 0..run-1 come from the low nibbles
    second_half = (even >> 4) | (odd & 0xF0)  # elements run..2run-1 from the high nibbles
    return np.concatenate([first_half, second_half], axis=-1).reshape(qs.shape)


def _low_high_nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """ggml's 4-bit runs (see `_repack_nibbles`) as one code per element: `[B, C·run]` → `[B, 2·C·run]`."""
    chunks = qs.reshape(qs.shape[0], -1, 1, run)  # [B, C, 1, run]
    nibbles = (chunks >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F  # [B, C, 2, run]
    return nibbles.reshape(qs.shape[0], -1)


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's eight 6-bit sub-block scales and mins from their 12 bytes: `[B, 12]` → 2 × `[B, 8]`.

    Bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7 mins 0-3; bytes 8-11 hold the low 4 bits of
    scales/mins 4-7, whose top 2 bits sit in the top bits of bytes 0-3 / 4-7.
    """
    d, m, low = (packed[:, 4 * i : 4 * i + 4] for i in range(3))  # each [B, 4]
    scales = np.concatenate([d & 0x3F, (low & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scales, mins


def _q4_0(blocks: np.ndarray) -> Decoded:  # [d: f16][qs: 16 B]
    d = _fp16(blocks, 0)
    return _repack_nibbles(blocks[:, 2:], 16), d, d * np.float32(-8)


def _q4_1(blocks: np.ndarray) -> Decoded:  # [d: f16][m: f16][qs: 16 B]
    return _repack_nibbles(blocks[:, 4:], 16), _fp16(blocks, 0), _fp16(blocks, 2)


def _q8_0(blocks: np.ndarray) -> Decoded:  # [d: f16][qs: 32 × int8]
    d = _fp16(blocks, 0)
    return blocks[:, 2:] ^ np.uint8(0x80), d, d * np.float32(-128)  # int8 q → uint8 q + 128


def _k_affine(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's sub-block scales d·sc and offsets −dmin·m `[B, 8]`, in gguf-py's fp32 order."""
    sc, m = _k_scales_mins(blocks[:, 4:16])
    scales = _fp16(blocks, 0) * sc.astype(np.float32)
    offsets = -(_fp16(blocks, 2) * m.astype(np.float32))
    return scales, offsets


def _q4_k(blocks: np.ndarray) -> Decoded:  # [d][dmin][scales: 12 B][qs: 128 B]
    scales, offsets = _k_affine(blocks)
    return _repack_nibbles(blocks[:, 16:], 32), scales, offsets


def _q5_k(blocks: np.ndarray) -> Decoded:  # [d][dmin][scales: 12 B][qh: 32 B][qs: 128 B]
    scales, offsets = _k_affine(blocks)
    low = _low_high_nibbles(blocks[:, 48:], 32)  # [B, 256]
    qh = blocks[:, 16:48].reshape(-1, 1, 32)  # element 32·j + i's fifth bit is bit j of qh[i]
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1  # [B, 8, 32]
    return low | (high.reshape(low.shape) << 4), scales, offsets


def _q6_k(blocks: np.ndarray) -> Decoded:  # [ql: 128 B][qh: 64 B][scales: 16 × int8][d: f16]
    count = blocks.shape[0]
    # Two halves of 128 elements: low 4 bits from 64 bytes of ql (low nibbles, then high), top 2 bits
    # from 32 bytes of qh (bits 0-1, 2-3, 4-5, 6-7 for the four runs of 32).
    low = _low_high_nibbles(blocks[:, :128], 64)  # [B, 256]
    qh = blocks[:, 128:192].reshape(count, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3  # [B, 2, 4, 32]
    scales = _fp16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)  # [B, 16]
    return low | (high.reshape(count, QK_K) << 4), scales, scales * np.float32(-32)


_DECODERS: dict[GGMLQuantizationType, Callable[[np.ndarray], Decoded]] = {
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}

# (code bits, group size) of each type's packed form.
_LAYOUT: dict[GGMLQuantizationType, tuple[int, int]] = {
    GGMLQuantizationType.Q4_0: (4, 32),
    GGMLQuantizationType.Q4_1: (4, 32),
    GGMLQuantizationType.Q8_0: (8, 32),
    GGMLQuantizationType.Q4_K: (4, 32),
    GGMLQuantizationType.Q5_K: (8, 32),
    GGMLQuantizationType.Q6_K: (8, 16),
}

SUPPORTED_TYPES = frozenset(_DECODERS)
