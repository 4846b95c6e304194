"""OpenAI requests → engine requests, chat templates, and tool calls read back from text."""

from __future__ import annotations

import pytest
from google.protobuf import json_format

from inference_service.errors import TemplateError, ToolError, ValidationError
from inference_service.frontend import openai as openai_convert
from inference_service.frontend import openai_tools
from inference_service.frontend.chat_template import ChatTemplate
from inference_service.sample import grammar as grammar_module
from textgen.v1 import generate_pb2 as pb

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
    },
}


def chat_request(**fields) -> pb.ChatCompletionRequest:
    body = {"model": "x", "messages": [{"role": "user", "content": "hi"}], **fields}
    return json_format.ParseDict(body, pb.ChatCompletionRequest())


# -- parameters ------------------------------------------------------------------------------------
def test_openai_defaults_sample_at_temperature_one_and_zero_is_greedy():
    default = openai_convert.chat_plan(chat_request())
    assert default.do_sample and default.parameters.temperature == 1.0
    greedy = openai_convert.chat_plan(chat_request(temperature=0, top_p=0.5))
    assert not greedy.do_sample and greedy.parameters.temperature is None  # 0 is greedy, whatever else is set
    warm = openai_convert.chat_plan(chat_request(temperature=0.7, top_p=1.0))
    assert warm.do_sample and warm.parameters.temperature == pytest.approx(0.7)
    assert warm.parameters.top_p is None  # top_p 1 is off


def test_stop_max_tokens_penalties_and_bias_map_to_engine_parameters():
    plan = openai_convert.chat_plan(
        chat_request(
            stop="END",
            max_tokens=9,
            max_completion_tokens=7,
            presence_penalty=0.5,
            frequency_penalty=0.25,
            logit_bias={"17": -100, "3": 2.5},
            seed=4,
            n=2,
        )
    )
    params = plan.parameters
    assert params.stop == ["END"] and params.max_new_tokens == 7  # max_completion_tokens wins
    assert (params.presence_penalty, params.frequency_penalty, params.seed) == (0.5, 0.25, 4)
    assert params.logit_bias == {17: -100.0, 3: 2.5} and plan.num_choices == 2
    assert openai_convert.chat_plan(chat_request(stop=["a", "b"])).parameters.stop == ["a", "b"]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"stop": 3}, "`stop` must be a string or a list of strings"),
        ({"n": 0}, "`n` must be >= 1"),
        ({"n": 17}, "`n` x prompts must be <= 16"),
        ({"temperature": -0.5}, "`temperature` must be >= 0"),
        ({"temperature": 2.5}, "`temperature` must be >= 0.0 and <= 2.0"),
        ({"temperature": "NaN"}, "`temperature` must be >= 0.0 and <= 2.0"),
        ({"logit_bias": {"abc": 1}}, "`logit_bias` keys must be token ids"),
        ({"logit_bias": {"1": 101}}, "`logit_bias` values must be in [-100, 100]"),
        ({"top_logprobs": 2}, "`top_logprobs` needs `logprobs` set to true"),
        ({"messages": []}, "`messages` must not be empty"),
        ({"response_format": {"type": "yaml"}}, "`response_format.type` must be text, json_object or json_schema"),
    ],
)
def test_bad_chat_parameters_are_validation_errors(fields, message):
    with pytest.raises(ValidationError, match=message.replace("[", r"\[").replace("]", r"\]")):
        openai_convert.chat_plan(chat_request(**fields))


def test_seeded_choices_are_seed_plus_i_and_unseeded_ones_are_drawn():
    assert openai_convert.choice_seeds(10, 3, True, lambda: 0) == [10, 11, 12]
    assert openai_convert.choice_seeds(2**64 - 1, 2, True, lambda: 0) == [2**64 - 1, 0]
    draws = iter([7, 8])
    assert openai_convert.choice_seeds(5, 3, False, lambda: next(draws)) == [5, 7, 8]


