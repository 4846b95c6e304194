"""Bindings of the native linear kernels: few rows from fp32 weights (csrc/small_batch_linear.cpp) or
bf16 ones (csrc/bf16_linear.cpp), the panel GEMM (csrc/panel_linear.cpp) and packed 4/8-bit weights
(csrc/quant_linear.cpp), with the row counts where each beats torch's GEMM."""

from __future__ import annotations

import ctypes

import torch

from inference_service.worker.kernels import native_build
from inference_service.worker.kernels.native_build import I64, POINTER, pointer
from inference_service.worker.kernels.packed import PackedWeight

# Up to this many rows the linear kernel beats torch's fp32 GEMM here (measured: 1.9x at 1 row,
# 2.2x at 8, 1.15x at 32, 1.1x at 48, 0.85x at 64); above it torch's GEMM is used.
MAX_LINEAR_ROWS = 32
# The same for bf16 weights (csrc/bf16_linear.cpp): torch's bf16 GEMM on CPU is slow at a few rows and
# has no such crossover measured yet, so the kernel takes the rows of decode steps and small batches.
MAX_BF16_LINEAR_ROWS = 32
# Up to this many rows (by bits of the codes) QuantLinear uses the packed-weight kernel, above it the
# panel GEMM. Measured over the demo model's projections, 2 threads (benchmarks/quant_kernels.py):
# 4-bit codes pack cheaper than they compute in the kernel from 8-12 rows, 8-bit ones from 16.
MAX_QUANT_ROWS = {4: 8, 8: 16}
# Up to this many rows, 8-bit codes stored in panels go to the few-row kernel
# (csrc/panel_codes_few_rows.cpp; its kMaxRows), above it to the panel GEMM's tiles.
MAX_FEW_PANEL_ROWS = 8
# Above those row counts the panel GEMM computes, for inputs up to this wide (its panel of 32 columns,
# K x 128 bytes, then still sits in L2). Measured on the demo model's projections, 2 threads, against
# torch's fp32 GEMM: 1.3x at 33-256 rows, 1.07x at 512, 1.05x at 1024.
MAX_PANEL_K = 8192


class SmallBatchLinear:
    """x [..., K] · weight [N, K]ᵀ (+ bias) → [..., N], for at most MAX_LINEAR_ROWS rows of x."""

    dtype = torch.float32  # of x, weight, bias and the result
    symbol = "small_batch_linear_f32"
    kind = "linear kernel"

    def __init__(self, library: ctypes.CDLL):
        self._fn = native_build.bind(library, self.symbol, [POINTER] * 4 + [I64] * 3)

    @classmethod
    def supports_weight(cls, weight: torch.Tensor) -> bool:
        return (
            weight.dtype == cls.dtype
            and weight.device.type == "cpu"
            and weight.dim() == 2
            and weight.is_contiguous()
            and weight.shape[1] % 8 == 0
        )

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """weight [N, K] and bias [N] (or None) contiguous, all of `dtype`."""
        out_features, in_features = weight.shape
        x = x.contiguous()
        rows = x.numel() // in_features
        out = x.new_empty(*x.shape[:-1], out_features)
        if rows == 0:  # a step that keeps no logits still runs the head on zero rows
            return out
        status = self._fn(
            x.data_ptr(), weight.data_ptr(), pointer(bias), out.data_ptr(), rows, out_features, in_features
        )
        if status != 0:
            raise RuntimeError(f"{self.kind} refused {rows} rows of {in_features} features")
        return out


class BF16Linear(SmallBatchLinear):
    """x [..., K] · weight [N, K]ᵀ (+ bias) → [..., N], all bfloat16, fp32 accumulation, for a few rows."""

    dtype = torch.bfloat16
    symbol = "small_batch_linear_bf16"
    kind = "bf16 linear kernel"

    def __init__(self, library: ctypes.CDLL):
        super().__init__(library)
        self.uses_dot_product = bool(native_build.bind(library, "bf16_linear_uses_dot_product", [])())


