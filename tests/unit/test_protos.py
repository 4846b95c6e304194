"""The committed stubs and descriptor set are exactly what `make protos` generates from the protos."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_generated_files_match_the_protos():
    result = subprocess.run(
        [sys.executable, str(ROOT / "protos" / "generate.py"), "--check"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", ["generate_pb2.py", "anthropic_pb2.py"])
def test_client_messages_are_the_server_messages(name):
    """The same modules, but for the imports of each other (the client's own copies)."""
    server = (ROOT / "protos/textgen/v1" / name).read_text()
    client = (ROOT / "clients/python/textgen_client/_proto/textgen/v1" / name).read_text()
    assert client == server.replace("from textgen.v1 import", "from textgen_client._proto.textgen.v1 import")


def test_descriptor_set_holds_the_service_and_its_http_rules():
    from google.protobuf import descriptor_pb2

    import textgen

    descriptors = descriptor_pb2.FileDescriptorSet.FromString(textgen.DESCRIPTOR_SET.read_bytes())
    names = {f.name for f in descriptors.file}
    assert {
        "textgen/v1/generate.proto",
        "google/api/annotations.proto",
        "google/api/http.proto",
        "google/api/httpbody.proto",
        "google/protobuf/descriptor.proto",
    } <= names
    ours = next(f for f in descriptors.file if f.name == "textgen/v1/generate.proto")
    assert ours.service[0].name == "TextGeneration"
    assert ours.source_code_info.location  # comments kept
