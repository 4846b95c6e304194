"""OpenAI's API through the real Envoy, called with the official `openai` SDK and with
`huggingface_hub`'s `chat_completion`, unchanged; answers are checked against the same calls over
gRPC and against the engine's own greedy tokens."""

from __future__ import annotations

import json
import subprocess
import time

import jsonschema
import openai
import pytest

from tests.tool_schemas import TIME_ZONE_PARAMETERS
from textgen.v1 import generate_pb2 as pb

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "the quick brown fox"}]
# Small definitions: the tiny model's context is 512 tokens of a 330-token vocabulary.
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Tokyo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": TIME_ZONE_PARAMETERS,
    },
}
SHORT_TOOL_PROMPT = {"tool_prompt": "Tools:"}  # TGI's field, sent as the SDK's extra_body
TOOL_MESSAGES = [{"role": "user", "content": "weather?"}]


@pytest.fixture(scope="module")
def chat_gateway(tiny_chat_grpc_server, start_gateway):
    return start_gateway(tiny_chat_grpc_server)


@pytest.fixture(scope="module")
def client(chat_gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=chat_gateway.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def rendered_prompt(server, messages) -> str:
    return server.server.front_end.chat_template.render(messages)


def engine_greedy(server, prompt: str, max_new_tokens: int):
    """The engine's greedy result for a prompt the template already rendered (no special tokens added)."""
    from inference_service.frontend.parameters import GenerateParameters, GenerateRequest

    request = GenerateRequest(
        inputs=prompt, parameters=GenerateParameters(max_new_tokens=max_new_tokens), add_special_tokens=False
    )
    validated = server.call(server.server.front_end.validate(request, stream=False))
    return server.call(server.server.engine.generate(validated.engine_request))


def test_chat_greedy_equals_the_engine_on_the_templated_prompt(client, chat_gateway):
    response = client.chat.completions.create(
        model="any-name", messages=MESSAGES, temperature=0, max_tokens=12, logprobs=True
    )
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    assert response.model == chat_gateway.server.server.engine.info.model_id  # the served id, whatever was asked
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    expected = engine_greedy(chat_gateway.server, rendered_prompt(chat_gateway.server, MESSAGES), 12)
    assert choice.message.content == expected.generated_text
    assert [e.logprob for e in choice.logprobs.content] == pytest.approx(
        [t.logprob for t in expected.tokens if not t.special], abs=1e-5
    )
    assert response.usage.completion_tokens == expected.num_generated_tokens
    assert response.usage.total_tokens == response.usage.prompt_tokens + expected.num_generated_tokens
    tokenizer = chat_gateway.server.server.engine.tokenizer
    prompt_ids = tokenizer.encode(rendered_prompt(chat_gateway.server, MESSAGES), add_special_tokens=False)
    assert response.usage.prompt_tokens == len(prompt_ids)


def test_chat_stream_has_role_first_usage_and_done(client, chat_gateway):
    whole = client.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=10)
    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=MESSAGES,
            temperature=0,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishing = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishing == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # Greedy: a sampled first token could be EOS, and the first event would then be the last.
    raw = chat_gateway.curl(
        "/v1/chat/completions", body={"messages": MESSAGES, "max_tokens": 3, "stream": True, "temperature": 0}
    )
    events = [line for line in raw.split("\n") if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    first = json.loads(events[0][len("data: ") :])
    assert first["choices"][0]["finish_reason"] is None and first["choices"][0]["logprobs"] is None


def test_n_seeded_choices_are_reproducible_and_differ(client):
    def ask():
        return client.chat.completions.create(
            model="m", messages=MESSAGES, n=3, seed=11, temperature=1.0, max_tokens=12
        )

    first, second = ask(), ask()
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in second.choices]
    assert len(set(texts)) == 3
    assert first.usage.completion_tokens >= 3
    streamed = list(
        client.chat.completions.create(
            model="m", messages=MESSAGES, n=3, seed=11, temperature=1.0, max_tokens=12, stream=True
        )
    )
    by_choice = ["", "", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            by_choice[choice.index] += choice.delta.content or ""
    assert by_choice == texts


def test_logprobs_with_top_alternatives(client):
    response = client.chat.completions.create(
        model="m", messages=MESSAGES, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3
    )
    content = response.choices[0].logprobs.content
    assert 1 <= len(content) <= 6
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)  # greedy: the top one
        raw = bytes(entry.bytes)  # a token that is part of a character shows its bytes, escaped
        assert entry.token in (raw.decode("utf-8", "replace"), "".join(f"\\x{byte:02x}" for byte in raw))
    # The tokens' bytes are the text's (a random model writes stray bytes: U+FFFD in the text, and an
    # unfinished character at the end is not text yet).
    joined = b"".join(bytes(entry.bytes) for entry in content).decode("utf-8", "replace")
    assert joined.startswith(response.choices[0].message.content)


