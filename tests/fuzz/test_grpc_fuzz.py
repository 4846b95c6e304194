"""The gRPC API under hypothesis-generated requests: every field of every generation RPC's request,
with careless and hostile values. Each call ends within its deadline with a result or a typed error
(INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, or INTERNAL typed `generation`); never UNKNOWN (an
unexpected exception), never a hang; afterwards the server is healthy and every KV block is free.

`make test` runs FUZZ_EXAMPLES (default 60) cases per RPC, derandomized (the same cases each run);
the full run, `make fuzz`, runs 1,700 per RPC (10,200 cases) and the REST fuzz; its figures are in
the README.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference_service.config import LimitsConfig
from tests.fuzz.proto_strategies import messages, mutations
from textgen.v1 import generate_pb2 as pb

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "60"))
DEADLINE_S = 60.0
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED}
GENERATE = pb.GenerateRequest(inputs="the quick brown fox", parameters=pb.GenerateParameters(max_new_tokens=6))
CHAT = pb.ChatCompletionRequest(messages=[pb.ChatMessage(role="user")], max_tokens=6)
CHAT.messages[0].content.string_value = "hello"
COMPLETION = pb.CompletionRequest(max_tokens=6)
COMPLETION.prompt.string_value = "the quick brown fox"
# RPC → (a valid request to mutate, streams)
RPCS = {
    "Generate": (GENERATE, False),
    "GenerateStream": (GENERATE, True),
    "Tokenize": (GENERATE, False),
    "ChatCompletion": (CHAT, False),
    "ChatCompletionStream": (CHAT, True),
    "Completion": (COMPLETION, False),
}
OUTCOMES: Counter = Counter()


@pytest.fixture(scope="module")
def server(tiny_chat_engine_config):
    from tests.conftest import GrpcServerThread

    config = dataclasses.replace(
        tiny_chat_engine_config,
        limits=LimitsConfig(
            max_total_tokens=tiny_chat_engine_config.limits.max_total_tokens, max_concurrent_requests=64
        ),
    )
    server = GrpcServerThread(config)
    yield server
    server.stop(timeout_s=1.0)


def _call(server, rpc: str, request, streams: bool) -> None:
    method = getattr(server.stub, rpc)
    try:
        if streams:
            for _ in method(request, timeout=DEADLINE_S):
                pass
        else:
            method(request, timeout=DEADLINE_S)
        OUTCOMES[(rpc, "OK")] += 1
    except grpc.RpcError as error:
        code = error.code()
        error_type = dict(error.trailing_metadata() or ()).get("x-error-type")
        OUTCOMES[(rpc, code.name)] += 1
        assert code != grpc.StatusCode.DEADLINE_EXCEEDED, f"{rpc} hung: {request}"
        typed_generation_error = code == grpc.StatusCode.INTERNAL and error_type == "generation"
        assert code in ALLOWED or typed_generation_error, (code, error.details(), error_type, request)


@pytest.mark.parametrize("rpc", list(RPCS))
def test_fuzzed_requests_end_with_a_result_or_a_typed_error(server, rpc):
    base, streams = RPCS[rpc]

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(st.one_of(messages(base.DESCRIPTOR), mutations(base)))
    def run(request):
        _call(server, rpc, request, streams)

    run()
    stats = server.wait_idle(timeout=30)
    assert stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks
    health = health_pb2_grpc.HealthStub(server.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert sum(count for (name, _), count in OUTCOMES.items() if name == rpc) >= EXAMPLES
    print(f"\n{rpc}: {dict((code, n) for (name, code), n in sorted(OUTCOMES.items()) if name == rpc)}")
