"""The panel layout: how fp32 weights (PanelledLinear) and 8-bit codes (QuantLinear) are stored so one
kernel reads them at any row count.

A weight `[N, K]` keeps its rows; a GEMM wants, at each k, a run of output columns side by side.
So weights whose output size is a multiple of PANEL are stored as panels of PANEL output rows,
k-major: `panels[p, k, j]` is `w[p * PANEL + j, k]` (for codes, `scales`/`offsets[p, g, j]` likewise).
The kernels (`csrc/panel_linear.cpp`) then stream each panel once per step, one line of PANEL
outputs per k, with no per-call repacking. The same bytes, rearranged once at load.

4-bit codes keep the canonical layout (packed.py): their kernel reads two codes per byte along k.
"""

from __future__ import annotations

from torch import Tensor

from inference_service.worker.kernels.packed import PackedWeight

PANEL = 32  # output rows per panel (the kernel's tile width with AVX-512; two tiles with AVX2)


def takes(packed: PackedWeight) -> bool:
    """Whether the weight is stored in panels: 8-bit codes, output size a positive multiple of PANEL."""
    return packed.bits == 8 and packed.out_features > 0 and packed.out_features % PANEL == 0


def to_panels(packed: PackedWeight) -> tuple[Tensor, Tensor, Tensor]:
    """(codes [N/P, K, P], scales [N/P, G, P], offsets [N/P, G, P]), contiguous."""
    return panelled(packed.codes), panelled(packed.scales), panelled(packed.offsets)


def from_panels(codes: Tensor, scales: Tensor, offsets: Tensor, group_size: int, in_features: int) -> PackedWeight:
    """The canonical PackedWeight of panelled buffers (a copy)."""
    return PackedWeight(8, rows_of(codes), rows_of(scales), rows_of(offsets), group_size, in_features)


def panelled(rows: Tensor) -> Tensor:
    """[N, W] (N a multiple of PANEL) → [N/P, W, P], contiguous."""
    n, width = rows.shape
    return rows.reshape(n // PANEL, PANEL, width).transpose(1, 2).contiguous()


def rows_of(panels: Tensor) -> Tensor:
    """[N/P, W, P] → [N, W], contiguous (a copy)."""
    count, width, _ = panels.shape
    return panels.transpose(1, 2).reshape(count * PANEL, width).contiguous()
