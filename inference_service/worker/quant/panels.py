"""The panel layout of 8-bit codes: how QuantLinear stores them, so one kernel reads them at any row count.

The canonical layout (packed.py) keeps a weight's rows: `codes[n, k]`. A GEMM wants, at each k, a
run of output columns side by side. So 8-bit codes whose output size is a multiple of PANEL are
stored as panels of PANEL output rows, k-major: `codes[p, k, j]` is code `[p * PANEL + j, k]`, and
`scales`/`offsets[p, g, j]` likewise. The kernel (`csrc/panel_linear.cpp`, panel_codes_linear_f32)
then streams each panel's codes once per step, one 32-byte line per k, with no per-call repacking.
The same bytes as the canonical layout, rearranged once at load.

4-bit codes keep the canonical layout: their kernel already reads two codes per byte along k.
"""

from __future__ import annotations

from torch import Tensor

from inference_service.worker.quant.packed import PackedWeight

PANEL = 32  # output rows per panel (the kernel's tile width with AVX-512; two tiles with AVX2)


def takes(packed: PackedWeight) -> bool:
    """Whether the weight is stored in panels: 8-bit codes, output size a positive multiple of PANEL."""
    return packed.bits == 8 and packed.out_features > 0 and packed.out_features % PANEL == 0


def to_panels(packed: PackedWeight) -> tuple[Tensor, Tensor, Tensor]:
    """(codes [N/P, K, P], scales [N/P, G, P], offsets [N/P, G, P]), contiguous."""
    return tuple(_panelled(t) for t in (packed.codes, packed.scales, packed.offsets))


def from_panels(codes: Tensor, scales: Tensor, offsets: Tensor, group_size: int, in_features: int) -> PackedWeight:
    """The canonical PackedWeight of panelled buffers (a copy)."""
    return PackedWeight(8, _rows(codes), _rows(scales), _rows(offsets), group_size, in_features)


def _panelled(rows: Tensor) -> Tensor:
    n, width = rows.shape
    return rows.reshape(n // PANEL, PANEL, width).transpose(1, 2).contiguous()


def _rows(panels: Tensor) -> Tensor:
    count, width, _ = panels.shape
    return panels.transpose(1, 2).reshape(count * PANEL, width).contiguous()
