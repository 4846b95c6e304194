"""`launch` with TLS: Envoy's port speaks TLS to REST and gRPC callers (mutual TLS with a client
CA), and Envoy speaks TLS to the engine (presenting the server's certificate where the engine
demands one); one replica in-process, or two. Certificates are made by the test."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request

import grpc
import pytest

from tests.certs import make_certs
from textgen.v1 import generate_pb2 as pb
from textgen.v1 import generate_pb2_grpc

BODY = json.dumps({"inputs": "hello", "parameters": {"max_new_tokens": 3}}).encode()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


def _post(url: str, context: ssl.SSLContext) -> int:
    request = urllib.request.Request(url + "/generate", data=BODY, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30, context=context) as response:
        return response.status


def _context(certs, client_cert: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs.ca))
    if client_cert:
        context.load_cert_chain(str(certs.client_cert), str(certs.client_key))
    return context


def test_mutual_tls_through_envoy_to_the_engine(launched, certs):
    run = launched(
        "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key), "--tls-client-ca", str(certs.ca)
    )
    ready = run.wait_for(r"ready: TGI REST API on (https://\S+), gRPC API on port (\d+)")
    url, engine_port = ready.group(1).replace("127.0.0.1", "localhost"), int(ready.group(2))
    assert _post(url, _context(certs, client_cert=True)) == 200
    refused = (ssl.SSLError, urllib.error.URLError, ConnectionError)  # how a failed handshake surfaces
    with pytest.raises(refused):
        _post(url, _context(certs, client_cert=False))  # no client certificate: the handshake fails
    with pytest.raises(refused):
        _post(url.replace("https://", "http://"), _context(certs, client_cert=True))  # plaintext

    credentials = grpc.ssl_channel_credentials(certs.read("ca"), certs.read("client_key"), certs.read("client_cert"))
    for target in (url.removeprefix("https://"), f"localhost:{engine_port}"):  # through Envoy, and direct
        with grpc.secure_channel(target, credentials) as channel:
            reply = generate_pb2_grpc.TextGenerationStub(channel).Generate(
                pb.GenerateRequest(inputs="hello", parameters=pb.GenerateParameters(max_new_tokens=3)), timeout=30
            )
        assert reply.generated_text


def test_tls_with_replicas(launched, certs):
    run = launched("--num-replicas", "2", "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key))
    url = run.wait_for(r"ready: TGI REST API on (https://\S+) \(gRPC too\)").group(1).replace("127.0.0.1", "localhost")
    assert _post(url, _context(certs, client_cert=False)) == 200
    with pytest.raises(urllib.error.URLError):
        _post(url, ssl.create_default_context())  # the system's roots don't know the test CA