def test_json_schema_response_format_validates(client):
    schema = {
        "type": "object",
        "properties": {
            "color": {"type": "string", "enum": ["red", "green"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["color", "count"],
        "additionalProperties": False,
    }
    response = client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        temperature=0,
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}},
    )
    jsonschema.validate(json.loads(response.choices[0].message.content), schema)
    assert response.choices[0].finish_reason == "stop"
    loose = client.chat.completions.create(
        model="m", messages=MESSAGES, temperature=1.0, seed=3, max_tokens=80, response_format={"type": "json_object"}
    )
    if loose.choices[0].finish_reason == "stop":  # a random model may run out of tokens inside a string
        assert isinstance(json.loads(loose.choices[0].message.content), dict)
    else:
        assert loose.choices[0].message.content.startswith("{")


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}], ids=["required", "named"]
)
def test_tool_calls_are_forced(client, tool_choice):
    response = client.chat.completions.create(
        model="m",
        messages=TOOL_MESSAGES,
        temperature=0,
        max_tokens=80,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        extra_body=SHORT_TOOL_PROMPT,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    schemas = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name]["function"]["parameters"])

    streamed = list(
        client.chat.completions.create(
            model="m",
            messages=TOOL_MESSAGES,
            temperature=0,
            max_tokens=80,
            tools=[WEATHER_TOOL, TIME_TOOL],
            tool_choice=tool_choice,
            parallel_tool_calls=False,
            stream=True,
            extra_body=SHORT_TOOL_PROMPT,
        )
    )
    deltas = [d for c in streamed for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == call.function.name and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert streamed[-1].choices[0].finish_reason == "tool_calls"


def test_auto_tool_choice_gives_text_or_a_valid_call(client):
    for seed in range(3):
        response = client.chat.completions.create(
            model="m",
            messages=TOOL_MESSAGES,
            temperature=1.0,
            seed=seed,
            max_tokens=60,
            tools=[WEATHER_TOOL],
            extra_body=SHORT_TOOL_PROMPT,
        )
        message = response.choices[0].message
        if message.tool_calls:
            assert response.choices[0].finish_reason == "tool_calls"
            jsonschema.validate(
                json.loads(message.tool_calls[0].function.arguments), WEATHER_TOOL["function"]["parameters"]
            )
        else:
            assert not message.content.lstrip().startswith("{")


def test_completions_with_a_list_of_prompts(client, chat_gateway):
    response = client.completions.create(model="m", prompt=["the quick", "brown fox"], temperature=0, max_tokens=5)
    assert response.object == "text_completion" and [c.index for c in response.choices] == [0, 1]
    for choice, prompt in zip(response.choices, ["the quick", "brown fox"], strict=True):
        request = pb.GenerateRequest(inputs=prompt, parameters=pb.GenerateParameters(max_new_tokens=5))
        assert choice.text == chat_gateway.server.stub.Generate(request, timeout=60).generated_text
    echoed = client.completions.create(
        model="m", prompt="the quick", temperature=0, max_tokens=4, echo=True, logprobs=2
    )
    assert echoed.choices[0].text.startswith("the quick")
    logprobs = echoed.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) >= 1
    assert logprobs.top_logprobs[0] is None  # the prompt's first token (test_openai_echo_logprobs.py)
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs[1:])  # alternatives with equal text share a key
    assert len("the quick") in logprobs.text_offset  # the generated tokens' offsets follow the prompt
    streamed = list(client.completions.create(model="m", prompt="the quick", temperature=0, max_tokens=5, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == response.choices[0].text


def test_models(client, chat_gateway):
    model_id = chat_gateway.server.server.engine.info.model_id
    assert [m.id for m in client.models.list()] == [model_id]
    assert client.models.retrieve(model_id).id == model_id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no/such-model")


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        ({"temperature": -1}, openai.BadRequestError),
        ({"n": 100}, openai.BadRequestError),
        ({"max_tokens": 100_000}, openai.BadRequestError),
        ({"top_logprobs": 2}, openai.BadRequestError),
        ({"stop": ["a", "b", "c", "d", "e"]}, openai.BadRequestError),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            openai.BadRequestError,
        ),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "missing"}}},
            openai.UnprocessableEntityError,
        ),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, openai.UnprocessableEntityError),
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_bad_requests_are_4xx_in_openais_shape(client, arguments, error, stream):
    with pytest.raises(error) as raised:
        result = client.chat.completions.create(**{"model": "m", "messages": MESSAGES, **arguments}, stream=stream)
        list(result)
    body = raised.value.body
    assert set(body) == {"message", "type", "param", "code"} and body["message"]


