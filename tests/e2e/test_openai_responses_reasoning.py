"""Reasoning items on the Responses route, on real generations through the real Envoy with the
official `openai` SDK: a grammar makes the tiny model write `<think>…</think>` then an answer (a
Qwen3-like template, so the reasoning parser defaults to qwen3), and the thoughts come back as a
reasoning item before the message, unary and streamed alike."""

from __future__ import annotations

import dataclasses
import json
import re

import openai
import pytest

from tests.conftest import GrpcServerThread

TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{# mentions <think> so that --reasoning-parser defaults to qwen3 #}"
)
THINK_THEN_ANSWER = "<think>[a-z]{2,6}( [a-z]{2,6}){2,4}</think>\n[a-z]{2,6}( [a-z]{2,6}){0,2}"
FORMAT = {"format": {"type": "regex", "value": THINK_THEN_ANSWER}}  # TGI's grammar shape


@pytest.fixture(scope="module")
def gateway(tiny_engine_config, tmp_path_factory, start_gateway):
    template = tmp_path_factory.mktemp("thinking-template") / "chat.jinja"
    template.write_text(TEMPLATE)
    config = dataclasses.replace(
        tiny_engine_config, model=dataclasses.replace(tiny_engine_config.model, chat_template=str(template))
    )
    server = GrpcServerThread(config)
    yield start_gateway(server)
    server.stop(timeout_s=1.0)


def test_thoughts_are_a_reasoning_item_unary_and_streamed(gateway):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    arguments = {"model": "m", "input": "the quick brown fox", "temperature": 0, "max_output_tokens": 80}
    response = client.responses.create(**arguments, text=FORMAT)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and message.type == "message"
    thoughts = reasoning.content[0].text
    assert re.fullmatch(THINK_THEN_ANSWER, f"<think>{thoughts}</think>\n{response.output_text}")
    assert reasoning.summary == [] and reasoning.content[0].type == "reasoning_text"

    with client.responses.stream(**arguments, text=FORMAT) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == thoughts and len(deltas) > 1  # token by token
    assert next(e for e in events if e.type == "response.reasoning_text.done").text == thoughts
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text == response.output_text
    first_added = next(e for e in events if e.type == "response.output_item.added")
    assert first_added.item.type == "reasoning" and first_added.output_index == 0

    raw = json.loads(gateway.curl("/v1/responses", body={**arguments, "text": FORMAT}))
    assert set(raw["output"][0]) == {"type", "id", "status", "summary", "content"}

    # The next turn leaves the thoughts out of its prompt: the chat route's answer to the answer alone.
    follow = client.responses.create(
        model="m", input="and?", previous_response_id=response.id, temperature=0, max_output_tokens=3
    )
    turns = [
        {"role": "user", "content": "the quick brown fox"},
        {"role": "assistant", "content": response.output_text},
        {"role": "user", "content": "and?"},
    ]
    chat = client.chat.completions.create(model="m", messages=turns, temperature=0, max_tokens=3)
    assert follow.output_text == (chat.choices[0].message.content or "")
