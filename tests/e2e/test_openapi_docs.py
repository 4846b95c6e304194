"""`/openapi.json` and `/docs` through the gateway: the served document is the committed one
generated from the proto; live responses of every kind of route validate against it (strictly: no
field the document does not name); Swagger UI in headless Chromium (Debian's package) lists every
route, and its screenshot is taken."""

from __future__ import annotations

import json
import shutil
import subprocess

import jsonschema
import pytest

from gateway.openapi import OUTPUT
from tests.e2e.conftest import nullable_to_json_schema
from tests.e2e.rest_helpers import sse_events, status_and_body


@pytest.fixture(scope="module")
def docs_gateway(tiny_chat_grpc_server, start_gateway):
    return start_gateway(tiny_chat_grpc_server)


@pytest.fixture(scope="module")
def document(docs_gateway) -> dict:
    return json.loads(docs_gateway.curl("/openapi.json"))


def _strict(node):
    """Objects that name their properties allow no others (what the document says is all there is)."""
    if isinstance(node, list):
        return [_strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _strict(value) for key, value in node.items()}
    if node.get("type") in ("object", ["object", "null"]) and "properties" in node:
        node.setdefault("additionalProperties", False)
    return node


def check(document: dict, instance, path: str, method: str, status: str = "200") -> None:
    content = document["paths"][path][method]["responses"][status]["content"]
    schema = next(iter(content.values()))["schema"]
    components = _strict(nullable_to_json_schema(document["components"]))
    jsonschema.validate(instance, {**_strict(nullable_to_json_schema(schema)), "components": components})


def test_the_served_document_is_the_committed_one(document):
    assert document == json.loads(OUTPUT.read_text())


def test_tgi_responses_validate(docs_gateway, document):
    body = {
        "inputs": "hello",
        "parameters": {
            "max_new_tokens": 4,
            "details": True,
            "decoder_input_details": True,
            "top_n_tokens": 2,
            "do_sample": True,
            "seed": 3,
        },
    }
    check(document, json.loads(docs_gateway.curl("/generate", body=body)), "/generate", "post")
    check(document, json.loads(docs_gateway.curl("/", body=body)), "/", "post")
    for event in sse_events(docs_gateway.curl("/generate_stream", body=body)):
        check(document, event, "/generate_stream", "post")
    check(document, json.loads(docs_gateway.curl("/tokenize", body={"inputs": "hello world"})), "/tokenize", "post")
    check(document, json.loads(docs_gateway.curl("/info")), "/info", "get")
    status, _, error = status_and_body(docs_gateway.curl("/generate", "-i", body={"inputs": "", "parameters": {}}))
    assert status == 422
    check(document, json.loads(error), "/generate", "post", "422")


def test_openai_responses_validate(docs_gateway, document):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True, "top_logprobs": 2}
    check(document, json.loads(docs_gateway.curl("/v1/chat/completions", body=chat)), "/v1/chat/completions", "post")
    events = docs_gateway.curl("/v1/chat/completions", body={**chat, "stream": True}).split("\n\n")
    chunks = [json.loads(e.removeprefix("data: ")) for e in events if e.startswith("data: {")]
    assert chunks
    for chunk in chunks:
        check(document, chunk, "/v1/chat/completions/stream", "post")
    completion = {"prompt": "hello", "max_tokens": 3}
    check(document, json.loads(docs_gateway.curl("/v1/completions", body=completion)), "/v1/completions", "post")
    check(document, json.loads(docs_gateway.curl("/v1/models")), "/v1/models", "get")
    models = json.loads(docs_gateway.curl("/v1/models"))
    check(document, json.loads(docs_gateway.curl("/v1/models/" + models["data"][0]["id"])), "/v1/models/{id}", "get")
    status, _, error = status_and_body(docs_gateway.curl("/v1/models/no-such-model", "-i"))
    assert status == 404
    check(document, json.loads(error), "/v1/models/{id}", "get", "404")


@pytest.mark.parametrize("page", ["/docs", "/docs/"])
def test_swagger_ui_lists_every_route(docs_gateway, document, tmp_path, page):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "Chromium is needed: `make test` installs Debian's chromium package"
    flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=20000"]
    dom = subprocess.run(
        [*flags, "--dump-dom", docs_gateway.url + page], capture_output=True, text=True, timeout=120
    ).stdout
    listed = {segment.split('"')[0] for segment in dom.split('data-path="')[1:]}
    assert listed == set(document["paths"]), set(document["paths"]) ^ listed
    if page.endswith("/"):
        return  # one screenshot is enough
    screenshot = tmp_path / "docs.png"
    subprocess.run(
        [*flags, "--window-size=1280,2000", f"--screenshot={screenshot}", docs_gateway.url + page],
        capture_output=True,
        timeout=120,
    )
    assert screenshot.read_bytes().startswith(b"\x89PNG") and screenshot.stat().st_size > 20_000


@pytest.mark.parametrize("path", ["/docs/a/swagger-ui.css", "/docs/docs/swagger-ui.css", "/docs/../../etc/passwd"])
def test_files_the_docs_do_not_have_are_404_at_any_depth(docs_gateway, path):
    status, _, body = status_and_body(docs_gateway.curl(path, "-i", "--path-as-is"))
    assert status == 404, body
    assert json.loads(body)["error_type"] == "not_found"