class PanelLinear:
    """x [..., K] · W[N, K]ᵀ (+ bias) → [..., N] for many rows of x, W fp32 or packed (csrc/panel_linear.cpp)."""

    def __init__(self, library: ctypes.CDLL):
        self._fn = native_build.bind(library, "panel_linear_f32", [POINTER] * 4 + [I64] * 3)
        self._quant = native_build.bind(library, "panel_quant_linear_f32", [POINTER] * 6 + [I64] * 5)
        self._codes = native_build.bind(library, "panel_codes_linear_f32", [POINTER] * 6 + [I64] * 4)
        self._panels = native_build.bind(library, "panel_weights_linear_f32", [POINTER] * 4 + [I64] * 3)
        self._library = library

    @staticmethod
    def takes(in_features: int) -> bool:
        return 0 < in_features <= MAX_PANEL_K

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """weight fp32 [N, K] contiguous; bias fp32 [N] contiguous or None."""
        x, out, rows = self._operands(x, weight.shape[0], weight.shape[1])
        if rows:
            self._check(
                self._fn(
                    x.data_ptr(),
                    weight.data_ptr(),
                    pointer(bias),
                    out.data_ptr(),
                    rows,
                    weight.shape[0],
                    weight.shape[1],
                ),
                weight.shape[1],
            )
        return out

    def quant(self, x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """The same over a packed weight (contiguous buffers), widened to fp32 as dequantize() does."""
        k, n = packed.in_features, packed.out_features
        x, out, rows = self._operands(x, n, k)
        if rows:
            self._check(
                self._quant(
                    x.data_ptr(),
                    packed.codes.data_ptr(),
                    packed.scales.data_ptr(),
                    packed.offsets.data_ptr(),
                    pointer(bias),
                    out.data_ptr(),
                    rows,
                    n,
                    k,
                    packed.bits,
                    packed.group_size,
                ),
                k,
            )
        return out

    def codes(
        self,
        x: torch.Tensor,
        codes: torch.Tensor,
        scales: torch.Tensor,
        offsets: torch.Tensor,
        bias: torch.Tensor | None,
        group_size: int,
    ) -> torch.Tensor:
        """x · W ᵀ (+ bias) for 8-bit codes in the panel layout (kernels/panels.py), any number of rows:
        codes [N/32, K, 32], scales and offsets [N/32, G, 32], all contiguous."""
        panel_count, k, width = codes.shape
        n = panel_count * width
        x, out, rows = self._operands(x, n, k)
        if rows:
            self._check(
                self._codes(
                    x.data_ptr(),
                    codes.data_ptr(),
                    scales.data_ptr(),
                    offsets.data_ptr(),
                    pointer(bias),
                    out.data_ptr(),
                    rows,
                    n,
                    k,
                    group_size,
                ),
                k,
            )
        return out

    def panels(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x · Wᵀ (+ bias) for an fp32 weight stored in panels (linears/panelled.py), any number of
        rows: panels [N/32, K, 32] contiguous."""
        panel_count, k, width = panels.shape
        n = panel_count * width
        x, out, rows = self._operands(x, n, k)
        if rows:
            self._check(self._panels(x.data_ptr(), panels.data_ptr(), pointer(bias), out.data_ptr(), rows, n, k), k)
        return out

    def few_rows(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        offsets: torch.Tensor,
        bias: torch.Tensor | None,
        group_size: int,
    ) -> PanelCodesFewRows:
        """The few-row kernel bound to 8-bit codes in the panel layout (as `codes` takes them)."""
        return PanelCodesFewRows(self._library, codes, scales, offsets, bias, group_size)

    @staticmethod
    def _operands(x: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """x contiguous, the output [..., n], and the number of rows."""
        return x.contiguous(), x.new_empty(*x.shape[:-1], n), x.numel() // k

    @staticmethod
    def _check(status: int, k: int) -> None:
        if status != 0:
            raise RuntimeError(f"panel linear kernel refused an input of {k} features")


class PanelCodesFewRows:
    """x [..., K] · Wᵀ (+ bias) → [..., N] for at most MAX_FEW_PANEL_ROWS rows, W 8-bit codes in the
    panel layout (csrc/panel_codes_few_rows.cpp), bound to one weight. It reads fp16 copies of the
    scales and offsets where every value survives the round trip, and no offsets where each is -128
    times its scale (GGUF's Q8_0): a decode step of one stream reads the head's bytes once, and fp32
    factors were a fifth of them. It keeps the tensors it points at (the fp16 copies: 2 or 4 bytes per
    group of 32 codes, besides the module's fp32 factors)."""

    def __init__(
        self,
        library: ctypes.CDLL,
        codes: torch.Tensor,
        scales: torch.Tensor,
        offsets: torch.Tensor,
        bias: torch.Tensor | None,
        group_size: int,
    ):
        panel_count, k, width = codes.shape
        self.out_features, self.in_features, self.group_size = panel_count * width, k, group_size
        self.max_elements = MAX_FEW_PANEL_ROWS * k
        self.symmetric = torch.equal(offsets, scales * -128)  # offsets not read
        half_scales, half_offsets = scales.half(), offsets.half()
        self.factor_dtype = torch.float32
        if torch.equal(half_scales.float(), scales) and torch.equal(half_offsets.float(), offsets):
            self.factor_dtype, scales, offsets = torch.float16, half_scales, half_offsets
        symbol = "panel_codes_few_rows_f16" if self.factor_dtype == torch.float16 else "panel_codes_few_rows_f32"
        self._fn = native_build.bind(library, symbol, [POINTER] * 6 + [I64] * 4)
        kept_offsets = None if self.symmetric else offsets
        self._tensors = codes, scales, kept_offsets, bias  # alive while the pointers are used
        self._weight = (codes.data_ptr(), scales.data_ptr(), pointer(kept_offsets), pointer(bias))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        x = x.contiguous()
        rows = x.numel() // k
        out = x.new_empty(*x.shape[:-1], n)
        if rows and self._fn(x.data_ptr(), *self._weight, out.data_ptr(), rows, n, k, self.group_size) != 0:
            raise RuntimeError(f"the few-row panel kernel refused x {list(x.shape)}")
        return out


class QuantLinearKernel:
    """x [..., K] · dequant(packed)ᵀ (+ bias) → [..., N] straight from 4- or 8-bit packed codes."""

    def __init__(self, library: ctypes.CDLL):
        self._fn = native_build.bind(library, "quant_linear_f32", [POINTER] * 6 + [I64] * 5)
        self._supported = native_build.bind(library, "quant_linear_supported", [I64] * 3)
        self._dequantize = native_build.bind(library, "quant_dequantize_f32", [POINTER] * 4 + [I64] * 4)

    def supports(self, packed: PackedWeight) -> bool:
        """Whether the kernel reads this weight (group sizes a multiple of 8, or one group over K)."""
        return (
            packed.codes.device.type == "cpu"
            and all(t.is_contiguous() for t in (packed.codes, packed.scales, packed.offsets))
            and bool(self._supported(packed.bits, packed.group_size, packed.in_features))
        )

    def dequantize(self, packed: PackedWeight) -> torch.Tensor:
        """fp32 [N, K], as packed.dequantize() computes it, in one pass (any group size)."""
        out = torch.empty(packed.out_features, packed.in_features)
        status = self._dequantize(
            packed.codes.data_ptr(),
            packed.scales.data_ptr(),
            packed.offsets.data_ptr(),
            out.data_ptr(),
            packed.out_features,
            packed.in_features,
            packed.bits,
            packed.group_size,
        )
        if status != 0:
            raise RuntimeError(f"dequantize kernel refused {packed.bits}-bit codes")
        return out

    def __call__(self, x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """x fp32 [..., K]; bias fp32 [N] contiguous or None."""
        return run_packed(self._fn, x, packed, bias, "quantized linear kernel")


def run_packed(fn, x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, kernel: str) -> torch.Tensor:
    """One call of a packed-codes linear kernel (`fn` takes x, codes, scales, offsets, bias, out, rows,
    N, K, bits and group size, and returns 0 or refuses the layout): x fp32 [..., K] → [..., N]."""
    k, n = packed.in_features, packed.out_features
    x = x.contiguous()
    rows = x.numel() // k
    out = x.new_empty(*x.shape[:-1], n)
    if rows == 0:
        return out
    status = fn(
        x.data_ptr(),
        packed.codes.data_ptr(),
        packed.scales.data_ptr(),
        packed.offsets.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        rows,
        n,
        k,
        packed.bits,
        packed.group_size,
    )
    if status != 0:
        raise RuntimeError(
            f"{kernel} refused {packed.bits}-bit codes in groups of {packed.group_size} over {k} features"
        )
    return out
