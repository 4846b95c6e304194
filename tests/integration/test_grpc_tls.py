"""TLS and mutual TLS on the gRPC port (`--tls-cert`, `--tls-key`, `--tls-client-ca`), with
certificates made by the test: callers that trust the CA get through, plaintext callers and (with
mutual TLS) callers without a certificate the CA signed do not; our client connects with its
`credentials`."""

from __future__ import annotations

import grpc
import pytest

from inference_service.api.server import StartupError
from tests.certs import make_certs
from textgen.v1 import generate_pb2 as pb
from textgen.v1 import generate_pb2_grpc

REQUEST = pb.GenerateRequest(inputs="hello", parameters=pb.GenerateParameters(max_new_tokens=3))


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


def _generate(target: str, credentials: grpc.ChannelCredentials | None) -> pb.GenerateResponse:
    channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    with channel:
        return generate_pb2_grpc.TextGenerationStub(channel).Generate(REQUEST, timeout=20)


def _fails(target: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as raised:
        _generate(target, credentials)
    return raised.value.code()


def test_tls(start_grpc_server, tiny_engine_config, certs):
    server = start_grpc_server(tiny_engine_config, tls_cert=str(certs.server_cert), tls_key=str(certs.server_key))
    target = f"localhost:{server.port}"
    assert _generate(target, grpc.ssl_channel_credentials(certs.read("ca"))).generated_text
    assert _fails(target, None) == grpc.StatusCode.UNAVAILABLE  # plaintext is not spoken
    assert _fails(target, grpc.ssl_channel_credentials()) == grpc.StatusCode.UNAVAILABLE  # untrusted


def test_mutual_tls(start_grpc_server, tiny_engine_config, certs):
    server = start_grpc_server(
        tiny_engine_config, tls_cert=str(certs.server_cert), tls_key=str(certs.server_key), tls_client_ca=str(certs.ca)
    )
    target = f"localhost:{server.port}"
    ca = certs.read("ca")
    with_client_cert = grpc.ssl_channel_credentials(ca, certs.read("client_key"), certs.read("client_cert"))
    assert _generate(target, with_client_cert).generated_text
    assert _fails(target, grpc.ssl_channel_credentials(ca)) == grpc.StatusCode.UNAVAILABLE  # no certificate
    stranger = grpc.ssl_channel_credentials(ca, certs.read("stranger_key"), certs.read("stranger_cert"))
    assert _fails(target, stranger) == grpc.StatusCode.UNAVAILABLE  # a certificate another CA signed


async def test_our_client_over_mutual_tls(start_grpc_server, tiny_engine_config, certs):
    from textgen_client import AsyncClient

    server = start_grpc_server(
        tiny_engine_config, tls_cert=str(certs.server_cert), tls_key=str(certs.server_key), tls_client_ca=str(certs.ca)
    )
    credentials = grpc.ssl_channel_credentials(certs.read("ca"), certs.read("client_key"), certs.read("client_cert"))
    async with AsyncClient(f"localhost:{server.port}", credentials=credentials) as client:
        assert (await client.generate("hello", max_new_tokens=3)).generated_text


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tls_cert": "/nonexistent/cert.pem", "tls_key": "/nonexistent/key.pem"}, "--tls-key '/nonexistent/key.pem'"),
        ({"tls_cert": __file__, "tls_key": __file__}, "is not a PEM file"),
    ],
)
def test_bad_certificate_files_are_a_clear_startup_error(start_grpc_server, tiny_engine_config, options, message):
    with pytest.raises(StartupError, match=message):
        start_grpc_server(tiny_engine_config, load=False, **options)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tls_cert": "c.pem"}, "go together"),
        ({"tls_client_ca": "ca.pem"}, "needs --tls-cert"),
    ],
)
def test_incomplete_tls_settings_are_refused(options, message):
    from inference_service.api.config import ServerConfig

    with pytest.raises(ValueError, match=message):
        ServerConfig(**options)
