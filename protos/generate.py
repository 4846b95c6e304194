"""Generate every artifact of the public API from `protos/` (run by `make protos`).

Outputs, all committed and checked by `tests/unit/test_protos.py` (`--check` here):
- `protos/textgen/v1/generate_pb2{,_grpc}.py{,i}`: the server's messages, service stubs and type stubs;
  the proto's folder path is its import path (`textgen.v1`), so no import is rewritten.
- `clients/python/textgen_client/_proto/textgen/v1/generate_pb2.py{,i}`: the messages for the client,
  compiled with the same `-I protos` so both register the same descriptor file name.
- `protos/textgen/textgen.pb`: the descriptor set (imports and comments included) that Envoy's
  gRPC-JSON transcoder reads.
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PROTO_FILES = ["textgen/v1/generate.proto", "textgen/v1/anthropic.proto"]
SERVER_OUT = Path("protos")
CLIENT_OUT = Path("clients/python/textgen_client/_proto")
DESCRIPTOR_SET = Path("protos/textgen/textgen.pb")
CLIENT_FILES = [
    "textgen/v1/generate_pb2.py",
    "textgen/v1/generate_pb2.pyi",
    "textgen/v1/anthropic_pb2.py",
    "textgen/v1/anthropic_pb2.pyi",
]
# The client imports its own copies of our modules, not the server's `textgen.v1`.
CLIENT_IMPORT = ("from textgen.v1 import", "from textgen_client._proto.textgen.v1 import")


def _include_dirs() -> list[str]:
    """Our protos, then googleapis (google/api/*) and protobuf's well-known types."""
    googleapis = Path(importlib.util.find_spec("google.api.annotations_pb2").origin).parents[2]
    well_known = Path(protoc.__file__).parent / "_proto"
    return [str(PROTO_ROOT), str(googleapis), str(well_known)]


def _plugin(name: str) -> str:
    """mypy-protobuf's plugins live beside this interpreter (a venv's bin/)."""
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if found is None:
        raise SystemExit(f"{name} not found: install the dev extra (mypy-protobuf)")
    return found


def _protoc(args: list[str]) -> None:
    includes = [f"-I{d}" for d in _include_dirs()]
    plugins = [
        f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
    ]
    if protoc.main(["grpc_tools.protoc", *includes, *plugins, *args, *PROTO_FILES]) != 0:
        raise SystemExit("protoc failed")


def generate(out_root: Path) -> list[Path]:
    """Write every artifact under `out_root` (paths relative to the repo); returns those paths."""
    server = out_root / SERVER_OUT
    server.mkdir(parents=True, exist_ok=True)
    _protoc(
        [
            f"--python_out={server}",
            f"--grpc_python_out={server}",
            f"--mypy_out=quiet:{server}",
            f"--mypy_grpc_out=quiet:{server}",
        ]
    )
    with tempfile.TemporaryDirectory() as tmp:
        _protoc([f"--python_out={tmp}", f"--mypy_out=quiet:{tmp}"])
        for name in CLIENT_FILES:
            target = out_root / CLIENT_OUT / name
            target.parent.mkdir(parents=True, exist_ok=True)
            text = (Path(tmp) / name).read_text(encoding="utf-8")
            target.write_text(text.replace(*CLIENT_IMPORT), encoding="utf-8")
    descriptor = out_root / DESCRIPTOR_SET
    _protoc([f"--descriptor_set_out={descriptor}", "--include_imports", "--include_source_info"])
    return sorted(p.relative_to(out_root) for p in out_root.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the committed files differ from a fresh generation"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [p for p in fresh if not (ROOT / p).exists() or not filecmp.cmp(Path(tmp) / p, ROOT / p, shallow=False)]
        if args.check:
            for path in stale:
                print(f"stale: {path} (run `make protos`)", file=sys.stderr)
            return 1 if stale else 0
        for path in stale:
            (ROOT / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(tmp) / path, ROOT / path)
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
