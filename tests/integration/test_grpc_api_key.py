"""`--api-key` over real gRPC: generation calls need `authorization: Bearer <key>`, the rest stay open."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_grpc_errors import error_info

from textgen.v1 import generate_pb2 as pb
from textgen_client import AuthenticationError, Client

KEY = "s3cret-Key"
TIMEOUT = 60
REQUEST = pb.GenerateRequest(inputs="hello", parameters=pb.GenerateParameters(max_new_tokens=2))


@pytest.fixture(scope="module")
def keyed_server(tiny_engine_config):
    from tests.conftest import GrpcServerThread

    server = GrpcServerThread(tiny_engine_config, api_key=KEY)
    yield server
    server.stop(timeout_s=1.0)


def bearer(value: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", value),)


GUARDED = {
    "Generate": lambda stub, md: stub.Generate(REQUEST, timeout=TIMEOUT, metadata=md),
    "GenerateStream": lambda stub, md: list(stub.GenerateStream(REQUEST, timeout=TIMEOUT, metadata=md)),
    "CompatGenerate": lambda stub, md: stub.CompatGenerate(REQUEST, timeout=TIMEOUT, metadata=md),
    "Tokenize": lambda stub, md: stub.Tokenize(REQUEST, timeout=TIMEOUT, metadata=md),
}


@pytest.mark.parametrize("method", sorted(GUARDED))
@pytest.mark.parametrize(
    "metadata",
    [(), bearer("Bearer wrong"), bearer(KEY), bearer(f"Basic {KEY}")],
    ids=["none", "wrong key", "no scheme", "other scheme"],
)
def test_guarded_calls_without_the_key_are_unauthenticated(keyed_server, method, metadata):
    with pytest.raises(grpc.RpcError) as raised:
        GUARDED[method](keyed_server.stub, metadata)
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error_info(raised.value) == ("unauthorized", "unauthorized")


@pytest.mark.parametrize("method", sorted(GUARDED))
@pytest.mark.parametrize("value", [f"Bearer {KEY}", f"bearer {KEY.upper()}"], ids=["exact", "other case"])
def test_guarded_calls_with_the_key_are_served(keyed_server, method, value):
    assert GUARDED[method](keyed_server.stub, bearer(value))  # TGI compares case-insensitively


def test_probes_and_info_need_no_key(keyed_server):
    stub = keyed_server.stub
    assert stub.Info(pb.InfoRequest(), timeout=TIMEOUT).model_id
    stub.Health(pb.HealthRequest(), timeout=TIMEOUT)
    assert stub.Metrics(pb.MetricsRequest(), timeout=TIMEOUT).data
    assert stub.ListModels(pb.ListModelsRequest(), timeout=TIMEOUT).data
    health = health_pb2_grpc.HealthStub(keyed_server.channel)
    status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_the_python_client_sends_its_api_key(keyed_server):
    with Client(keyed_server.target, api_key=KEY) as client:
        assert client.generate("hello", max_new_tokens=2).generated_text is not None
    with Client(keyed_server.target) as client, pytest.raises(AuthenticationError):
        client.generate("hello", max_new_tokens=2)


def test_without_a_key_configured_nothing_is_checked(tiny_grpc_server):
    assert tiny_grpc_server.stub.Generate(REQUEST, timeout=TIMEOUT, metadata=bearer("Bearer anything"))
