"""Native CPU kernels: compiled on first use with the machine's C++ compiler, cached on disk.

Kernels for the places where torch's CPU path wastes memory bandwidth or time (each source file says
why): decode attention over the paged cache, read in place in its own dtype (`csrc/paged_decode.cpp`),
and the conversion of new K/V rows into it (`csrc/kv_write.cpp`), projections of a few rows
(`csrc/small_batch_linear.cpp`) and the same over 4- or 8-bit packed weights
(`csrc/quant_linear.cpp`, used by linears/quant.py's QuantLinear). A GEMM over panels
(`csrc/panel_linear.cpp`): for weights stored in panels (kernels/panels.py) at every row count, and
for projections of many rows from weights kept in rows, faster here than torch's and with no
dequantized copy of a packed weight. And the small ops between a decode step's projections, one call
each (`csrc/decode_glue.cpp`, used by runner/decode_step.py). For bfloat16 models, projections of a
few rows from bf16 weights with fp32 accumulation (`csrc/bf16_linear.cpp`). The shared library is plain C ABI called
through ctypes, so building it needs a C++ compiler and nothing of torch's build tooling: about two
seconds. Where no compiler works, or `INFERENCE_SERVICE_CPU_KERNELS=off`, the engine keeps torch's
paths, which compute the same thing more slowly.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from inference_service import progress
from inference_service.config import default_cache_dir
from inference_service.worker.kernels.packed import PackedWeight

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = (
    CSRC / "paged_decode.cpp",
    CSRC / "small_batch_linear.cpp",
    CSRC / "quant_linear.cpp",
    CSRC / "panel_linear.cpp",
    CSRC / "decode_glue.cpp",
    CSRC / "kv_write.cpp",
    CSRC / "bf16_linear.cpp",
    CSRC / "bf16_glue.cpp",
)
# Included by the sources: part of the cache key.
HEADERS = (CSRC / "vec8.h", CSRC / "dequant_row.h", CSRC / "kv_types.h")
ENV_SWITCH = "INFERENCE_SERVICE_CPU_KERNELS"
# -ffast-math only when compiling: linking with it would pull in crtfastmath.o, which sets
# flush-to-zero for the whole process (GCC < 13). It lets the exp loop use glibc's vector exp.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp", "-fPIC")
LINK_FLAGS = ("-shared", "-fopenmp")
MAX_GROUPS = 8  # query heads per KV head that the attention kernel is instantiated for
# The KV cache element types the kernels read and write (csrc/kv_types.h's KVDtype).
KV_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}
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
# Above those row counts the panel GEMM computes, for inputs up to this wide (its panel of 32 columns,
# K x 128 bytes, then still sits in L2). Measured on the demo model's projections, 2 threads, against
# torch's fp32 GEMM: 1.3x at 33-256 rows, 1.07x at 512, 1.05x at 1024.
MAX_PANEL_K = 8192

_POINTER, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def _bind(library: ctypes.CDLL, name: str, argtypes: list) -> Callable[..., int]:
    """The library's function `name`, declared as taking `argtypes` and returning an int status."""
    function = getattr(library, name)
    function.restype, function.argtypes = ctypes.c_int, argtypes
    return function


