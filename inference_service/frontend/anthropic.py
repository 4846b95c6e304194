"""Anthropic Messages requests → the chat plan OpenAI's chat route uses: pure conversions, no I/O.

A Messages request is rewritten as the OpenAI chat request that means the same, and `openai.chat_plan`
validates it, so both routes share one set of checks, one tool grammar and one chat template
rendering. Mapping, explicitly:
- `system` (a string or text blocks) is a first system message;
- a user turn's `tool_result` blocks are `tool` messages (before the turn's text, as Anthropic orders
  them); an assistant turn's `tool_use` blocks are its `tool_calls` (the input as the arguments'
  JSON); `thinking` blocks of earlier turns are dropped (templates drop past reasoning too);
- `tools` are functions (`input_schema` is the parameters' schema); `tool_choice` auto/any/tool/none
  are OpenAI's auto/required/named function/none; `disable_parallel_tool_use` is one call at most;
- `max_tokens` (required) is `max_new_tokens`; `stop_sequences` are stops; `temperature` (in [0, 1],
  absent is 1), `top_p` and `top_k` keep their meanings;
- `thinking` sets the template's `enable_thinking` switch (templates without one ignore it); the
  model's thoughts (`--reasoning-parser`) come back as a `thinking` block whether asked for or not;
- `output_config.format` (a JSON schema) is OpenAI's `response_format` json_schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format

from inference_service.errors import ToolError, ValidationError, quoted
from inference_service.frontend import openai
from inference_service.frontend.openai import ChatPlan
from inference_service.frontend.openai_tools import DEFAULT_SYNTAX
from inference_service.frontend.plain_json import value_to_python
from inference_service.frontend.reasoning import ReasoningSyntax
from inference_service.frontend.tool_syntax import ToolSyntax
from textgen.v1 import anthropic_pb2 as apb
from textgen.v1 import generate_pb2 as pb

ROLES = ("user", "assistant")
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValidationError(message)


@dataclass
class MessagesPlan:
    """The chat plan, and what only the Messages API needs to answer."""

    chat: ChatPlan
    stop_sequences: list[str]
    # Whether the caller asked for thinking (`thinking.type` "enabled"); the thoughts are split by
    # the chat plan's `reasoning` syntax either way (a model that thinks unasked still thinks).
    thinking: bool = False


def _text_of(content: Any, where: str) -> str:
    """A string, or text blocks joined (tool results and system prompts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    _check(isinstance(content, list), f"`{where}` must be a string or a list of text blocks")
    texts = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        _check(kind == "text", f"`{where}` blocks must be text blocks, not {quoted(kind)}")
        _check(isinstance(block.get("text"), str), f"`{where}` text blocks need a `text` string")
        texts.append(block["text"])
    return "".join(texts)


def _blocks(message: apb.AnthropicMessage, index: int) -> list[dict[str, Any]]:
    content = value_to_python(message.content) if message.HasField("content") else None
    where = f"messages[{index}].content"
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(block, dict) for block in content):
        raise ValidationError(f"`{where}` must be a string or a list of content block objects")
    return content


