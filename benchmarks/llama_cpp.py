"""llama.cpp as the benchmarks' CPU peer: `llama-server` and `llama-bench` built from source.

A benchmark-only step, never part of `make test`. The source is llama.cpp as vendored in the
`llama-cpp-python` source distribution on PyPI (PyPI is reachable here, GitHub may not be):
`pip download --no-binary :all: --no-deps llama-cpp-python==VERSION`, then cmake (Release, CPU
only, the build machine's own instruction set less AMX where the CPU reports it (see `isa_options`),
static libraries so the two binaries stand alone). The binaries are cached under
`<cache>/llama.cpp/<version>-<arch>[-noamx]/bin/`; a second `build` finds them
and does nothing. The build takes ~10-20 minutes on 2 busy cores.

    python benchmarks/llama_cpp.py build [--version 0.3.36] [--jobs 2]
    python benchmarks/llama_cpp.py path llama-server     # print a binary's path (exit 1 if not built)

The peers' benchmarks (`peer_bench.py`) call `binary()` and say how to build when it is missing.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference_service.config import default_cache_dir  # noqa: E402

VERSION = "0.3.36"
BINARIES = ("llama-server", "llama-bench")
# Static, CPU only, tuned for this machine; no network features (HTTPS, the web UI fetched at build time).
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF",
    "-DGGML_OPENMP=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
)


# ggml's x86 instruction-set options and the /proc/cpuinfo flag each needs. Used instead of
# GGML_NATIVE on CPUs that report AMX: with -march=native ggml compiles its AMX matmul in, and its
# tile instructions trap as illegal on such machines here (Q4_1 and Q8_0 models crash at the first
# matmul; F32 runs), so those builds take every other extension the CPU has, and no AMX.
X86_OPTIONS = {
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_BMI2": ("bmi2",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512vbmi",),
    "GGML_AVX512_VNNI": ("avx512_vnni",),
    "GGML_AVX512_BF16": ("avx512_bf16",),
}


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (empty where /proc/cpuinfo is not there)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def isa_options(flags: set[str]) -> tuple[str, ...]:
    """`-DGGML_NATIVE=ON`, or on a CPU that reports AMX the same extensions named one by one, AMX off."""
    if not any(flag.startswith("amx") for flag in flags):
        return ("-DGGML_NATIVE=ON",)
    chosen = [f"-D{option}={'ON' if set(needs) <= flags else 'OFF'}" for option, needs in X86_OPTIONS.items()]
    return ("-DGGML_NATIVE=OFF", *chosen, "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")


def build_tag(flags: set[str]) -> str:
    """Part of the install folder's name: a build without AMX never passes for a native one."""
    return "-noamx" if any(flag.startswith("amx") for flag in flags) else ""


class NotBuilt(RuntimeError):
    """The llama.cpp binaries are not in the cache: run `python benchmarks/llama_cpp.py build`."""


def install_dir(version: str = VERSION, cache_dir: str | Path | None = None) -> Path:
    """`<cache>/llama.cpp/<version>-<machine>`: a native build runs only where it was built."""
    name = f"{version}-{platform.machine()}{build_tag(cpu_flags())}"
    return Path(cache_dir or default_cache_dir()) / "llama.cpp" / name


def binary(name: str, version: str = VERSION, cache_dir: str | Path | None = None) -> Path:
    """The path of a built binary (`llama-server`, `llama-bench`); `NotBuilt` if it is missing."""
    path = install_dir(version, cache_dir) / "bin" / name
    if not os.access(path, os.X_OK):
        raise NotBuilt(f"{name} is not built: run `python benchmarks/llama_cpp.py build` (~10-20 min)")
    return path


def is_built(version: str = VERSION, cache_dir: str | Path | None = None) -> bool:
    return all(os.access(install_dir(version, cache_dir) / "bin" / name, os.X_OK) for name in BINARIES)


def _run(command: list[str], **kwargs) -> None:
    print("+ " + " ".join(command), file=sys.stderr, flush=True)
    subprocess.run(command, check=True, **kwargs)


def _tool(name: str) -> str:
    """cmake or ninja from PATH, else pip-installed next to this Python (the PyPI wheels)."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found:
        return found
    _run([sys.executable, "-m", "pip", "install", "--quiet", name])
    found = shutil.which(name, path=str(Path(sys.executable).parent))
    if not found:
        raise RuntimeError(f"{name} is neither on PATH nor installable with pip")
    return found


def fetch_source(version: str, scratch: Path) -> Path:
    """The sdist's vendored llama.cpp tree, downloaded with pip and unpacked under `scratch`."""
    _run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:", "--no-deps"]
        + [f"llama-cpp-python=={version}", "-d", str(scratch)]
    )
    (archive,) = scratch.glob("llama_cpp_python-*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(scratch, filter="data")
    (source,) = scratch.glob("llama_cpp_python-*/vendor/llama.cpp")
    return source


def build(version: str = VERSION, jobs: int | None = None, cache_dir: str | Path | None = None) -> Path:
    """Build the binaries into the cache unless they are there; returns their folder."""
    target = install_dir(version, cache_dir)
    if is_built(version, cache_dir):
        print(f"llama.cpp {version}: already built in {target / 'bin'}", file=sys.stderr)
        return target / "bin"
    cmake, ninja = _tool("cmake"), _tool("ninja")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=target.parent) as scratch_name:
        scratch = Path(scratch_name)
        source = fetch_source(version, scratch)
        build_dir = scratch / "build"
        generator = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
        _run([cmake, "-S", str(source), "-B", str(build_dir), *generator, *CMAKE_OPTIONS, *isa_options(cpu_flags())])
        _run([cmake, "--build", str(build_dir), "--target", *BINARIES, "-j", str(jobs or os.cpu_count() or 2)])
        staged = scratch / "install" / "bin"
        staged.mkdir(parents=True)
        for name in BINARIES:
            shutil.copy2(build_dir / "bin" / name, staged / name)
        (scratch / "install" / "VERSION").write_text(f"llama-cpp-python {version}\n")
        if target.exists():  # a half-finished earlier attempt
            shutil.rmtree(target)
        os.replace(scratch / "install", target)  # in place only once complete
    print(f"llama.cpp {version}: built in {target / 'bin'}", file=sys.stderr)
    return target / "bin"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser("build", help="download the source and build the binaries (idempotent)")
    build_parser.add_argument("--jobs", type=int, help="parallel compile jobs (default: all cores)")
    path_parser = commands.add_parser("path", help="print a built binary's path")
    path_parser.add_argument("name", choices=BINARIES)
    for sub in (build_parser, path_parser):
        sub.add_argument("--version", default=VERSION, help=f"llama-cpp-python sdist version (default: {VERSION})")
        sub.add_argument("--cache-dir", help="cache folder (default: the project's)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "build":
        print(build(args.version, args.jobs, args.cache_dir))
        return 0
    try:
        print(binary(args.name, args.version, args.cache_dir))
    except NotBuilt as error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
