"""The OpenAPI document: a fresh rendering of the proto (committed as protos/textgen/openapi.json),
covering every REST route with its request and response schemas and error shapes, every `$ref`
resolvable, and the Lua filter's shapes spelled out (TGI's list-of-lists top tokens, the unwrapped
`/` and `/tokenize` answers, nullable floats)."""

from __future__ import annotations

import json

from gateway import contract, openapi


def _refs(node) -> list[str]:
    if isinstance(node, dict):
        return ([node["$ref"]] if "$ref" in node else []) + [r for value in node.values() for r in _refs(value)]
    if isinstance(node, list):
        return [r for item in node for r in _refs(item)]
    return []


def test_committed_document_is_fresh():
    assert openapi.OUTPUT.read_text() == openapi.render(), "stale: make protos"


def test_every_route_with_its_schemas_and_errors():
    document = openapi.document()
    for route in contract.rest_routes():
        path, _ = openapi._openapi_path(route)
        operation = document["paths"][path][route.method.lower()]
        assert "200" in operation["responses"]
        if route.method == "POST":
            assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        anthropic_route = route.kind.startswith("anthropic")
        openai_route = not anthropic_route and (route.kind.startswith("openai") or route.path.startswith("/v1/"))
        if anthropic_route:
            assert operation["tags"] == ["Anthropic"]
            assert operation["responses"]["400"]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/AnthropicErrorResponse"
            }
        if route.kind in ("json", "stream") and not openai_route:
            assert operation["responses"]["422"]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/ErrorResponse"
            }
        if openai_route:
            assert operation["responses"]["404"]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/OpenAIErrorResponse"
            }
    assert document["paths"]["/v1/models/{id}"]["get"]["parameters"][0]["name"] == "id"
    schemas = document["components"]["schemas"]
    for ref in _refs(document):
        assert ref.removeprefix("#/components/schemas/") in schemas, ref


def test_the_gateways_shapes_are_spelled_out():
    document = openapi.document()
    schemas = document["components"]["schemas"]
    top_tokens = schemas["Details"]["properties"]["top_tokens"]
    assert top_tokens["type"] == "array" and top_tokens["items"]["type"] == "array"  # TGI's list of lists
    assert top_tokens["items"]["items"] == {"$ref": "#/components/schemas/Token"}
    compat = document["paths"]["/"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert compat["type"] == "array"  # the `responses` field, unwrapped
    assert schemas["PrefillToken"]["properties"]["logprob"]["nullable"] is True  # the first one is null
    stream = document["paths"]["/generate_stream"]["post"]["responses"]["200"]["content"]
    assert list(stream) == ["text/event-stream"]
    assert json.loads(json.dumps(document)) == document  # plain JSON
