"""Thoughts split from the answer: streamed in any pieces (markers split across them) the split is
the unary one; the grammar after the thoughts constrains only the answer."""

from __future__ import annotations

import json

import pytest

from inference_service.errors import GenerationError
from inference_service.frontend import reasoning
from inference_service.frontend.reasoning import ReasoningStream, split_reasoning, starts_inside
from inference_service.sample.grammar import GrammarSpec

QWEN3 = reasoning.SYNTAXES["qwen3"]
R1 = reasoning.SYNTAXES["deepseek_r1"]
MISTRAL = reasoning.SYNTAXES["mistral"]


def streamed(syntax, text: str, size: int, inside: bool = False) -> tuple[str | None, str, list]:
    stream, items = ReasoningStream(syntax, inside), []
    for start in range(0, len(text), size):
        items += stream.feed(text[start : start + size])
    items += stream.finish()
    assert all(piece for _, piece in items), "no empty pieces"
    thoughts = "".join(p for kind, p in items if kind == "reasoning")
    return (thoughts if stream.thought else None), "".join(p for kind, p in items if kind == "content"), items


CASES = [
    # (syntax, prompt opened the thoughts, output, thoughts, answer)
    (QWEN3, False, "<think>\nfirst </thi> then</think>\n\nThe answer.", "first </thi> then", "The answer."),
    (QWEN3, False, "  <think>a</think>b", "a", "b"),
    (QWEN3, False, "No thoughts <think>here</think>", None, "No thoughts <think>here</think>"),
    (QWEN3, False, "<think>cut short by the length lim", "cut short by the length lim", ""),
    (QWEN3, False, "<thi", None, "<thi"),  # a lone partial marker at the end is text
    (QWEN3, False, "<think></think>answer", "", "answer"),
    (QWEN3, True, "opened by the prompt</think>answer", "opened by the prompt", "answer"),
    (R1, True, "implicit start</think>\nanswer", "implicit start", "answer"),  # R1 starts inside (below)
    (R1, True, "<think>explicit</think>answer", "explicit", "answer"),
    (MISTRAL, False, "[THINK]hmm[/THINK]Yes.", "hmm", "Yes."),
]


@pytest.mark.parametrize(("syntax", "inside", "text", "thoughts", "answer"), CASES)
def test_split_unary_and_streamed_in_every_piece_size(syntax, inside, text, thoughts, answer):
    assert split_reasoning(syntax, inside, text) == (thoughts, answer)
    for size in range(1, len(text) + 1):
        got_thoughts, got_answer, _ = streamed(syntax, text, size, inside)
        assert (got_thoughts, got_answer) == (thoughts, answer), f"pieces of {size}"


def test_thoughts_stream_before_the_end_marker_arrives():
    stream = ReasoningStream(QWEN3)
    assert stream.feed("<th") == []  # could be the marker: held
    assert stream.feed("ink>I wonder</") == [("reasoning", "I wonder")]  # `</` could end the thoughts
    assert stream.feed("b>") == [("reasoning", "</b>")]
    assert stream.feed("</think>\nOK") == [("content", "OK")]


def test_where_the_thoughts_begin_is_read_from_the_prompt():
    assert starts_inside(QWEN3, "<|im_start|>assistant\n<think>\n")
    assert not starts_inside(QWEN3, "<|im_start|>assistant\n")
    assert not starts_inside(QWEN3, "<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking false
    assert starts_inside(R1, "<｜Assistant｜>")  # DeepSeek-R1: always, as vLLM
    assert not starts_inside(R1, "<｜Assistant｜><think>\n\n</think>\n\n")


def test_the_default_parser_follows_the_template():
    assert reasoning.reasoning_syntax(None, "{{ '<think>' }}") is QWEN3
    assert reasoning.reasoning_syntax(None, {"default": "{{ content.split('</think>')[-1] }}"}) is QWEN3
    assert reasoning.reasoning_syntax(None, "{{ messages }}") is None
    assert reasoning.reasoning_syntax("none", "<think>") is None
    assert reasoning.reasoning_syntax("deepseek_r1", None) is R1


def _accepts(tokenizer, compiler, spec: GrammarSpec, text: str) -> bool:
    state = compiler.compile(spec).new_state()
    try:
        for token_id in tokenizer.encode(text, add_special_tokens=False):
            state.accept(token_id)
    except GenerationError:
        return False
    return state.matcher.is_accepting()


def test_a_grammar_after_free_thoughts(byte_tokenizer, byte_grammar_compiler):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    spec = reasoning.grammar_after_thoughts({"type": "json", "value": schema}, QWEN3, inside=False)
    accepts = lambda text: _accepts(byte_tokenizer, byte_grammar_compiler, spec, text)  # noqa: E731
    assert accepts('<think>\nfree { text </thi> "here"\n</think>\n\n{"ok": true}')
    assert accepts('{"ok": false}')  # thinking is optional when the prompt did not open it
    assert not accepts("<think>x</think>not json")
    assert not accepts('<think>x</think>{"ok": true} and more')

    opened = reasoning.grammar_after_thoughts({"type": "regex", "value": r"a/b\/c\\[0-9]"}, QWEN3, inside=True)
    assert _accepts(byte_tokenizer, byte_grammar_compiler, opened, "thinking</think>\na/b/c\\7")
    assert not _accepts(byte_tokenizer, byte_grammar_compiler, opened, "a/b/c\\7")  # the thoughts must close first

    lark = GrammarSpec("lark", 'start: "yes" | "no"')
    wrapped = reasoning.grammar_after_thoughts(lark, QWEN3, inside=False)
    assert _accepts(byte_tokenizer, byte_grammar_compiler, wrapped, "<think>hmm</think>yes")
    assert json.loads(json.dumps(wrapped.value))  # a plain string grammar


def test_a_regex_that_writes_the_thoughts_itself_is_kept():
    spec = reasoning.grammar_after_thoughts({"type": "regex", "value": "<think>[a-z]+</think>[a-z]+"}, QWEN3, False)
    assert spec == GrammarSpec("regex", "<think>[a-z]+</think>[a-z]+")


def test_thoughts_then_a_native_tool_call(byte_tokenizer, byte_grammar_compiler):
    from inference_service.frontend import openai_tools
    from inference_service.frontend.tool_parsers import SYNTAXES

    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    calls = openai_tools.combined_grammar(openai_tools.tool_call_format([tool], "auto", True), None, SYNTAXES["hermes"])
    spec = reasoning.grammar_after_thoughts(calls, QWEN3, inside=False)
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert _accepts(byte_tokenizer, byte_grammar_compiler, spec, f"<think>\nwhich tool?\n</think>\n\n{call}")
    assert _accepts(byte_tokenizer, byte_grammar_compiler, spec, "<think>none</think>Just text.")
    assert not _accepts(byte_tokenizer, byte_grammar_compiler, spec, "<think>x</think><b>bold</b>")  # no call, no text