def test_response_formats_become_grammars():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    as_openai = chat_request(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    assert openai_convert.chat_plan(as_openai).parameters.grammar == {"type": "json", "value": schema}
    assert openai_convert.chat_plan(chat_request(response_format={"type": "json_object"})).parameters.grammar == {
        "type": "json",
        "value": {"type": "object"},
    }
    as_tgi = chat_request(response_format={"type": "regex", "value": "[0-9]+"})
    assert openai_convert.chat_plan(as_tgi).parameters.grammar == {"type": "regex", "value": "[0-9]+"}
    assert openai_convert.chat_plan(chat_request(response_format={"type": "text"})).parameters.grammar is None


def test_completion_prompts_and_refusals():
    def plan(**fields):
        request = json_format.ParseDict({"model": "x", **fields}, pb.CompletionRequest())
        return openai_convert.completion_plan(request, has_fill_in_middle=False)

    assert plan(prompt="a").prompts == ["a"] and plan(prompt="a").parameters.max_new_tokens == 16  # OpenAI's default
    assert plan(prompt=["a", "b"], n=2).num_choices == 2
    for fields, message in [
        ({"prompt": []}, "`prompt` must be a string"),
        ({"prompt": [1, 2]}, "`prompt` must be"),
        ({"prompt": ["a"] * 5}, "at most 4 prompts"),
        ({"prompt": "a", "suffix": "b"}, "fill-in-the-middle"),
        ({"prompt": "a", "best_of": 3}, "`best_of` must equal `n`"),
    ]:
        with pytest.raises(ValidationError, match=message):
            plan(**fields)


# -- chat templates ----------------------------------------------------------------------------------
def test_template_renders_parts_tool_calls_and_continues_a_last_assistant_message(byte_tokenizer):
    template = ChatTemplate(byte_tokenizer, CHATML)
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    prompt = template.render([{"role": "user", "content": parts}])
    assert prompt == "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n"
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}
    prompt = template.render(
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ]
    )
    assert '<|im_start|>assistant\n{"name": "lookup", "arguments": {"q": "x"}}<|im_end|>' in prompt
    assert prompt.endswith("<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")
    continued = template.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure,"}])
    assert continued.endswith("<|im_start|>assistant\nSure,")


def test_tools_go_into_the_last_message_when_the_template_ignores_them(byte_tokenizer):
    prompt = ChatTemplate(byte_tokenizer, CHATML).render([{"role": "user", "content": "hi"}], tools=[TOOL])
    assert "You have access to the following functions" in prompt and '"name": "lookup"' in prompt
    native = "{{ tools | tojson }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert (
        ChatTemplate(byte_tokenizer, native)
        .render([{"role": "user", "content": "hi"}], tools=[TOOL])
        .startswith('[{"type": "function"')
    )


def test_template_errors_are_typed(byte_tokenizer):
    with pytest.raises(TemplateError, match="--chat-template"):
        ChatTemplate(byte_tokenizer).render([{"role": "user", "content": "hi"}])
    with pytest.raises(TemplateError, match="unknown message role"):
        ChatTemplate(byte_tokenizer, CHATML).render([{"role": "robot", "content": "hi"}])
    with pytest.raises(TemplateError, match="nope"):
        ChatTemplate(byte_tokenizer, "{{ raise_exception('nope') }}").render([{"role": "user", "content": "x"}])


# -- tools -----------------------------------------------------------------------------------------
def test_tool_choice_decides_the_call_format():
    assert openai_tools.tool_call_format([], None, True) is None
    assert openai_tools.tool_call_format([TOOL], "none", True) is None
    auto = openai_tools.tool_call_format([TOOL], None, True)
    assert auto.text_allowed and auto.parallel and set(auto.schemas) == {"lookup"}
    assert not openai_tools.tool_call_format([TOOL], "required", True).text_allowed
    named = openai_tools.tool_call_format([TOOL], {"type": "function", "function": {"name": "lookup"}}, True)
    assert not named.parallel and not named.text_allowed
    for tools, choice in [
        ([TOOL], "sometimes"),
        ([], "required"),
        ([TOOL, TOOL], "auto"),
        ([TOOL], {"type": "function", "function": {"name": "other"}}),
        ([{"type": "x"}], "auto"),
    ]:
        with pytest.raises(ToolError):
            openai_tools.tool_call_format(tools, choice, True)


def test_tool_grammar_is_lark_with_each_functions_schema():
    grammar = openai_tools.combined_grammar(openai_tools.tool_call_format([TOOL], "auto", True), None)
    assert grammar.kind == "lark" and grammar.value.startswith("start: calls | TEXT")
    assert grammar_module.lark_json(TOOL["function"]["parameters"]) in grammar.value
    assert openai_tools.combined_grammar(None, {"type": "regex", "value": "a"}) == {"type": "regex", "value": "a"}
    with pytest.raises(ToolError):
        auto = openai_tools.tool_call_format([TOOL], "auto", True)
        openai_tools.combined_grammar(auto, {"type": "regex", "value": "a"})
