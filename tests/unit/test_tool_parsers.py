"""Native tool-call formats read back from text: streamed in pieces of every size (markers split
across them) the calls equal the unary parse; names come first, arguments as they arrive; the tool
grammar of each format accepts the text its parser reads."""

from __future__ import annotations

import json

import pytest

from inference_service.errors import GenerationError
from inference_service.frontend import openai_tools
from inference_service.frontend.tool_parsers import SYNTAXES, parse_tool_calls, tool_parser, tool_syntax
from inference_service.sample.grammar import GrammarSpec
from tests.tool_schemas import TIME_ZONE_PARAMETERS

NAMES = ("get_weather", "get_time")


def streamed(name: str, text: str, size: int) -> tuple[str, list[dict], list[tuple]]:
    """(content, calls, items) as a stream reader rebuilds them from pieces of `size`."""
    parser, items = tool_parser(SYNTAXES[name], NAMES), []
    for start in range(0, len(text), size):
        items += parser.feed(text[start : start + size])
    items += parser.finish()
    calls: dict[int, dict] = {}
    for item in items:
        if item[0] == "call":
            assert item[1] not in calls, "each call is announced once"
            calls[item[1]] = {"id": item[2], "name": item[3], "arguments": ""}
        elif item[0] == "arguments":
            assert item[1] in calls, "a call's name comes before its arguments"
            assert item[2], "no empty argument pieces"
            calls[item[1]]["arguments"] += item[2]
        else:
            assert item[1], "no empty content pieces"
    content = "".join(item[1] for item in items if item[0] == "content")
    return content, [calls[i] for i in sorted(calls)], items


WEATHER = '{"city": "Paris", "days": [1, {"unit": "°C", "note": "a } and a \\" inside"}]}'
CASES = [
    # (parser, text, content, [(name, arguments)])
    (
        "hermes",
        f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
        "",
        [("get_weather", WEATHER)],
    ),
    (
        "hermes",
        'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"arguments": {"zone": "UTC"}, "name": "get_time"}\n</tool_call>',
        "Let me look.\n",
        [("get_time", "{}"), ("get_time", '{"zone": "UTC"}')],
    ),
    ("hermes", "No calls, just <b>text</b>.", "No calls, just <b>text</b>.", []),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": ' + WEATHER + "}",
        "",
        [("get_weather", WEATHER)],
    ),
    (
        "llama3_json",
        '{"name": "get_time", "parameters": {"zone": "CET"}}; {"name": "get_weather", "parameters": {}}',
        "",
        [("get_time", '{"zone": "CET"}'), ("get_weather", "{}")],
    ),
    ("llama3_json", 'Sure: {"name": "get_time"}', 'Sure: {"name": "get_time"}', []),
    ("llama3_json", '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),  # JSON that calls nothing
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]',
        "",
        [("get_time", '{"zone": "UTC"}')],
    ),
    (
        "mistral",  # the marker is a special token decoding may drop
        '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]',
        "",
        [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')],
    ),
    ("mistral", "[a link](http://x)", "[a link](http://x)", []),
    (
        "json",
        '{"name": "get_time", "arguments": {"zone": "UTC"}}\n{"name": "get_weather", "arguments": {}}',
        "",
        [("get_time", '{"zone": "UTC"}'), ("get_weather", "{}")],
    ),
    ("json", '{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}', "", [("get_time", '{"zone": "UTC"}')]),
]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_unary_and_streamed_in_every_piece_size(name, text, content, calls):
    got_content, got_calls = parse_tool_calls(SYNTAXES[name], text, NAMES)
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls
    for call in got_calls:
        json.loads(call["function"]["arguments"])
    for size in range(1, len(text) + 1):
        stream_content, stream_calls, _ = streamed(name, text, size)
        assert [(c["name"], c["arguments"]) for c in stream_calls] == calls, f"pieces of {size}"
        if calls:
            assert stream_content == content, f"pieces of {size}"


def test_arguments_stream_as_they_arrive():
    parser = tool_parser(SYNTAXES["hermes"], NAMES)
    assert parser.feed("<tool_") == []  # could be the marker
    assert parser.feed('call>\n{"name": "get_ti') == []  # the name is not complete
    call, arguments = parser.feed('me", "arguments": {"zo')
    assert call[0] == "call" and call[3] == "get_time" and arguments == ("arguments", 0, '{"zo')
    assert parser.feed('ne": "U') == [("arguments", 0, 'ne": "U')]
    assert parser.feed('TC"}}\n</tool_call>') == [("arguments", 0, 'TC"}')]
    assert parser.finish() == [] and parser.called


def test_a_call_cut_short_is_not_returned_but_a_complete_one_before_it_is():
    text = (
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "argu'
    )
    content, calls = parse_tool_calls(SYNTAXES["hermes"], text, NAMES)
    assert [c["function"]["name"] for c in calls] == ["get_time"] and content == ""
    cut = '<tool_call>\n{"name": "get_time", "arguments": {"zo'
    assert parse_tool_calls(SYNTAXES["hermes"], cut, NAMES) == (cut, [])  # nothing complete: the text


def test_an_unknown_function_is_no_call():
    text = '{"name": "rm_rf", "arguments": {}}'
    assert parse_tool_calls(SYNTAXES["json"], text, NAMES) == (text, [])


def test_the_default_parser_follows_the_template():
    assert tool_syntax(None, "{{ '<tool_call>' }}").name == "hermes"
    assert tool_syntax(None, {"tool_use": "<|python_tag|>"}).name == "llama3_json"
    assert tool_syntax(None, "[TOOL_CALLS]").name == "mistral"
    assert tool_syntax(None, None).name == "json" and tool_syntax("none", "<tool_call>").name == "json"


def _accepts(tokenizer, compiler, spec: GrammarSpec, text: str) -> bool:
    state = compiler.compile(spec).new_state()
    try:
        for token_id in tokenizer.encode(text, add_special_tokens=False):
            state.accept(token_id)
    except GenerationError:
        return False
    return state.matcher.is_accepting()


TIME, WEATHER_CALL = ("get_time", '{"zone": "UTC"}'), ("get_weather", '{"city": "Rome"}')


def _written(key: str, open_: str = "", close: str = "") -> list[str]:
    return [f'{open_}{{"name": "{name}", "{key}": {arguments}}}{close}' for name, arguments in (TIME, WEATHER_CALL)]


GRAMMAR_TEXTS = {
    "hermes": "\n".join(_written("arguments", "<tool_call>\n", "\n</tool_call>")),
    "llama3_json": "; ".join(_written("parameters")),
    "mistral": "[TOOL_CALLS][" + ", ".join(_written("arguments")) + "]",
    "json": "\n".join(_written("arguments")),
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": TIME_ZONE_PARAMETERS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
]


@pytest.mark.parametrize("name", sorted(GRAMMAR_TEXTS))
def test_the_auto_grammar_writes_the_format_its_parser_reads(byte_tokenizer, byte_grammar_compiler, name):
    syntax = SYNTAXES[name]
    spec = openai_tools.combined_grammar(openai_tools.tool_call_format(TOOLS, "auto", True), None, syntax)
    text = GRAMMAR_TEXTS[name]
    assert _accepts(byte_tokenizer, byte_grammar_compiler, spec, text)
    assert _accepts(byte_tokenizer, byte_grammar_compiler, spec, "Plain words.")  # auto: text is allowed
    assert not _accepts(byte_tokenizer, byte_grammar_compiler, spec, text.replace("UTC", "PST"))  # the schema holds
    _, calls = parse_tool_calls(syntax, text, NAMES)
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"zone": "UTC"}, {"city": "Rome"}]
