"""The per-request log line: one per call at INFO, its fields, its trace id, and never the prompt."""

from __future__ import annotations

import json
import logging

import grpc
import pytest

from inference_service.observability.logging import JsonFormatter, TextFormatter
from textgen.v1 import generate_pb2 as pb

TIMEOUT = 60
SECRET_PROMPT = "my secret prompt text"


def request_records(caplog) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name == "inference_service.requests"]


def test_one_line_per_request_with_its_fields(tiny_grpc_server, caplog, traceparent):
    trace_id, _, header = traceparent
    metadata = (("traceparent", header), ("x-request-id", "req-42"))
    with caplog.at_level(logging.INFO):
        response = tiny_grpc_server.stub.Generate(
            pb.GenerateRequest(inputs=SECRET_PROMPT, parameters=pb.GenerateParameters(max_new_tokens=3, details=True)),
            metadata=metadata,
            timeout=TIMEOUT,
        )
        list(
            tiny_grpc_server.stub.GenerateStream(
                pb.GenerateRequest(inputs=SECRET_PROMPT, parameters=pb.GenerateParameters(max_new_tokens=2)),
                timeout=TIMEOUT,
            )
        )
    first, second = request_records(caplog)
    assert first.levelno == logging.INFO
    fields = first.fields
    num_prompt_tokens = len(
        tiny_grpc_server.stub.Tokenize(pb.GenerateRequest(inputs=SECRET_PROMPT), timeout=TIMEOUT).tokens
    )
    assert fields["request_id"] == "req-42" and fields["method"] == "Generate"
    assert fields["input_tokens"] == num_prompt_tokens
    assert fields["generated_tokens"] == response.details.generated_tokens == 3
    assert fields["finish_reason"] == "length" and fields["trace_id"] == trace_id
    for name in (
        "total_time",
        "validation_time",
        "queue_time",
        "inference_time",
        "time_per_token",
        "time_to_first_token",
    ):
        assert fields[name] >= 0, name
    assert fields["total_time"] >= fields["inference_time"]
    assert second.fields["method"] == "GenerateStream" and len(second.fields["request_id"]) == 32
    assert "trace_id" not in second.fields  # no caller context, no tracing: nothing to correlate
    for record in caplog.records:  # whatever any logger wrote, as text and as JSON
        assert SECRET_PROMPT not in TextFormatter().format(record)
        assert SECRET_PROMPT not in JsonFormatter().format(record)


def test_a_failed_request_logs_its_kind(tiny_grpc_server, caplog):
    bad = pb.GenerateRequest(inputs=SECRET_PROMPT, parameters=pb.GenerateParameters(temperature=0.0))
    with caplog.at_level(logging.INFO), pytest.raises(grpc.RpcError):
        tiny_grpc_server.stub.Generate(bad, timeout=TIMEOUT)
    [record] = request_records(caplog)
    assert record.levelno == logging.INFO
    assert record.fields["error"] == "validation" and "generated_tokens" not in record.fields


def make_record(fields: dict | None = None) -> logging.LogRecord:
    record = logging.LogRecord("inference_service.requests", logging.INFO, __file__, 1, "%s ok", ("Generate",), None)
    if fields is not None:
        record.fields = fields
    return record


def test_json_lines_carry_the_fields():
    entry = json.loads(
        JsonFormatter().format(make_record({"request_id": "r1", "total_time": 0.25, "finish_reason": "length"}))
    )
    assert entry["message"] == "Generate ok" and entry["level"] == "INFO"
    assert entry["target"] == "inference_service.requests"
    assert (entry["request_id"], entry["total_time"], entry["finish_reason"]) == ("r1", 0.25, "length")
    assert set(json.loads(JsonFormatter().format(make_record()))) == {"timestamp", "level", "target", "message"}


def test_text_lines_append_key_values():
    line = TextFormatter().format(make_record({"request_id": "r1", "total_time": 0.123456789, "note": "a b"}))
    assert line.endswith('inference_service.requests: Generate ok request_id=r1 total_time=0.123457 note="a b"')
