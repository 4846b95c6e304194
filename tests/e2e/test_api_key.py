"""`--api-key` through Envoy, as TGI answers: generation routes need `Authorization: Bearer <key>`
(a bare 401 otherwise, streams included), health, info, metrics and the model list stay open. (That
a key from `--api-key-file` shows on no replica's command line: tests/e2e/test_replicas.py.)"""

from __future__ import annotations

import warnings

import pytest
from rest_helpers import status_and_body

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import text_generation

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

KEY = "s3cret-Key"
GENERATE = {"inputs": "hello", "parameters": {"max_new_tokens": 2}}


@pytest.fixture(scope="module")
def keyed_gateway(tiny_engine_config, start_gateway):
    from tests.conftest import GrpcServerThread

    server = GrpcServerThread(tiny_engine_config, api_key=KEY)
    yield start_gateway(server)
    server.stop(timeout_s=1.0)


GUARDED_ROUTES = [
    ("/generate", GENERATE),
    ("/generate_stream", GENERATE),
    ("/", GENERATE),
    ("/", {**GENERATE, "stream": True}),
    ("/invocations", GENERATE),
    ("/tokenize", {"inputs": "hello"}),
]


@pytest.mark.parametrize(("path", "body"), GUARDED_ROUTES)
@pytest.mark.parametrize("auth", [None, "Bearer wrong"], ids=["no header", "wrong key"])
def test_generation_routes_refuse_without_the_key(keyed_gateway, path, body, auth):
    extra = ("-H", f"Authorization: {auth}") if auth else ()
    status, headers, text = status_and_body(keyed_gateway.curl(path, "-i", *extra, body=body))
    assert (status, text) == (401, "")
    assert not any(name.startswith("grpc-") or name == "x-error-type" for name in headers)


@pytest.mark.parametrize(("path", "body"), GUARDED_ROUTES)
def test_generation_routes_serve_with_the_key(keyed_gateway, path, body):
    status, _, text = status_and_body(keyed_gateway.curl(path, "-i", "-H", f"authorization: bearer {KEY}", body=body))
    assert status == 200 and text


@pytest.mark.parametrize("path", ["/health", "/info", "/metrics", "/v1/models"])
def test_open_routes_need_no_key(keyed_gateway, path):
    status, _, _ = status_and_body(keyed_gateway.curl(path, "-i"))
    assert status == 200


def test_tgi_client_with_its_authorization_header(keyed_gateway):
    client = text_generation.Client(keyed_gateway.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert client.generate("hello", max_new_tokens=2).details.generated_tokens == 2
    anonymous = text_generation.Client(keyed_gateway.url, timeout=60)
    # Against TGI too, the client fails to read the bare 401 as JSON: it has no class for it.
    with pytest.raises(ValueError, match="Expecting value"):
        anonymous.generate("hello", max_new_tokens=2)