class PagedDecodeKernel:
    """Decode attention reading the paged cache in place: q [S, H, D] fp32 → out [S, H, Dv] fp32,
    the cache in any of KV_DTYPE_CODES' dtypes (int8 with its scales).

    Unlike torch's indexing, the kernel does not bounds-check: it trusts that each sequence's
    table covers its context. ModelRunner indexes the table at every decode's last position, so a
    short table raises there first, and block ids come from the block manager's own pool.
    """

    def __init__(self, library: ctypes.CDLL):
        self._fn = _bind(library, "paged_decode", [_POINTER] * 8 + [_I64] * 7 + [_F32, _I64, _F32, _I64])

    def supports(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
        """Whether the kernel computes this call (q [S, H, D]); otherwise the torch path does."""
        return (
            q.dtype == torch.float32
            and key_cache.dtype == value_cache.dtype
            and key_cache.dtype in KV_DTYPE_CODES
            and q.device.type == "cpu"
            and key_cache.is_contiguous()
            and value_cache.is_contiguous()
            and self._supports_shapes(q.shape[-2], key_cache.shape[1], key_cache.shape[2], value_cache.shape[2])
        )

    @staticmethod
    @functools.cache
    def _supports_shapes(num_heads: int, num_kv_heads: int, head_dim: int, head_dim_v: int) -> bool:
        return (
            num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= MAX_GROUPS
            and head_dim % 8 == 0
            and head_dim_v % 8 == 0
        )

    def __call__(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        block_size: int,
        scale: float,
        window: int | None,
        softcap: float | None,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`scales`: the K and V scales ([slots, KVH] fp32, contiguous) of an int8 cache."""
        q = q.contiguous()
        if block_table.dtype != torch.int64 or not block_table.is_contiguous():
            block_table = block_table.to(torch.int64).contiguous()
        if context_lens.dtype != torch.int64 or not context_lens.is_contiguous():
            context_lens = context_lens.to(torch.int64).contiguous()
        num_seqs, num_heads, head_dim = q.shape
        out = q.new_empty(num_seqs, num_heads, value_cache.shape[2])
        key_scales, value_scales = scales if scales is not None else (None, None)
        status = self._fn(
            q.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            _pointer(key_scales),
            _pointer(value_scales),
            block_table.data_ptr(),
            context_lens.data_ptr(),
            out.data_ptr(),
            num_seqs,
            num_heads,
            key_cache.shape[1],
            head_dim,
            value_cache.shape[2],
            block_size,
            block_table.shape[1],
            scale,
            window or 0,
            softcap or 0.0,
            KV_DTYPE_CODES[key_cache.dtype],
        )
        if status != 0:
            raise RuntimeError(
                f"paged decode kernel refused {num_heads} heads over {key_cache.shape[1]} KV heads "
                f"in a {key_cache.dtype} cache"
            )
        return out


class KVWriter:
    """New K/V rows (fp32, rows of a wider tensor) into the paged cache, converted to its dtype."""

    def __init__(self, library: ctypes.CDLL):
        self._fn = _bind(library, "kv_write", [_POINTER, _I64, _POINTER, _I64] + [_POINTER] * 5 + [_I64] * 5)

    def __call__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        scales: tuple[torch.Tensor, torch.Tensor] | None,
        slots: torch.Tensor,
    ) -> None:
        """keys [S, KVH, D], values [S, KVH, Dv] fp32, each row's heads contiguous (row stride free);
        slots [S] int64 contiguous."""
        if not (self.takes(keys) and self.takes(values)):
            raise ValueError("K/V rows must be fp32 on the CPU with each row's heads contiguous")
        key_scales, value_scales = scales if scales is not None else (None, None)
        status = self._fn(
            keys.data_ptr(),
            keys.stride(0),
            values.data_ptr(),
            values.stride(0),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            _pointer(key_scales),
            _pointer(value_scales),
            slots.data_ptr(),
            keys.shape[0],
            keys.shape[1],
            keys.shape[2],
            values.shape[2],
            KV_DTYPE_CODES[key_cache.dtype],
        )
        if status != 0:
            raise RuntimeError(f"KV write kernel refused a {key_cache.dtype} cache")

    @staticmethod
    def takes(rows: torch.Tensor) -> bool:
        """Whether rows [S, KVH, D] are in the layout the kernel reads."""
        return (
            rows.dtype == torch.float32
            and rows.device.type == "cpu"
            and rows.stride(2) == 1
            and rows.stride(1) == rows.shape[2]
        )


class SmallBatchLinear:
    """x [..., K] · weight [N, K]ᵀ (+ bias) → [..., N], for at most MAX_LINEAR_ROWS rows of x."""

    def __init__(self, library: ctypes.CDLL):
        self._fn = _bind(library, "small_batch_linear_f32", [_POINTER] * 4 + [_I64] * 3)

    @staticmethod
    def supports_weight(weight: torch.Tensor) -> bool:
        return (
            weight.dtype == torch.float32
            and weight.device.type == "cpu"
            and weight.dim() == 2
            and weight.is_contiguous()
            and weight.shape[1] % 8 == 0
        )

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out_features, in_features = weight.shape
        x = x.contiguous()
        rows = x.numel() // in_features
        out = x.new_empty(*x.shape[:-1], out_features)
        if rows == 0:  # a step that keeps no logits still runs the head on zero rows
            return out
        bias_ptr = bias.data_ptr() if bias is not None else None
        status = self._fn(x.data_ptr(), weight.data_ptr(), bias_ptr, out.data_ptr(), rows, out_features, in_features)
        if status != 0:
            raise RuntimeError(f"linear kernel refused {rows} rows of {in_features} features")
        return out


class BF16Linear:
    """x [..., K] · weight [N, K]ᵀ (+ bias) → [..., N], all bfloat16, fp32 accumulation, for a few rows."""

    def __init__(self, library: ctypes.CDLL):
        self._fn = _bind(library, "small_batch_linear_bf16", [_POINTER] * 4 + [_I64] * 3)
        self.uses_dot_product = bool(_bind(library, "bf16_linear_uses_dot_product", [])())

    @staticmethod
    def supports_weight(weight: torch.Tensor) -> bool:
        return (
            weight.dtype == torch.bfloat16
            and weight.device.type == "cpu"
            and weight.dim() == 2
            and weight.is_contiguous()
            and weight.shape[1] % 8 == 0
        )

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x bf16 [..., K]; weight bf16 [N, K] and bias bf16 [N] (or None), contiguous."""
        out_features, in_features = weight.shape
        x = x.contiguous()
        rows = x.numel() // in_features
        out = x.new_empty(*x.shape[:-1], out_features)
        if rows == 0:
            return out
        status = self._fn(
            x.data_ptr(), weight.data_ptr(), _pointer(bias), out.data_ptr(), rows, out_features, in_features
        )
        if status != 0:
            raise RuntimeError(f"bf16 linear kernel refused {rows} rows of {in_features} features")
        return out


class PanelLinear:
    """x [..., K] · W[N, K]ᵀ (+ bias) → [..., N] for many rows of x, W fp32 or packed (csrc/panel_linear.cpp)."""

    def __init__(self, library: ctypes.CDLL):
        self._fn = _bind(library, "panel_linear_f32", [_POINTER] * 4 + [_I64] * 3)
        self._quant = _bind(library, "panel_quant_linear_f32", [_POINTER] * 6 + [_I64] * 5)
        self._codes = _bind(library, "panel_codes_linear_f32", [_POINTER] * 6 + [_I64] * 4)
        self._panels = _bind(library, "panel_weights_linear_f32", [_POINTER] * 4 + [_I64] * 3)

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
                    _pointer(bias),
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
                    _pointer(bias),
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
                    _pointer(bias),
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
            self._check(self._panels(x.data_ptr(), panels.data_ptr(), _pointer(bias), out.data_ptr(), rows, n, k), k)
        return out

    @staticmethod
    def _operands(x: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """x contiguous, the output [..., n], and the number of rows."""
        return x.contiguous(), x.new_empty(*x.shape[:-1], n), x.numel() // k

    @staticmethod
    def _check(status: int, k: int) -> None:
        if status != 0:
            raise RuntimeError(f"panel linear kernel refused an input of {k} features")


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return tensor.data_ptr() if tensor is not None else None


class QuantLinearKernel:
    """x [..., K] · dequant(packed)ᵀ (+ bias) → [..., N] straight from 4- or 8-bit packed codes."""

    def __init__(self, library: ctypes.CDLL):
        self._fn = _bind(library, "quant_linear_f32", [_POINTER] * 6 + [_I64] * 5)
        self._supported = _bind(library, "quant_linear_supported", [_I64] * 3)
        self._dequantize = _bind(library, "quant_dequantize_f32", [_POINTER] * 4 + [_I64] * 4)

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
        k, n = packed.in_features, packed.out_features
        x = x.contiguous()
        rows = x.numel() // k
        out = x.new_empty(*x.shape[:-1], n)
        if rows == 0:
            return out
        status = self._fn(
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
                f"quantized linear kernel refused {packed.bits}-bit codes in groups of "
                f"{packed.group_size} over {k} features"
            )
        return out


class DecodeGlue:
    """The ops between a decode step's projections (see csrc/decode_glue.cpp); fp32, contiguous.
    Subclasses for other dtypes name their symbols' suffix and their dtype (kernels/bf16_glue.py)."""

    cache_dtype = torch.float32  # the rows' dtype, and the KV cache dtype rope_kv_write writes into
    symbol_suffix = "f32"

    def __init__(self, library: ctypes.CDLL):
        suffix = self.symbol_suffix
        self._norm = _bind(library, f"add_rms_norm_{suffix}", [_POINTER] * 4 + [_I64] * 2 + [_F32])
        self._rope = _bind(library, f"rope_kv_write_{suffix}", [_POINTER] * 5 + [_F32] + [_POINTER] * 3 + [_I64] * 4)
        self._silu_mul = _bind(library, f"silu_mul_{suffix}", [_POINTER] * 2 + [_I64] * 2)

    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """hidden [S, D] += delta (in place), then weight * rmsnorm(hidden) → new [S, D]."""
        out = torch.empty_like(hidden)
        self._norm(
            hidden.data_ptr(),
            None if delta is None else delta.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            hidden.shape[0],
            hidden.shape[1],
            eps,
        )
        return out

    def rope_kv_write(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        eps: float,
        key_cache: torch.Tensor | None,
        value_cache: torch.Tensor | None,
        slots: torch.Tensor,
        heads: int,
        kv_heads: int,
    ) -> None:
        """qkv [S, H + 2 KVH, Dh]: q, k normed (if given) and rotated in place; k, v into the cache
        (of `cache_dtype`), unless the caches are None."""
        cos, sin = cos.to(self.cache_dtype).contiguous(), sin.to(self.cache_dtype).contiguous()
        status = self._rope(
            qkv.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            None if q_norm is None else q_norm.data_ptr(),
            None if k_norm is None else k_norm.data_ptr(),
            eps,
            _pointer(key_cache),
            _pointer(value_cache),
            slots.data_ptr(),
            qkv.shape[0],
            heads,
            kv_heads,
            qkv.shape[-1],
        )
        if status != 0:
            raise RuntimeError(f"rotary kernel refused head size {qkv.shape[-1]}")

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [S, 2 I] → silu(gate) * up [S, I]."""
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(rows, width)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width)
        return out


def decode_kernel_for(device: torch.device, dtype: torch.dtype) -> PagedDecodeKernel | None:
    """The native decode attention where it applies (fp32 on CPU; bf16 too, its q widened to fp32 and
    its cache read in place) and builds; None: the torch path."""
    library = _library_for(device, torch.float32 if dtype == torch.bfloat16 else dtype)
    return PagedDecodeKernel(library) if library is not None else None


def kv_writer_for(device: torch.device, dtype: torch.dtype) -> KVWriter | None:
    """The native K/V row conversion where it applies (fp32 rows on CPU) and builds; None: torch ops."""
    library = _library_for(device, dtype)
    return KVWriter(library) if library is not None else None


def linear_kernel_for(device: torch.device, dtype: torch.dtype) -> SmallBatchLinear | None:
    """The native few-row linear where it applies (fp32 on CPU) and builds; None: torch's GEMM."""
    library = _library_for(device, dtype)
    return SmallBatchLinear(library) if library is not None else None


def panel_kernel_for(device: torch.device, dtype: torch.dtype) -> PanelLinear | None:
    """The native many-row linear where it applies (fp32 on CPU) and builds; None: torch's GEMM."""
    library = _library_for(device, dtype)
    return PanelLinear(library) if library is not None else None


def bf16_linear_kernel_for(device: torch.device, dtype: torch.dtype) -> BF16Linear | None:
    """The native few-row bf16 linear where it applies (bf16 on CPU) and builds; None: torch's GEMM."""
    if device.type != "cpu" or dtype != torch.bfloat16 or _switched_off():
        return None
    library = load_library()
    return BF16Linear(library) if library is not None else None


def load_bf16_linear() -> BF16Linear | None:
    library = load_library()
    return BF16Linear(library) if library is not None else None


def quant_kernel_for(device: torch.device, dtype: torch.dtype) -> QuantLinearKernel | None:
    """The native packed-weight linear where it applies (fp32 on CPU) and builds; None: dequantize."""
    library = _library_for(device, dtype)
    return QuantLinearKernel(library) if library is not None else None


def load_quant_linear() -> QuantLinearKernel | None:
    library = load_library()
    return QuantLinearKernel(library) if library is not None else None


def load_panel_linear() -> PanelLinear | None:
    library = load_library()
    return PanelLinear(library) if library is not None else None


def load_paged_decode() -> PagedDecodeKernel | None:
    library = load_library()
    return PagedDecodeKernel(library) if library is not None else None


def load_kv_writer() -> KVWriter | None:
    library = load_library()
    return KVWriter(library) if library is not None else None


def load_decode_glue() -> DecodeGlue | None:
    library = load_library()
    return DecodeGlue(library) if library is not None else None


def load_small_batch_linear() -> SmallBatchLinear | None:
    library = load_library()
    return SmallBatchLinear(library) if library is not None else None


def _library_for(device: torch.device, dtype: torch.dtype) -> ctypes.CDLL | None:
    if device.type != "cpu" or dtype != torch.float32 or _switched_off():
        return None
    return load_library()


def _switched_off() -> bool:
    if os.environ.get(ENV_SWITCH, "").lower() in ("0", "off", "false", "no"):
        logger.info("native CPU kernels disabled by %s", ENV_SWITCH)
        return True
    return False


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """Build (once per machine and sources) and load the kernels; None, with a warning, if that fails."""
    try:
        return ctypes.CDLL(str(_build(SOURCES)))
    except (OSError, subprocess.SubprocessError, RuntimeError) as error:
        logger.warning("native CPU kernels unavailable, using the torch path: %s", error)
        return None


def _build(
    sources: tuple[Path, ...],
    headers: tuple[Path, ...] = HEADERS,
    compile_flags: tuple[str, ...] = COMPILE_FLAGS,
    link_flags: tuple[str, ...] = LINK_FLAGS,
    stem: str = "cpu_kernels",
) -> Path:
    """The shared library of `sources` (built once per machine and sources, cached on disk)."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    texts = [path.read_text() for path in (*sources, *headers)]
    key = hashlib.sha256(
        "\0".join([*texts, compiler, version, *compile_flags, *link_flags, platform.machine(), _cpu_flags()]).encode()
    ).hexdigest()[:16]
    target = Path(default_cache_dir()) / "kernels" / f"{stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        objects = [Path(scratch) / f"{source.stem}.o" for source in sources]
        library = Path(scratch) / "kernels.so"
        commands = [
            [compiler, *compile_flags, "-c", str(source), "-o", str(obj)]
            for source, obj in zip(sources, objects, strict=True)
        ]
        commands.append([compiler, *link_flags, *map(str, objects), "-o", str(library)])
        with progress.phase("building kernels", f"built native CPU kernels ({target.name})", unit="file") as phase:
            for command in phase.track(commands):
                # In its own process group: a stop signal ends the compiler with the server (api.stopping).
                done = subprocess.run(command, capture_output=True, text=True, timeout=300, process_group=0)
                if done.returncode != 0:
                    raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(library, target)  # atomic: concurrent builders each install a complete file
    return target


def _cpu_flags() -> str:
    """-march=native code must not be reused by a CPU with other instruction sets (shared home dirs)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()
