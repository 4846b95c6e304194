"""Hostile requests through the real Envoy, each while an innocent chat stream runs on the same
Envoy → server connection: the hostile one gets a clear, short error (or, when its parameters are
merely extreme, an answer), and the stream ends with its full body and `[DONE]`, as it does alone.

An error message that repeated a 100 KB input used to overflow the gRPC trailer limit: the hop
reset the shared HTTP/2 connection, and every stream on it ended mid-body without `[DONE]`.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from rest_helpers import sse_events, status_and_body

from inference_service.api.errors import MAX_MESSAGE_BYTES

BIG = "x" * 100_000
BYSTANDER = {
    "messages": [{"role": "user", "content": "the quick brown fox"}],
    "max_tokens": 300,  # the tiny model's greedy answer runs to the limit: a long stream
    "temperature": 0,
    "stream": True,
}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
TOOL = {"type": "function", "function": {"name": BIG, "parameters": {"type": "object"}}}
CLASS_NAMES = ("Error:", "Exception", "jinja2", "Traceback", "DecodeError")


@pytest.fixture(scope="module")
def chat_gateway(tiny_chat_grpc_server, start_gateway):
    return start_gateway(tiny_chat_grpc_server)


def post(gateway, path: str, body: dict, timeout: float = 60) -> tuple[int, str]:
    """(status, body) of a JSON POST with curl, the body on stdin (a 100 KB argument is too long)."""
    command = ["curl", "-s", "-i", "--max-time", str(timeout), gateway.url + path, "-X", "POST"]
    command += ["-H", "Content-Type: application/json", "--data-binary", "@-"]
    done = subprocess.run(command, input=json.dumps(body), capture_output=True, text=True, timeout=timeout + 5)
    status, _, text = status_and_body(done.stdout)
    return status, text


def start_stream(gateway) -> subprocess.Popen:
    """The bystander: a greedy chat stream, read once its first event has arrived."""
    command = ["curl", "-sN", "--max-time", "120", gateway.url + "/v1/chat/completions", "-X", "POST"]
    command += ["-H", "Content-Type: application/json", "-d", json.dumps(BYSTANDER)]
    stream = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    first = stream.stdout.readline()
    assert first.startswith("data: {"), first
    stream.first_line = first  # type: ignore[attr-defined]
    return stream


def finish_stream(stream: subprocess.Popen) -> tuple[str, str | None, str]:
    """(content, finish reason, last line) of the bystander's whole SSE body."""
    body = stream.first_line + stream.stdout.read()  # type: ignore[attr-defined]
    assert stream.wait(30) == 0, body[-300:]
    events = body.split("\n\n")[:-1]
    assert events and events[-1] == "data: [DONE]", body[-300:]
    chunks = sse_events("\n\n".join(events[:-1]) + "\n\n")
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    return content, (finish[-1] if finish else None), events[-1]


@pytest.fixture(scope="module")
def alone(chat_gateway):
    """The bystander's answer with nothing else running."""
    content, finish, _ = finish_stream(start_stream(chat_gateway))
    assert finish == "length" and len(content) > 100
    return content


def assert_short_clear_error(status: int, text: str) -> str:
    """A 4xx JSON error whose message is short and names no exception class; returns the message."""
    assert 400 <= status < 500, (status, text[:300])
    error = json.loads(text)["error"]
    message = error["message"] if isinstance(error, dict) else error
    assert len(message.encode()) <= MAX_MESSAGE_BYTES, len(message)
    assert not any(name in message for name in CLASS_NAMES), message
    return message


HOSTILE = {
    "forced_bos_token": ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2, "forced_bos_token": BIG}}),
    "regex": ("/generate", {"inputs": "hi", "parameters": {"grammar": {"type": "regex", "value": "(" + BIG}}}),
    "grammar_type": ("/generate", {"inputs": "hi", "parameters": {"grammar": {"type": BIG, "value": "a"}}}),
    "logit_bias_key": ("/v1/chat/completions", {**CHAT, "logit_bias": {BIG: 1}}),
    "tool_name_twice": ("/v1/chat/completions", {**CHAT, "tools": [TOOL, TOOL]}),
    "tool_choice": (
        "/v1/chat/completions",
        {
            **CHAT,
            "tools": [{**TOOL, "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": BIG}},
        },
    ),
    "role": ("/v1/chat/completions", {**CHAT, "messages": [{"role": BIG, "content": "hi"}]}),
    "content_part": ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": BIG}]}]}),
    "response_format": ("/v1/chat/completions", {**CHAT, "response_format": {"type": BIG}}),
}


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_an_error_repeating_a_huge_input_is_short_and_cuts_no_stream(chat_gateway, alone, kind):
    path, body = HOSTILE[kind]
    stream = start_stream(chat_gateway)
    status, text = post(chat_gateway, path, body)
    running = chat_gateway.server.engine.stats().num_running
    message = assert_short_clear_error(status, text)
    assert "x" * 65 not in message  # the input is quoted short where the message is written
    assert running >= 1, "the bystander ended before the hostile request: nothing was checked"
    content, finish, _ = finish_stream(stream)
    assert (content, finish) == (alone, "length")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 3, "temperature": 1e-45}}),
        (
            "/generate",
            {"inputs": "Hello", "parameters": {"max_new_tokens": 3, "repetition_penalty": 1e-45, "do_sample": True}},
        ),
        ("/v1/chat/completions", {**CHAT, "temperature": 1e-45}),
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 3, "temperature": 1e-45}),
    ],
    ids=["tgi-temperature", "tgi-repetition-penalty", "chat-temperature", "completions-temperature"],
)
def test_extreme_sampling_parameters_answer_and_hurt_no_stream(chat_gateway, alone, path, body):
    """A temperature or penalty that used to overflow the logits (and fail every request sampled
    in that step, the bystander's too) is answered like any other request."""
    stream = start_stream(chat_gateway)
    status, text = post(chat_gateway, path, body)
    assert status == 200, text[:300]
    content, finish, _ = finish_stream(stream)
    assert (content, finish) == (alone, "length")


def test_openai_temperature_above_two_is_refused_as_openai_does(chat_gateway):
    status, text = post(chat_gateway, "/v1/chat/completions", {**CHAT, "temperature": 2.5})
    assert status == 400 and "`temperature` must be >= 0.0 and <= 2.0" in assert_short_clear_error(status, text)