def test_malformed_json_and_no_template_errors(chat_gateway, gateway):
    raw = chat_gateway.curl("/v1/chat/completions", "-w", "\n%{http_code}", body='{"messages": ')
    body, status = raw.rsplit("\n", 1)
    assert status == "400" and json.loads(body)["error"]["type"] == "invalid_request_error"
    plain = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.UnprocessableEntityError, match="--chat-template"):
        plain.chat.completions.create(model="m", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError, match="fill-in-the-middle"):
        plain.completions.create(model="m", prompt="x", suffix="y")


def test_huggingface_hub_chat_completion(chat_gateway, client):
    from huggingface_hub import InferenceClient

    hub = InferenceClient(base_url=chat_gateway.url)
    expected = client.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=8)
    response = hub.chat_completion(MESSAGES, max_tokens=8, temperature=0)
    assert response.choices[0].message.content == expected.choices[0].message.content
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in hub.chat_completion(MESSAGES, max_tokens=8, temperature=0, stream=True)
        if chunk.choices
    )
    assert streamed == expected.choices[0].message.content
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    # huggingface_hub rewrites OpenAI's json_schema into TGI's {"type": "json_object", "value": schema}.
    shaped = hub.chat_completion(
        MESSAGES,
        max_tokens=30,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}},
    )
    jsonschema.validate(json.loads(shaped.choices[0].message.content), schema)


def test_api_key_guards_openai_routes(start_grpc_server, start_gateway, tiny_chat_engine_config):
    """The key is checked by the server; through the gateway the SDK sees AuthenticationError."""
    gateway = start_gateway(start_grpc_server(tiny_chat_engine_config, api_key="sesame"))
    with pytest.raises(openai.AuthenticationError) as refused:
        openai.OpenAI(base_url=gateway.url + "/v1", api_key="wrong", max_retries=0).chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=2
        )
    assert refused.value.body["type"] == "authentication_error"
    ok = openai.OpenAI(base_url=gateway.url + "/v1", api_key="sesame", max_retries=0)
    assert ok.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2).choices
    assert [m.id for m in ok.models.list()]  # the model list stays open


def test_no_blocks_leak_after_openai_calls(chat_gateway, client):
    client.chat.completions.create(model="m", messages=MESSAGES, n=4, max_tokens=20)
    stats = chat_gateway.server.server.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0


def test_stream_disconnect_aborts_all_choices(chat_gateway):
    command = [
        "curl",
        "-s",
        "-N",
        "--max-time",
        "1",
        chat_gateway.url + "/v1/chat/completions",
        "-H",
        "Content-Type: application/json",
        "-d",
        json.dumps({"messages": MESSAGES, "n": 3, "max_tokens": 400, "stream": True, "temperature": 1.0}),
    ]
    subprocess.run(command, capture_output=True, timeout=30)
    engine = chat_gateway.server.server.engine
    deadline = time.monotonic() + 20
    while engine.stats().num_running and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine.stats().num_running == 0 and engine.stats().num_free_blocks == engine.stats().num_total_blocks
