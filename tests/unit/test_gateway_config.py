"""The gateway's rendered Envoy config: in step with the proto, the Lua filter and the committed
`deploy/envoy/envoy.yaml`, and accepted by the real Envoy."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
from google.api import annotations_pb2
from google.protobuf import descriptor_pb2

from gateway import contract
from gateway.__main__ import DEPLOY_CONFIG, DEPLOY_CONFIG_PATH
from gateway.config import GatewayConfig, lua_source, render, render_yaml

FieldType = descriptor_pb2.FieldDescriptorProto
INT64_TYPES = {
    FieldType.TYPE_INT64,
    FieldType.TYPE_UINT64,
    FieldType.TYPE_SINT64,
    FieldType.TYPE_FIXED64,
    FieldType.TYPE_SFIXED64,
}
FLOAT_TYPES = {FieldType.TYPE_FLOAT, FieldType.TYPE_DOUBLE}


def test_deploy_config_is_fresh():
    assert DEPLOY_CONFIG_PATH.read_text(encoding="utf-8") == render_yaml(DEPLOY_CONFIG), (
        "deploy/envoy/envoy.yaml is stale: run `python -m gateway --output deploy/envoy/envoy.yaml`"
    )


def test_yaml_says_what_the_config_says():
    yaml = pytest.importorskip("yaml")
    config = GatewayConfig(cors_allow_origin=("https://a.example", "http://b:1"), upstream_host="server.internal")
    assert yaml.safe_load(render_yaml(config)) == json.loads(json.dumps(render(config)))


def test_headers_the_gateway_adds_are_the_ones_the_server_reads():
    from gateway import config as gateway_config
    from inference_service.api import errors, keepalive

    assert gateway_config.INBAND_ERRORS_HEADER == errors.INBAND_ERRORS_KEY
    assert gateway_config.KEEPALIVE_HEADER == keepalive.KEEPALIVE_KEY
    streams = [
        r
        for r in render(DEPLOY_CONFIG)["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
            "typed_config"
        ]["route_config"]["virtual_hosts"][0]["routes"]
        if r["name"] == "GenerateStream"
    ]
    added = {h["header"]["key"]: h["header"]["value"] for h in streams[0]["request_headers_to_add"]}
    assert added == {errors.INBAND_ERRORS_KEY: "1", keepalive.KEEPALIVE_KEY: "15"}


def test_routes_are_tgis_and_openais():
    routes = {(r.method, r.path): r for r in contract.rest_routes()}
    assert set(routes) == {
        ("POST", "/generate"),
        ("POST", "/generate_stream"),
        ("POST", "/"),
        ("POST", "/invocations"),
        ("POST", "/tokenize"),
        ("GET", "/info"),
        ("GET", "/health"),
        ("GET", "/metrics"),
        ("GET", "/openapi.json"),
        ("GET", "/docs"),
        ("GET", "/docs/{file=**}"),
        ("GET", "/v1/models"),
        ("GET", "/v1/models/{id=**}"),
        ("POST", "/v1/load_lora_adapter"),
        ("POST", "/v1/unload_lora_adapter"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/chat/completions/stream"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/completions/stream"),
        ("POST", "/v1/messages"),
        ("POST", "/v1/messages/stream"),
        ("POST", "/v1/messages/count_tokens"),
        ("POST", "/v1/responses"),
        ("POST", "/v1/responses/stream"),
        ("GET", "/v1/responses/{response_id}"),
        ("DELETE", "/v1/responses/{response_id}"),
    }
    assert routes["POST", "/"].unwrap == "responses" and routes["POST", "/tokenize"].unwrap == "tokens"
    sagemaker = routes["POST", "/invocations"]
    assert (sagemaker.rpc, sagemaker.unwrap) == ("CompatGenerate", "responses")
    assert [r.rpc for r in routes.values() if r.streams] == [
        "GenerateStream",
        "ChatCompletionStream",
        "CompletionStream",
        "MessagesStream",
        "CreateResponseStream",
    ]
    assert routes["GET", "/v1/models/{id=**}"].path_match() == {"prefix": "/v1/models/"}
    assert routes["GET", "/v1/models"].path_match() == {"path": "/v1/models"}


def test_envoy_descriptor_keeps_response_body_for_http_body_only():
    trimmed = descriptor_pb2.FileDescriptorSet.FromString(contract.envoy_descriptor())
    for file in trimmed.file:
        assert not file.HasField("source_code_info")
        for service in file.service:
            for method in service.method:
                rule = method.options.Extensions[annotations_pb2.http]
                assert not rule.response_body or method.output_type == contract.HTTP_BODY


def _response_fields(types: set[int]) -> set[str]:
    """Names of the fields of `types` in every message an RPC of the service can answer with."""
    descriptor_set = contract.load_descriptor_set()
    messages = {f".{file.package}.{m.name}": m for file in descriptor_set.file for m in file.message_type}
    _, service = contract._service(descriptor_set)
    pending, seen, names = [m.output_type for m in service.method], set(), set()
    while pending:
        name = pending.pop()
        if name in seen or name not in messages or name.startswith(".google.protobuf."):
            continue  # well-known types print as plain JSON (a Value's number is a number)
        seen.add(name)
        for field in messages[name].field:
            if field.type in types:
                names.add(field.name)
            if field.type == FieldType.TYPE_MESSAGE:
                pending.append(field.type_name)
    return names


def _lua_list(name: str) -> set[str]:
    match = re.search(rf"^local {name} = \{{([^}}]*)\}}", lua_source(), re.MULTILINE)
    assert match, name
    return set(re.findall(r'"(\w+)"', match.group(1)))


def test_lua_knows_every_64_bit_and_float_response_field():
    assert _lua_list("INT64_FIELDS") == _response_fields(INT64_TYPES)
    assert _lua_list("FLOAT_FIELDS") == _response_fields(FLOAT_TYPES)


def test_every_rpc_with_a_route_has_a_kind():
    assert {r.rpc for r in contract.rest_routes()} == set(contract.KINDS)


def test_envoy_accepts_the_deploy_config():
    from gateway.envoy import GatewayError, envoy_binary

    try:
        binary = envoy_binary()
    except GatewayError:
        pytest.skip("envoy is not installed (the gateway extra)")
    result = subprocess.run(
        [binary, "--mode", "validate", "-c", str(DEPLOY_CONFIG_PATH), "-l", "error"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("values", [{"port": 70000}, {"upstream_port": 0}, {"payload_limit": 0}])
def test_bad_values_are_refused(values):
    with pytest.raises(ValueError):
        GatewayConfig(**values)


def test_launch_flags_and_environment():
    from gateway.launch import options_from_args
    from inference_service.cli import build_parser

    args = build_parser().parse_args(
        ["launch", "--port", "9000", "--cors-allow-origin", "https://a, https://b", "--cors-allow-origin", "https://c"]
    )
    options = options_from_args(args, {"PORT": "1", "ENVOY_CONCURRENCY": "2"})
    assert options.port == 9000 and options.envoy_concurrency == 2
    assert options.cors_allow_origin == ("https://a", "https://b", "https://c")
    from_env = options_from_args(build_parser().parse_args(["launch"]), {"CORS_ALLOW_ORIGIN": "https://x"})
    assert from_env.port == 8080 and from_env.cors_allow_origin == ("https://x",)
