"""The one layout every quantized checkpoint is repacked into at load, and its torch reference.

Every scheme we serve is a group-wise affine code: `w[n, k] = scales[n, g] * code[n, k] + offsets[n, g]`
with `g = k // group_size`. GPTQ and AWQ (`scale * (q - zero)`), GGUF's Q4_0/Q4_1/Q8_0 and K-quants
(sub-block scales and mins), EETQ and LLM.int8-style per-channel int8 (`group_size = K`) all say this
once their zero points and super-block scales are folded into fp32 `scales` and `offsets`. So two
kernels serve them all: 4-bit codes and 8-bit codes.

- `codes` uint8: bits=8 → `[N, K]`, one code per byte (0..255; signed schemes add 128 and fold
  `-128 * scale` into the offset); bits=4 → `[N, ceil(K / 2)]`, two codes per byte, the even k in
  the low nibble, the odd k in the high nibble (a last odd k leaves its high nibble 0).
- `scales`, `offsets` fp32 `[N, ceil(K / group_size)]`; the last group may be partial.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

BITS = (4, 8)


@dataclass
class PackedWeight:
    """A quantized `[N, K]` weight in the canonical layout (see the module docstring)."""

    bits: int
    codes: Tensor  # uint8 [N, K] or [N, ceil(K / 2)]
    scales: Tensor  # fp32 [N, G]
    offsets: Tensor  # fp32 [N, G]
    group_size: int
    in_features: int

    def __post_init__(self) -> None:
        n, k = self.out_features, self.in_features
        groups = -(-k // self.group_size)
        width = k if self.bits == 8 else -(-k // 2)
        if self.bits not in BITS:
            raise ValueError(f"packed weights have 4- or 8-bit codes, not {self.bits}")
        if self.codes.dtype != torch.uint8 or tuple(self.codes.shape) != (n, width):
            raise ValueError(f"codes must be uint8 [{n}, {width}], got {self.codes.dtype} {tuple(self.codes.shape)}")
        for name in ("scales", "offsets"):
            tensor = getattr(self, name)
            if tensor.dtype != torch.float32 or tuple(tensor.shape) != (n, groups):
                raise ValueError(f"{name} must be float32 [{n}, {groups}], got {tensor.dtype} {tuple(tensor.shape)}")

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets))

    def unpacked_codes(self) -> Tensor:
        """The codes one per element, uint8 `[N, K]`."""
        if self.bits == 8:
            return self.codes
        low, high = self.codes & 0x0F, self.codes >> 4
        return torch.stack([low, high], dim=-1).flatten(1)[:, : self.in_features]  # [N, K]

    def dequantize(self) -> Tensor:
        """The fp32 `[N, K]` weight: the reference every kernel is checked against."""
        k = self.in_features
        scales = self.scales.repeat_interleave(self.group_size, dim=1)[:, :k]  # [N, K]
        offsets = self.offsets.repeat_interleave(self.group_size, dim=1)[:, :k]  # [N, K]
        return self.unpacked_codes().float() * scales + offsets


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """uint8 codes `[N, K]` (values < 2**bits) → the canonical `codes` tensor."""
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes.contiguous()
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError("4-bit codes must be below 16")
    if codes.shape[1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def quantize_rtn(weight: Tensor, bits: int, group_size: int, symmetric: bool = False) -> PackedWeight:
    """Round-to-nearest quantization of an fp32 `[N, K]` weight: how test checkpoints are made.

    Asymmetric: codes 0..2**bits-1 spanning each group's [min, max]. Symmetric: codes centred on
    2**(bits-1), the scale from the group's largest magnitude (offsets = -centre * scale).
    """
    weight = weight.float()
    n, k = weight.shape
    groups = -(-k // group_size)
    padded = torch.nn.functional.pad(weight, (0, groups * group_size - k))
    grouped = padded.view(n, groups, group_size)  # [N, G, gs]
    valid = (torch.arange(groups * group_size) < k).view(1, groups, group_size)
    top = 2**bits - 1
    if symmetric:
        centre = 2 ** (bits - 1)
        magnitude = grouped.abs().masked_fill(~valid, 0).amax(dim=-1)  # [N, G]
        scales = torch.where(magnitude > 0, 2 * magnitude / top, torch.ones_like(magnitude))  # as GPTQ's sym
        offsets = -centre * scales
    else:
        low = grouped.masked_fill(~valid, float("inf")).amin(dim=-1)  # [N, G]
        high = grouped.masked_fill(~valid, float("-inf")).amax(dim=-1)  # [N, G]
        scales = torch.where(high > low, (high - low) / top, torch.ones_like(low))
        offsets = low
    codes = torch.round((grouped - offsets[..., None]) / scales[..., None]).clamp(0, top)
    codes = codes.view(n, groups * group_size)[:, :k].to(torch.uint8)
    return PackedWeight(
        bits=bits,
        codes=pack_codes(codes, bits),
        scales=scales.contiguous(),
        offsets=offsets.contiguous(),
        group_size=group_size,
        in_features=k,
    )
