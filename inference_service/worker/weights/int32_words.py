"""Codes packed into int32 words, the lowest bits first: how GPTQ, AWQ and compressed-tensors store
4- and 8-bit codes (`32 // bits` per word, none straddling a word for these widths).

Reading goes through the words' bytes (a view, little-endian order) rather than shifts of int32:
4-bit byte j of a word holds codes 2j (low nibble) and 2j+1 (high nibble), which is already the
canonical `PackedWeight.codes` pairing, so codes packed along K need no unpacking at all.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from inference_service.errors import ModelLoadError


def le_bytes(words: Tensor) -> Tensor:
    """int32 [..., W] → uint8 [..., 4·W], each word's bytes lowest first (the packing order)."""
    data = words.contiguous().view(torch.uint8)
    if sys.byteorder == "big":  # a view has the host's byte order
        data = data.view(*words.shape, 4).flip(-1).reshape(*words.shape[:-1], -1)
    return data


def unpack_words(words: Tensor, bits: int, count: int) -> Tensor:
    """int32 words packed along the last dim → uint8 codes [..., count]."""
    data = le_bytes(words)
    if bits == 4:
        data = torch.stack((data & 0x0F, data >> 4), dim=-1).flatten(-2)
    return data[..., :count].contiguous()


def pack_words(codes: Tensor, bits: int) -> Tensor:
    """uint8 codes [..., C] → int32 words [..., ceil(C·bits/32)] packed along the last dim (zero-padded);
    the inverse of `unpack_words`."""
    per_word = 32 // bits
    width = -(-codes.shape[-1] // per_word) * per_word
    data = torch.nn.functional.pad(codes.to(torch.uint8), (0, width - codes.shape[-1]))
    if bits == 4:
        data = data[..., 0::2] | (data[..., 1::2] << 4)
    data = data.contiguous()
    if sys.byteorder == "big":
        data = data.view(*data.shape[:-1], -1, 4).flip(-1).flatten(-2).contiguous()
    return data.reshape(-1).view(torch.int32).view(*data.shape[:-1], -1)  # flat: size-1 dims' strides vary


def canonical_codes(words: Tensor, bits: int, k: int) -> Tensor:
    """int32 [N, W] packed along K → the canonical `codes` ([N, ceil(K/2)] 4-bit, [N, K] 8-bit) as bytes."""
    data = le_bytes(words)
    if bits == 8:
        return data[:, :k].contiguous()
    codes = data[:, : -(-k // 2)].clone()
    if k % 2:
        codes[:, -1] &= 0x0F  # the canonical layout leaves a last odd k's high nibble 0
    return codes


def add_words(words: Tensor, addend: int) -> Tensor:
    """int32 words + addend modulo 2**32, as unsigned words: carries cross fields."""
    total = ((words.long() & 0xFFFFFFFF) + addend) & 0xFFFFFFFF
    return torch.where(total >= 1 << 31, total - (1 << 32), total).to(torch.int32)


def check_shape(what: str, tensor: Tensor, shape: tuple[int | None, ...]) -> None:
    """A `ModelLoadError` unless `tensor` has `shape` (None: a dimension checked elsewhere)."""
    ok = tensor.dim() == len(shape) and all(
        want is None or got == want for got, want in zip(tensor.shape, shape, strict=True)
    )
    if not ok:
        wanted = ", ".join("*" if want is None else str(want) for want in shape)
        raise ModelLoadError(f"{what} has shape {tuple(tensor.shape)}, expected [{wanted}]")
