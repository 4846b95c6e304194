"""How the native CPU kernels are built and loaded: compiled on first use with the machine's C++
compiler (about two seconds), cached on disk by their sources, compiler and CPU, and loaded through
ctypes as plain C functions (`bind`). Where no compiler works, or `INFERENCE_SERVICE_CPU_KERNELS=off`,
nothing loads and the engine keeps torch's paths."""

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
    CSRC / "bf16_layers.cpp",
    CSRC / "decode_layers.cpp",
    CSRC / "logits_rows.cpp",
    CSRC / "panel_codes_few_rows.cpp",
)
# Included by the sources: part of the cache key.
HEADERS = (
    CSRC / "vec8.h",
    CSRC / "dequant_row.h",
    CSRC / "kv_types.h",
    CSRC / "row_blocks.h",
    CSRC / "panel_prefetch.h",
    CSRC / "parallel_threshold.h",
)
ENV_SWITCH = "INFERENCE_SERVICE_CPU_KERNELS"
# -ffast-math only when compiling: linking with it would pull in crtfastmath.o, which sets
# flush-to-zero for the whole process (GCC < 13). It lets the exp loop use glibc's vector exp.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp", "-fPIC")
LINK_FLAGS = ("-shared", "-fopenmp")
POINTER, I64, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def bind(library: ctypes.CDLL, name: str, argtypes: list) -> Callable[..., int]:
    """The library's function `name`, declared as taking `argtypes` and returning an int status."""
    function = getattr(library, name)
    function.restype, function.argtypes = ctypes.c_int, argtypes
    return function


def native_address(function: Callable[..., int]) -> int:
    """A bound library function's address, for native code that calls it."""
    address = ctypes.cast(function, ctypes.c_void_p).value  # type: ignore[arg-type]
    if address is None:
        raise ValueError("a null function pointer")
    return address


def pointer(tensor: torch.Tensor | None) -> int | None:
    return tensor.data_ptr() if tensor is not None else None


def library_for(device: torch.device, dtype: torch.dtype) -> ctypes.CDLL | None:
    if device.type != "cpu" or dtype != torch.float32 or switched_off():
        return None
    return load_library()


def switched_off() -> bool:
    if os.environ.get(ENV_SWITCH, "").lower() in ("0", "off", "false", "no"):
        logger.info("native CPU kernels disabled by %s", ENV_SWITCH)
        return True
    return False


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """Build (once per machine and sources) and load the kernels; None, with a warning, if that fails."""
    try:
        return ctypes.CDLL(str(build(SOURCES)))
    except (OSError, subprocess.SubprocessError, RuntimeError) as error:
        logger.warning("native CPU kernels unavailable, using the torch path: %s", error)
        return None


def build(
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
