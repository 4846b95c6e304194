"""OpenAI chat on the demo model (SmolLM2-Instruct, its own chat template): greedy output equals
transformers' `generate` on the prompt transformers' `apply_chat_template` renders."""

from __future__ import annotations

import pytest
import torch
from google.protobuf import struct_pb2
from transformers import AutoModelForCausalLM, AutoTokenizer

from inference_service.models.demo import ensure_demo_model
from textgen.v1 import generate_pb2 as pb

pytestmark = pytest.mark.slow

TIMEOUT = 120
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
]


def _message(role: str, content: str) -> pb.ChatMessage:
    return pb.ChatMessage(role=role, content=struct_pb2.Value(string_value=content))


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["user", "system+user"])
def test_greedy_chat_equals_transformers_generate(demo_grpc_server, messages):
    max_tokens = 24
    request = pb.ChatCompletionRequest(
        model="tgi",
        messages=[_message(m["role"], m["content"]) for m in messages],
        max_tokens=max_tokens,
        temperature=0.0,
    )
    response = demo_grpc_server.stub.ChatCompletion(request, timeout=TIMEOUT)

    directory = ensure_demo_model()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=max_tokens)
    expected = out[0, len(prompt_ids) :].tolist()

    (choice,) = response.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == len(expected)
    eos = model.generation_config.eos_token_id
    ended_by_eos = expected[-1] in (eos if isinstance(eos, list) else [eos])
    assert choice.finish_reason == ("stop" if ended_by_eos else "length")
