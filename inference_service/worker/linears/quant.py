"""`QuantLinear`: a linear layer over a PackedWeight, computed from the packed codes.

The packed tensors are buffers (`codes`, `scales`, `offsets`), so `.to()`, `state_dict()` and the
engine's memory accounting see them; `.packed` gives them as a PackedWeight. 8-bit codes whose rows
fill panels are stored in the panel layout (kernels/panels.py) and, on CPU in fp32 with the native
library, computed by the panel GEMM; an LM head's (a GGUF's Q8_0 head) up to MAX_FEW_PANEL_ROWS rows
by a few-row kernel that reads them about twice as fast (`use_few_row_panels`). Other codes keep the
canonical layout: up to MAX_QUANT_ROWS rows (decode steps; 8 or 16 by bits) go to the packed-weight
kernel, which reads the codes directly, and more (prefill, large batches) to the panel GEMM, which
widens each panel of codes as it packs it. Other dtypes or devices, or no native library: the weight
is dequantized to x's dtype in slices of output rows and multiplied by torch's GEMM, which keeps the
temporary fp32 weight small. With `INFERENCE_SERVICE_QUANT_ACTIVATIONS=int8` the few-row path of
4-bit codes rounds x to int8 and uses integer dot products instead (kernels/int8_activations.py;
opt-in: numerics change).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from inference_service.worker.kernels import bindings, int8_activations, linear_bindings, panels
from inference_service.worker.kernels.packed import PackedWeight

# fp32 weight elements dequantized at once: 4 MiB, a whole projection of the demo model (one GEMM
# each; 1 MiB slices made its prefill 7% slower), the head in slices.
DEQUANT_SLICE_ELEMENTS = 1 << 20
_UNRESOLVED = object()


class _FewRows:
    """A packed-weight kernel bound to one layer's weight: x [..., K] fp32 → [..., N] for up to
    `max_rows` rows, with the weight's pointers and sizes taken once (a decode step makes ~120 of
    these calls; the kernels' own __call__ looks them up each time). It keeps the weight's tensors,
    so the pointers stay valid; QuantLinear makes a new one whenever its buffers change (repoint,
    `.to()`). The int8-activation kernel reads fp16 copies of the scales and offsets where they are
    exact (Int8ActivationLinear.compact_factors): fewer bytes a step, the same results."""

    def __init__(
        self,
        kernel: bindings.QuantLinearKernel | int8_activations.Int8ActivationLinear,
        packed: PackedWeight,
        bias: torch.Tensor | None,
        max_rows: int,
    ):
        self.packed, self.bias = packed, bias
        self.max_elements = max_rows * packed.in_features
        self.fn = kernel._fn  # the kernels' C entry points take the same arguments
        self.factors = packed.scales, packed.offsets
        if isinstance(kernel, int8_activations.Int8ActivationLinear):
            compact = kernel.compact_factors(packed)
            if compact is not None:
                self.fn, self.factors = kernel.fn_f16, compact
        self.pointers = (
            packed.codes.data_ptr(),
            self.factors[0].data_ptr(),
            self.factors[1].data_ptr(),
            bias.data_ptr() if bias is not None else None,
        )
        self.sizes = (packed.out_features, packed.in_features, packed.bits, packed.group_size)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.sizes[0], self.sizes[1]
        x = x.contiguous()
        rows = x.numel() // k
        out = x.new_empty(*x.shape[:-1], n)
        if rows and self.fn(x.data_ptr(), *self.pointers, out.data_ptr(), rows, n, k, *self.sizes[2:]) != 0:
            raise RuntimeError(f"the packed-weight kernel refused x {list(x.shape)} for {self.packed.bits}-bit codes")
        return out


_Kernels = tuple[
    bindings.QuantLinearKernel | None,
    bool,
    bindings.PanelLinear | None,
    _FewRows | linear_bindings.PanelCodesFewRows | None,
]


class QuantLinear(torch.nn.Module):
    """y = x[..., input_perm] · dequant(packed)ᵀ + bias, for x [..., K] → y [..., N].

    8-bit codes whose output size is a multiple of panels.PANEL are stored in the panel layout
    (`panelled`; see panels.py); others in the canonical one.
    """

    few_row_panels = False  # use_few_row_panels()

    # Buffers (register_buffer in __init__), declared for the type checker: nn.Module's
    # __getattr__ types them as `Tensor | Module`.
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    bias: torch.Tensor | None
    input_perm: torch.Tensor | None

    def __init__(
        self,
        packed: PackedWeight,
        bias: torch.Tensor | None = None,
        input_perm: torch.Tensor | None = None,
        panelled: bool | None = None,
    ):
        super().__init__()
        self.bits, self.group_size = packed.bits, packed.group_size
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.panelled = panels.takes(packed) if panelled is None else panelled
        if self.panelled and not panels.takes(packed):
            raise ValueError(f"{packed.bits}-bit codes of {packed.out_features} rows do not fill panels")
        codes, scales, offsets = (
            panels.to_panels(packed) if self.panelled else (packed.codes, packed.scales, packed.offsets)
        )
        self.register_buffer("codes", codes.contiguous())  # uint8 [N, K] or [N, ceil(K / 2)]; panelled [N/P, K, P]
        self.register_buffer("scales", scales.contiguous())  # fp32 [N, G]; panelled [N/P, G, P]
        self.register_buffer("offsets", offsets.contiguous())  # fp32 [N, G]; panelled [N/P, G, P]
        self.register_buffer("bias", None if bias is None else bias.contiguous())  # [N]
        self.register_buffer("input_perm", input_perm)  # int64 [K]: GPTQ's act-order
        self._view: PackedWeight | None = None
        # resolved on first use, again after the buffers move
        self._kernel: _Kernels | object = _UNRESOLVED

    @classmethod
    def from_packed(
        cls, packed: PackedWeight, bias: torch.Tensor | None = None, input_perm: torch.Tensor | None = None
    ) -> QuantLinear:
        return cls(packed, bias, input_perm)

    @property
    def rows_per_entry(self) -> int:
        """Output rows per index of the buffers' first dimension (a panel's, or one)."""
        return panels.PANEL if self.panelled else 1

    @property
    def packed(self) -> PackedWeight:
        """The buffers as a canonical PackedWeight: a view (rebuilt when `.to()` has replaced them),
        or for panelled codes a copy."""
        if self.panelled:
            return panels.from_panels(self.codes, self.scales, self.offsets, self.group_size, self.in_features)
        view = self._view
        if (
            view is None
            or view.codes is not self.codes
            or view.scales is not self.scales
            or view.offsets is not self.offsets
        ):
            view = self._view = PackedWeight(
                self.bits, self.codes, self.scales, self.offsets, self.group_size, self.in_features
            )
            self._kernel = _UNRESOLVED
        return view

    def repoint(self, **buffers: torch.Tensor) -> None:
        """Use these tensors (same layout and shapes) as buffers: fusing shares one copy of weights."""
        for name, tensor in buffers.items():
            setattr(self, name, tensor)
        self._kernel = _UNRESOLVED

    def _apply(self, fn, recurse=True):
        """`.to(dtype)` moves but does not round scales and offsets: PackedWeight keeps them fp32."""
        kept = {name: getattr(self, name) for name in ("scales", "offsets")}
        super()._apply(fn, recurse)
        for name, original in kept.items():
            if getattr(self, name).dtype != torch.float32:
                setattr(self, name, original.to(getattr(self, name).device))
        self._kernel = _UNRESOLVED
        return self

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
            f"group_size={self.group_size}, bias={self.bias is not None}, "
            f"input_perm={self.input_perm is not None}, panelled={self.panelled}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = self._kernel if self._kernel is not _UNRESOLVED else self._native_kernels()
        few_rows = cast(_Kernels, kernels)[3]
        if (
            few_rows is not None
            and x.numel() <= few_rows.max_elements
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and not (x.requires_grad and torch.is_grad_enabled())
        ):
            return few_rows(x)  # decode steps: no buffer lookups on the way (~120 calls a step)
        if self.input_perm is not None:
            x = x[..., self.input_perm]
        kernel, fits, panel, _ = self._native_kernels()
        if (
            panel is not None
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and not (x.requires_grad and torch.is_grad_enabled())
        ):
            if self.panelled:
                return panel.codes(x, self.codes, self.scales, self.offsets, self.bias, self.group_size)
            if fits and kernel is not None and x.numel() <= bindings.MAX_QUANT_ROWS[self.bits] * self.in_features:
                return kernel(x, self.packed, self.bias)  # input_perm's rows
            if panel.takes(self.in_features):
                return panel.quant(x, self.packed, self.bias)
        return dequantized_linear(x, self.packed, self.bias, kernel)

    def use_few_row_panels(self) -> None:
        """Send up to MAX_FEW_PANEL_ROWS rows of codes in panels to their few-row kernel (an LM head).
        Off by default: the fused decode layers call the panels' tiles, and a layer computes op by op
        what they compute, to the bit."""
        self.few_row_panels = True
        self._kernel = _UNRESOLVED

    def native_calls(self) -> tuple[bool, _FewRows | None]:
        """Whether forward computes fp32 CPU rows natively (the panel GEMM is there), and its bound
        few-rows call over canonical codes (None: the panel GEMM takes every row count; codes in
        panels, whose few-row kernel only forward calls), for the fused decode layers
        (runner/fused_layers.py), which call the same kernels."""
        _, _, panel, few_rows = self._native_kernels()
        return panel is not None, few_rows if isinstance(few_rows, _FewRows) else None

    def _native_kernels(self) -> _Kernels:
        """The native library's packed-weight kernel (None: torch only), whether it takes these
        canonical codes, its panel GEMM (None where the library or the bias does not apply), and the
        call for few rows (None where it does not fit or input_perm applies): the packed-weight kernel,
        or the int8-activation one where asked for, bound to this layer's buffers."""
        if self._kernel is _UNRESOLVED:
            device = self.codes.device
            kernel = bindings.quant_kernel_for(device, self.scales.dtype)
            if kernel is not None and not all(t.is_contiguous() for t in (self.codes, self.scales, self.offsets)):
                kernel = None
            bias_ok = self.bias is None or (self.bias.dtype == torch.float32 and self.bias.is_contiguous())
            panel = bindings.panel_kernel_for(device, self.scales.dtype) if kernel is not None and bias_ok else None
            fits = kernel is not None and bias_ok and not self.panelled and kernel.supports(self.packed)
            few_rows: _FewRows | linear_bindings.PanelCodesFewRows | None = None
            if fits and kernel is not None and panel is not None and self.input_perm is None:
                chosen = int8_activations.kernel_for(self.packed, device, self.scales.dtype) or kernel
                few_rows = _FewRows(chosen, self.packed, self.bias, bindings.MAX_QUANT_ROWS[self.bits])
            elif self.panelled and self.few_row_panels and panel is not None and self.input_perm is None:
                few_rows = panel.few_rows(self.codes, self.scales, self.offsets, self.bias, self.group_size)
            self._kernel = kernel, fits, panel, few_rows
        return cast(_Kernels, self._kernel)


def dequantized_linear(
    x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, kernel: bindings.QuantLinearKernel | None = None
) -> torch.Tensor:
    """Dequantize slices of output rows to x's dtype and multiply by torch's GEMM; x [..., K] → [..., N].

    With `kernel`, the slices are dequantized natively (one pass); else by PackedWeight.dequantize.
    """
    n, k = packed.out_features, packed.in_features
    step = max(1, DEQUANT_SLICE_ELEMENTS // max(k, 1))
    out = x.new_empty(*x.shape[:-1], n) if step < n else None
    for n0 in range(0, n, step):
        n1 = min(n, n0 + step)
        part = (
            packed
            if out is None
            else PackedWeight(
                packed.bits, packed.codes[n0:n1], packed.scales[n0:n1], packed.offsets[n0:n1], packed.group_size, k
            )
        )
        weight = (kernel.dequantize(part) if kernel is not None else part.dequantize()).to(x.dtype)  # [n1-n0, K]
        part_bias = None if bias is None else bias[n0:n1].to(x.dtype)
        if out is None:
            return F.linear(x, weight, part_bias)
        out[..., n0:n1] = F.linear(x, weight, part_bias)
    return out if out is not None else x.new_empty(*x.shape[:-1], 0)