def _user_messages(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    messages, texts = [], []
    for block in blocks:
        kind = block.get("type")
        if kind == "tool_result":
            _check(isinstance(block.get("tool_use_id"), str), f"`{where}` tool_result blocks need a `tool_use_id`")
            text = _text_of(block.get("content"), f"{where}.tool_result.content")
            if block.get("is_error"):
                text = f"Error: {text}"
            messages.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        elif kind == "text":
            _check(isinstance(block.get("text"), str), f"`{where}` text blocks need a `text` string")
            texts.append(block["text"])
        else:
            raise ValidationError(f"`{where}`: unsupported content block type {quoted(kind)} in a user turn")
    if texts or not messages:
        messages.append({"role": "user", "content": "".join(texts)})
    return messages


def _assistant_message(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            _check(isinstance(block.get("text"), str), f"`{where}` text blocks need a `text` string")
            texts.append(block["text"])
        elif kind == "tool_use":
            name, arguments = block.get("name"), block.get("input", {})
            _check(isinstance(name, str) and bool(name), f"`{where}` tool_use blocks need a `name`")
            _check(isinstance(arguments, dict), f"`{where}` tool_use `input` must be an object")
            call_id = block.get("id") if isinstance(block.get("id"), str) else f"toolu_{len(calls)}"
            calls.append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
            )
        elif kind not in ("thinking", "redacted_thinking"):
            raise ValidationError(f"`{where}`: unsupported content block type {quoted(kind)} in an assistant turn")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _chat_messages(request: apb.MessagesRequest) -> list[dict[str, Any]]:
    _check(len(request.messages) > 0, "`messages` must not be empty")
    messages = []
    system = _text_of(value_to_python(request.system) if request.HasField("system") else None, "system")
    if system:
        messages.append({"role": "system", "content": system})
    for index, message in enumerate(request.messages):
        _check(message.role in ROLES, f"`messages[{index}].role` must be user or assistant, not {quoted(message.role)}")
        blocks, where = _blocks(message, index), f"messages[{index}].content"
        if message.role == "user":
            messages += _user_messages(blocks, where)
        else:
            messages.append(_assistant_message(blocks, where))
    return messages


def _tools(request: apb.MessagesRequest) -> list[dict[str, Any]]:
    tools = []
    for tool in request.tools:
        if tool.HasField("type") and tool.type != "custom":
            raise ToolError(
                f"tool {quoted(tool.name)}: server tools ({quoted(tool.type)}) are not supported; define a custom tool"
            )
        function: dict[str, Any] = {"name": tool.name}
        if tool.HasField("description"):
            function["description"] = tool.description
        if tool.HasField("input_schema"):
            function["parameters"] = json_format.MessageToDict(tool.input_schema)
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(request: apb.MessagesRequest) -> tuple[Any, bool]:
    """OpenAI's tool_choice (None: the default) and whether parallel calls are allowed."""
    if not request.HasField("tool_choice"):
        return None, True
    choice = request.tool_choice
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        if not choice.name:
            raise ToolError('`tool_choice` {"type": "tool"} needs the tool\'s `name`')
        return {"type": "function", "function": {"name": choice.name}}, parallel
    if choice.type not in TOOL_CHOICES:
        raise ToolError(f"`tool_choice.type` must be auto, any, tool or none, not {quoted(choice.type)}")
    return TOOL_CHOICES[choice.type], parallel


def _thinking(request: apb.MessagesRequest) -> bool | None:
    if not request.HasField("thinking"):
        return None
    kind = request.thinking.type
    _check(kind in ("enabled", "disabled"), f"`thinking.type` must be enabled or disabled, not {quoted(kind)}")
    return kind == "enabled"


def _output_format(request: apb.MessagesRequest) -> dict[str, Any] | None:
    """The JSON schema of `output_config.format` (or the older `output_format`); None: free text."""
    if request.output_config.HasField("format"):
        output_format = request.output_config.format
    elif request.HasField("output_format"):
        output_format = request.output_format
    else:
        return None
    kind = output_format.type
    _check(kind == "json_schema", f"`output_config.format.type` must be json_schema, not {quoted(kind)}")
    _check(output_format.HasField("schema"), "`output_config.format` needs a `schema`")
    return json_format.MessageToDict(output_format.schema)


def chat_request(request: apb.MessagesRequest, *, count_only: bool = False) -> pb.ChatCompletionRequest:
    """The OpenAI chat request that means the same; `count_only` (count_tokens) needs no `max_tokens`."""
    if not count_only:
        _check(request.HasField("max_tokens"), "`max_tokens`: field required")
        _check(request.max_tokens >= 1, "`max_tokens` must be >= 1")
    _check(
        not request.HasField("temperature") or 0.0 <= request.temperature <= 1.0,
        f"`temperature` must be >= 0 and <= 1. Given: {request.temperature}",
    )
    tool_choice, parallel = _tool_choice(request)
    chat: dict[str, Any] = {
        "messages": _chat_messages(request),
        "tools": _tools(request),
        "stop": list(request.stop_sequences),
        "parallel_tool_calls": parallel,
    }
    if tool_choice is not None:
        chat["tool_choice"] = tool_choice
    if request.HasField("max_tokens"):
        chat["max_tokens"] = request.max_tokens
    if request.HasField("tool_prompt"):
        chat["tool_prompt"] = request.tool_prompt
    output_format = _output_format(request)
    if output_format is not None:
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": output_format}}
    converted = json_format.ParseDict(chat, pb.ChatCompletionRequest())
    for name in ("temperature", "top_p", "top_k"):
        if request.HasField(name):
            setattr(converted, name, getattr(request, name))
    converted.chat_template_kwargs.CopyFrom(request.chat_template_kwargs)
    thinking = _thinking(request)
    if thinking is not None:
        converted.chat_template_kwargs.update({"enable_thinking": thinking})
    return converted


def messages_plan(
    request: apb.MessagesRequest,
    tool_syntax: ToolSyntax = DEFAULT_SYNTAX,
    reasoning: ReasoningSyntax | None = None,
    *,
    count_only: bool = False,
) -> MessagesPlan:
    """Raises ValidationError (or ToolError) in Anthropic's terms, then what `chat_plan` checks.
    `tool_syntax` and `reasoning`: the model's formats, as for the chat route."""
    chat = openai.chat_plan(chat_request(request, count_only=count_only), tool_syntax, reasoning)
    return MessagesPlan(chat=chat, stop_sequences=list(request.stop_sequences), thinking=bool(_thinking(request)))
