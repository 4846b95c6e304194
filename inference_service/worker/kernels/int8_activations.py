"""4-bit linears with int8 activations (`csrc/quant_linear_q8.cpp`): an opt-in path for decode steps.

x is quantized to int8 in blocks of 32 (one fp32 scale each, as llama.cpp's q8_1) and meets the 4-bit
codes in AVX-512 VNNI integer dot products, as llama.cpp computes Q4_0/Q4_1. It changes the numerics
(x's rounding: ~0.4% rms relative error in each projection's output on random weights; see the kernel's
top comment), so it is off
unless `INFERENCE_SERVICE_QUANT_ACTIVATIONS=int8`; QuantLinear then uses it for the rows it gives the
packed-weight kernel (decode steps) where the codes fit (4-bit, K a multiple of 32, groups a multiple
of 32) and the CPU has AVX-512 VNNI; everything else keeps the fp32 path.

Scales and offsets that are all exactly fp16 (GGUF's Q4_0/Q4_1 store them so) are handed to the kernel as
fp16 copies (`compact_factors`): a decode step streams each weight's codes and factors once, and fp16
factors make the 4-bit layers' bytes GGUF's (0.625 per weight instead of 0.75), the same results bit for
bit. The fp32 ones stay for the other paths (prefill's panel GEMM), so the copies cost 1/8 byte per weight
of memory.

Built like the other native kernels (bindings._build: the machine's C++ compiler, cached on disk), as
its own small library; `INFERENCE_SERVICE_CPU_KERNELS=off` switches it off with the rest.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess

import torch

from inference_service.worker.kernels import bindings, linear_bindings
from inference_service.worker.kernels.packed import PackedWeight

logger = logging.getLogger(__name__)

SOURCES = (bindings.CSRC / "quant_linear_q8.cpp",)
ENV_SWITCH = "INFERENCE_SERVICE_QUANT_ACTIVATIONS"
CHOICES = ("fp32", "int8")  # fp32: the default path; int8: this kernel
BLOCK = 32  # x's quantization block (and the granularity K and group sizes must have)

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


def requested() -> str:
    """The activation format the environment asks for (`fp32` when unset); ValueError for others."""
    value = os.environ.get(ENV_SWITCH, "").strip().lower() or "fp32"
    if value not in CHOICES:
        raise ValueError(f"{ENV_SWITCH} must be one of {', '.join(CHOICES)}, not {value!r}")
    return value


class Int8ActivationLinear:
    """x [..., K] fp32 · dequant(packed)ᵀ (+ bias) → [..., N], x rounded to int8 per block of 32."""

    def __init__(self, library: ctypes.CDLL):
        self._fn = bindings._bind(library, "quant_linear_q8_f32", [_P] * 6 + [_I64] * 5)
        self.fn_f16 = bindings._bind(library, "quant_linear_q8_f16", [_P] * 6 + [_I64] * 5)  # fp16 factors
        self._supported = bindings._bind(library, "quant_linear_q8_supported", [_I64] * 3)
        self._quantize = library.quant_linear_q8_quantize
        self._quantize.restype, self._quantize.argtypes = None, [_P, _P, _P, _I64, _I64]

    def supports(self, packed: PackedWeight) -> bool:
        """4-bit codes on CPU, contiguous, K and the group size fitting blocks of 32, AVX-512 VNNI here."""
        return (
            packed.codes.device.type == "cpu"
            and all(t.is_contiguous() for t in (packed.codes, packed.scales, packed.offsets))
            and bool(self._supported(packed.bits, packed.group_size, packed.in_features))
        )

    @staticmethod
    def compact_factors(packed: PackedWeight) -> tuple[torch.Tensor, torch.Tensor] | None:
        """fp16 copies of the weight's scales and offsets when every value survives the round trip
        (the kernel then reads them instead, with the same results); None when one does not."""
        scales, offsets = packed.scales.half(), packed.offsets.half()
        if torch.equal(scales.float(), packed.scales) and torch.equal(offsets.float(), packed.offsets):
            return scales, offsets
        return None

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] fp32 → (x's int8 codes [M, K], in x's order; their block scales [M, K / 32]), as
        the kernel rounds them: for tests and for measuring the rounding."""
        x = x.contiguous()
        m, k = x.shape
        blocks = k // BLOCK
        pairs = (blocks + 1) // 2
        stored = torch.empty(m, pairs * 2 * BLOCK, dtype=torch.int8)
        scales = torch.empty(m, blocks)
        self._quantize(x.data_ptr(), stored.data_ptr(), scales.data_ptr(), m, k)
        # The kernel's order per pair of blocks A, B: [A even k, B even k, A odd k, B odd k], 16 each.
        parts = stored.view(m, pairs, 2, 2, BLOCK // 2)  # [m, pair, even/odd, block, i]
        codes = parts.permute(0, 1, 3, 4, 2).reshape(m, pairs * 2 * BLOCK)  # k = 32 block + 2 i + odd
        return codes[:, :k].contiguous(), scales

    def __call__(self, x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """x fp32 [..., K]; bias fp32 [N] contiguous or None."""
        return linear_bindings.run_packed(self._fn, x, packed, bias, "int8-activation kernel")


@functools.cache
def load() -> Int8ActivationLinear | None:
    """The kernel, built once per machine and source; None when switched off or unbuildable."""
    if bindings._switched_off():
        return None
    try:
        return Int8ActivationLinear(ctypes.CDLL(str(bindings._build(SOURCES, stem="quant_linear_q8"))))
    except (OSError, subprocess.SubprocessError, RuntimeError) as error:
        logger.warning("int8-activation kernel unavailable, using the fp32 path: %s", error)
        return None


def kernel_for(packed: PackedWeight, device: torch.device, dtype: torch.dtype) -> Int8ActivationLinear | None:
    """The kernel for this weight when the environment asks for int8 activations and it applies."""
    if requested() != "int8" or device.type != "cpu" or dtype != torch.float32:
        return None
    kernel = load()
    return kernel if kernel is not None and kernel.supports(packed) else None
