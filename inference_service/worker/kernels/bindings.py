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

The kernels' bindings live beside this module by job (attention_bindings, linear_bindings, fp32_glue;
building and loading in native_build); this module picks the kernel a device and dtype get, and
keeps every name callers import from it.
"""

from __future__ import annotations

import torch

from inference_service.worker.kernels.attention_bindings import (
    KV_DTYPE_CODES,
    MAX_GROUPS,
    KVWriter,
    PagedDecodeKernel,
)
from inference_service.worker.kernels.fp32_glue import DecodeGlue
from inference_service.worker.kernels.linear_bindings import (
    MAX_BF16_LINEAR_ROWS,
    MAX_FEW_PANEL_ROWS,
    MAX_LINEAR_ROWS,
    MAX_PANEL_K,
    MAX_QUANT_ROWS,
    BF16Linear,
    PanelCodesFewRows,
    PanelLinear,
    QuantLinearKernel,
    SmallBatchLinear,
)
from inference_service.worker.kernels.native_build import (
    COMPILE_FLAGS,
    CSRC,
    ENV_SWITCH,
    HEADERS,
    LINK_FLAGS,
    SOURCES,
    load_library,
)
from inference_service.worker.kernels.native_build import bind as _bind
from inference_service.worker.kernels.native_build import build as _build
from inference_service.worker.kernels.native_build import library_for as _library_for
from inference_service.worker.kernels.native_build import pointer as _pointer
from inference_service.worker.kernels.native_build import switched_off as _switched_off

__all__ = [
    "COMPILE_FLAGS",
    "CSRC",
    "ENV_SWITCH",
    "HEADERS",
    "KV_DTYPE_CODES",
    "LINK_FLAGS",
    "MAX_BF16_LINEAR_ROWS",
    "MAX_FEW_PANEL_ROWS",
    "MAX_GROUPS",
    "MAX_LINEAR_ROWS",
    "MAX_PANEL_K",
    "MAX_QUANT_ROWS",
    "SOURCES",
    "BF16Linear",
    "DecodeGlue",
    "KVWriter",
    "PagedDecodeKernel",
    "PanelCodesFewRows",
    "PanelLinear",
    "QuantLinearKernel",
    "SmallBatchLinear",
    "_bind",
    "_build",
    "_library_for",
    "_pointer",
    "_switched_off",
    "load_library",
]


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
