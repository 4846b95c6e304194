"""The legacy logprobs lists of an echoed prompt: where each prompt token starts in the prompt's
text (characters, not bytes; a token inside a character starts at that character) and the nulls of
the first one, built from a real byte-level tokenizer's tokens."""

from __future__ import annotations

from google.protobuf import json_format

from inference_service.api.openai_responses import completion_logprobs
from inference_service.frontend.token_bytes import token_bytes_reader
from inference_service.outputs import PrefillToken, Token


def test_prompt_entries_start_where_their_characters_start(byte_tokenizer):
    prompt = "日本 the 😀 café"
    ids = byte_tokenizer(prompt).input_ids  # BOS first, then tokens some of which split characters
    read = token_bytes_reader(byte_tokenizer)
    the = Token(byte_tokenizer.convert_tokens_to_ids("the"), "the", -1.0, False)
    prefill = [
        PrefillToken(i, byte_tokenizer.decode([i]), None if k == 0 else -1.0 - k, [] if k == 0 else [the])
        for k, i in enumerate(ids)
    ]
    lists = json_format.MessageToDict(completion_logprobs([], [], len(prompt), (prompt, prefill), read))
    assert lists["tokenLogprobs"][0] is None and lists["topLogprobs"][0] is None
    assert lists["tokenLogprobs"][1:] == [-1.0 - k for k in range(1, len(ids))]
    assert all(top == {"the": -1.0} for top in lists["topLogprobs"][1:])
    # The BOS takes no room; each other token starts at the character its first byte belongs to.
    data, expected, cursor = prompt.encode(), [0], 0
    for token_id in ids[1:]:
        expected.append(len(data[:cursor].decode(errors="ignore")))
        cursor += len(read(token_id))
    assert cursor == len(data) and lists["textOffset"] == expected
    assert any("\\x" in token for token in lists["tokens"])  # part of a character shows its bytes
    assert lists["tokens"][0] == byte_tokenizer.bos_token
