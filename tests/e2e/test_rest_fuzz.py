"""TGI's and OpenAI's REST routes fuzzed by schemathesis from the gateway's own `/openapi.json`
(the real Envoy in front of a tiny-model server): every answer has a status, content type and body
the document declares, no 5xx but the documented ones, and afterwards the server is healthy with
every KV block free.

`make test` runs FUZZ_EXAMPLES (default 60) cases per operation, derandomized; the full run is the
command in tests/fuzz/test_grpc_fuzz.py's docstring (both suites read FUZZ_EXAMPLES).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi import checks as openapi_checks

from gateway.openapi import OUTPUT as OPENAPI
from inference_service.config import LimitsConfig

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "60"))
# Documented 5xx answers (the document lists them): a generation error (TGI 424 is 4xx) or an
# unavailable server; anything else in 5xx is a bug.
DOCUMENTED_5XX = {500: "generation", 503: "unavailable"}
CHECKS = [
    openapi_checks.status_code_conformance,
    openapi_checks.content_type_conformance,
    openapi_checks.response_schema_conformance,
]
STATUSES: Counter = Counter()


@pytest.fixture(scope="module")
def fuzzed_gateway(tiny_chat_engine_config, start_gateway):
    from tests.conftest import GrpcServerThread

    config = dataclasses.replace(
        tiny_chat_engine_config,
        limits=LimitsConfig(
            max_total_tokens=tiny_chat_engine_config.limits.max_total_tokens, max_concurrent_requests=64
        ),
    )
    server = GrpcServerThread(config)
    yield start_gateway(server)
    server.stop(timeout_s=1.0)


@pytest.fixture(scope="module")
def operations(fuzzed_gateway) -> dict:
    # The served document (from_url would leave out the document's own route).
    schema = schemathesis.openapi.from_dict(json.loads(fuzzed_gateway.curl("/openapi.json")))
    return {operation.label: operation for operation in (result.ok() for result in schema.get_all_operations())}


# Driven through hypothesis directly (schemathesis's pytest plugin predates pytest 9).
@pytest.mark.parametrize(
    "label",
    [
        f"{method.upper()} {path}"
        for path, methods in json.loads(OPENAPI.read_text())["paths"].items()
        for method in methods
    ],
)
def test_rest_routes_answer_as_documented(operations, fuzzed_gateway, label):
    operation = operations[label]

    @settings(
        max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(operation.as_strategy())
    def run(case):
        response = case.call(base_url=fuzzed_gateway.url, timeout=60)
        STATUSES[(label, response.status_code)] += 1
        case.validate_response(response, checks=CHECKS)
        if response.status_code >= 500:
            body = response.json() if "json" in response.headers.get("content-type", "") else {}
            error_type = body.get("error_type") or (body.get("error") or {}).get("type")
            assert response.status_code in DOCUMENTED_5XX, (response.status_code, response.text[:300])
            assert error_type, response.text[:300]

    run()


def test_the_server_is_healthy_and_nothing_leaked_after_the_fuzz(fuzzed_gateway):
    stats = fuzzed_gateway.server.wait_idle(timeout=30)
    assert stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks
    assert fuzzed_gateway.curl("/health", "-o", "/dev/null", "-w", "%{http_code}") == "200"
    by_status: Counter = Counter()
    for (_, status), count in STATUSES.items():
        by_status[status] += count
    print(f"\nREST fuzz: {sum(STATUSES.values())} cases: {dict(sorted(by_status.items()))}")
