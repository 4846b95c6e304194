"""`echo` with `logprobs` on `/v1/completions`, through the real Envoy with the official `openai` SDK:
the prompt's tokens come first in the legacy logprobs lists (the first with a null logprob and null
alternatives, as OpenAI and vLLM send it), unary and in a stream's first chunk, and their values are
those of a plain transformers forward over the prompt."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from textgen.v1 import generate_pb2 as pb

PROMPT = "the quick brown fox"
ALTERNATIVES = 2
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, byte_tokenizer):
    """The prompt's ids (BOS included, as the server tokenizes it) and log_softmax of transformers'
    forward over them: row i predicts token i + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    ids = byte_tokenizer(PROMPT).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return ids, torch.log_softmax(logits, dim=-1)


def _echoed(client, **extra):
    return client.completions.create(
        model="m", prompt=PROMPT, temperature=0, max_tokens=MAX_TOKENS, echo=True, logprobs=ALTERNATIVES, **extra
    )


def test_echo_returns_the_prompts_logprobs_as_transformers_computes_them(client, reference, byte_tokenizer):
    ids, logprobs = reference
    choice = _echoed(client).choices[0]
    plain = client.completions.create(
        model="m", prompt=PROMPT, temperature=0, max_tokens=MAX_TOKENS, logprobs=ALTERNATIVES
    ).choices[0]
    assert choice.text == PROMPT + plain.text
    lists = choice.logprobs
    n = len(ids)
    assert lists.tokens[:n] == [byte_tokenizer.decode([i]) for i in ids]
    assert lists.token_logprobs[0] is None and lists.top_logprobs[0] is None
    for position in range(1, n):
        row = logprobs[position - 1]
        assert lists.token_logprobs[position] == pytest.approx(row[ids[position]].item(), abs=1e-4)
        values, top_ids = row.topk(ALTERNATIVES)
        top = lists.top_logprobs[position]  # part of a character is keyed by its escaped bytes
        assert sorted(top.values(), reverse=True) == pytest.approx(values.tolist(), abs=1e-4)
        for token_id, value in zip(top_ids.tolist(), values.tolist(), strict=True):
            text = byte_tokenizer.decode([token_id])
            assert "\ufffd" in text or top[text] == pytest.approx(value, abs=1e-4)
    # The BOS the tokenizer added is not in the text: it takes no room; the others start where they stand.
    assert "".join(lists.tokens[1:n]) == PROMPT
    assert lists.text_offset[:n] == [0, *(len("".join(lists.tokens[1:i])) for i in range(1, n))]
    # The generated part is what the same request without `echo` returns, its offsets after the prompt.
    assert lists.tokens[n:] == plain.logprobs.tokens
    assert lists.token_logprobs[n:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    assert lists.text_offset[n:] == [len(PROMPT) + offset for offset in plain.logprobs.text_offset]


def test_the_wire_holds_nulls(gateway):
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 2, "echo": True, "logprobs": 1, "temperature": 0}
    lists = json.loads(gateway.curl("/v1/completions", body=body))["choices"][0]["logprobs"]
    assert lists["token_logprobs"][0] is None and lists["top_logprobs"][0] is None
    assert all(isinstance(value, float) for value in lists["token_logprobs"][1:])
    assert all(isinstance(top, dict) and len(top) == 1 for top in lists["top_logprobs"][1:])


def test_a_stream_sends_the_prompts_logprobs_in_its_first_chunk(client, reference):
    n = len(reference[0])
    unary = _echoed(client).choices[0].logprobs
    chunks = [chunk for chunk in _echoed(client, stream=True) if chunk.choices]
    first = chunks[0].choices[0]
    assert first.text.startswith(PROMPT)
    assert first.logprobs.tokens[:n] == unary.tokens[:n] and first.logprobs.text_offset[:n] == unary.text_offset[:n]
    assert first.logprobs.token_logprobs[0] is None and first.logprobs.top_logprobs[0] is None
    assert first.logprobs.token_logprobs[1:n] == pytest.approx(unary.token_logprobs[1:n], abs=1e-5)
    assert first.logprobs.top_logprobs[1:n] == [pytest.approx(top, abs=1e-5) for top in unary.top_logprobs[1:n]]
    # Later chunks hold generated tokens only: no null, offsets past the prompt; all chunks together
    # hold what the unary reply holds.
    later = [chunk.choices[0].logprobs for chunk in chunks[1:] if chunk.choices[0].logprobs]
    assert later and all(None not in lists.token_logprobs for lists in later)
    assert all(offset >= len(PROMPT) for lists in later for offset in lists.text_offset)
    streamed = [first.logprobs, *later]
    assert [t for lists in streamed for t in lists.tokens] == unary.tokens
    assert [o for lists in streamed for o in lists.text_offset] == unary.text_offset
    values = [v for lists in streamed for v in lists.token_logprobs]
    assert values[0] is None and values[1:] == pytest.approx(unary.token_logprobs[1:], abs=1e-5)


def test_grpc_gives_null_values_too(gateway, reference):
    ids, logprobs = reference
    request = pb.CompletionRequest(model="m", max_tokens=2, echo=True, logprobs=1, temperature=0)
    request.prompt.string_value = PROMPT
    lists = gateway.server.stub.Completion(request, timeout=60).choices[0].logprobs
    assert lists.token_logprobs[0].WhichOneof("kind") == "null_value"
    assert lists.top_logprobs[0].WhichOneof("kind") == "null_value"
    assert lists.token_logprobs[1].number_value == pytest.approx(logprobs[0][ids[1]].item(), abs=1e-4)
    assert len(lists.top_logprobs[1].struct_value.fields) == 1
