"""OpenAI Responses requests → the chat request the front end already plans: pure conversions.

A Responses request is a chat completion in other shapes, so it is converted to a
`ChatCompletionRequest` and goes through the same plan and validation (`openai.chat_plan`):
- `instructions` is a system message put first (not carried over to a later turn);
- `input` is a string (one user message) or items: messages (content a string or `input_text` /
  `output_text` parts), `function_call` items (an assistant message's tool calls, consecutive ones
  merged) and `function_call_output` items (tool messages);
- a stored previous response's conversation (its input and output, as chat messages) comes first;
- `tools` are Responses' flat function tools; `tool_choice` {"type": "function", "name"} is
  chat's {"type": "function", "function": {"name"}}; `text.format` is `response_format`;
  `max_output_tokens` is `max_completion_tokens`; one choice, always.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format, struct_pb2

from inference_service.errors import ECHO_CHARS, ValidationError, quoted, shortened
from inference_service.frontend.plain_json import plain_json, value_to_python
from textgen.v1 import generate_pb2 as pb
from textgen.v1 import responses_pb2 as rpb

MESSAGE_ROLES = ("user", "assistant", "system", "developer")
TEXT_PART_TYPES = ("input_text", "output_text", "text", "refusal")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValidationError(message)


def _text_of(content: Any, where: str) -> Any:
    """A message's content as chat's: a string, or text parts (`{"type": "text", "text"}`)."""
    if isinstance(content, str):
        return content
    _check(isinstance(content, list), f"`{where}.content` must be a string or a list of content parts")
    parts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        _check(
            kind in TEXT_PART_TYPES and isinstance(part.get("text", part.get("refusal")), str),
            f"`{where}.content[{index}]` must be an input_text or output_text part with a `text` string"
            + (f", not type {quoted(str(kind))}" if isinstance(kind, str) else ""),
        )
        parts.append({"type": "text", "text": part.get("text", part.get("refusal"))})
    return parts


def input_messages(value: Any) -> list[dict[str, Any]]:
    """`input` (plain JSON) as chat messages; raises ValidationError for what chat can't say."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    _check(isinstance(value, list), "`input` must be a string or a list of input items")
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(value):
        where = f"input[{index}]"
        _check(isinstance(item, dict), f"`{where}` must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            _check(role in MESSAGE_ROLES, f"`{where}.role` must be one of {', '.join(MESSAGE_ROLES)}")
            messages.append(
                {"role": "system" if role == "developer" else role, "content": _text_of(item.get("content"), where)}
            )
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            _check(
                all(isinstance(v, str) for v in (call_id, name, arguments)),
                f"`{where}` (function_call) needs `call_id`, `name` and `arguments` strings",
            )
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and last["content"] is None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            _check(isinstance(call_id, str), f"`{where}` (function_call_output) needs a `call_id` string")
            if not isinstance(output, str):
                output = _text_of(output, where)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue  # a reasoning model's thoughts of an earlier turn: not part of the next prompt
        else:
            given = shortened(str(kind), ECHO_CHARS)
            raise ValidationError(
                f"`{where}.type` must be message, function_call or function_call_output, not {quoted(given)}"
            )
    return messages


def output_messages(output: Any) -> list[dict[str, Any]]:
    """A response's output items as the chat messages of the conversation's next turn."""
    items = []
    for item in output:
        if item.type == "message":
            items.append({"type": "message", "role": "assistant", "content": "".join(p.text for p in item.content)})
        elif item.type == "function_call":
            items.append(
                {"type": "function_call", "call_id": item.call_id, "name": item.name, "arguments": item.arguments}
            )
    return input_messages(items)


def _tool(tool: rpb.ResponseTool, index: int) -> pb.Tool:
    _check(tool.type in ("function", ""), f"`tools[{index}].type` must be function, not {quoted(tool.type)}")
    _check(bool(tool.name), f"`tools[{index}].name` must be a function name")
    function = pb.FunctionDefinition(name=tool.name, parameters=tool.parameters)
    if tool.HasField("description"):
        function.description = tool.description
    if tool.HasField("strict"):
        function.strict = tool.strict
    return pb.Tool(type="function", function=function)


def _tool_choice(choice: Any) -> Any:
    """Responses' {"type": "function", "name"} as chat's {"type": "function", "function": {"name"}}."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict):
        given = shortened(str(choice.get("type")), ECHO_CHARS)
        raise ValidationError(f"`tool_choice` must be none, auto, required or a function, not type {quoted(given)}")
    return choice


def _response_format(text_format: rpb.ResponseTextFormat) -> pb.ResponseFormat:
    kind = text_format.type
    if kind == "json_schema":
        _check(text_format.HasField("schema"), "`text.format.schema` must be a JSON schema object")
        schema = pb.JsonSchemaFormat(name=text_format.name, schema=text_format.schema)
        return pb.ResponseFormat(type="json_schema", json_schema=schema)
    if kind in ("json", "regex") and text_format.HasField("value"):  # TGI's grammar shapes
        return pb.ResponseFormat(type=kind, value=text_format.value)
    _check(
        kind in ("", "text", "json_object"),
        f"`text.format.type` must be text, json_object or json_schema, not {quoted(kind)}",
    )
    return pb.ResponseFormat(type=kind or "text")


def chat_request(
    request: rpb.CreateResponseRequest, history: list[dict[str, Any]]
) -> tuple[pb.ChatCompletionRequest, list[dict[str, Any]]]:
    """The chat request this response is, and the conversation so far without the instructions
    (what a later turn continues): `history` (a previous response's conversation), then `input`."""
    _check(request.HasField("input"), "`input` is required")
    turn = history + input_messages(value_to_python(request.input))
    _check(len(turn) > 0, "`input` must not be empty")
    messages = list(turn)
    if request.HasField("instructions") and request.instructions:
        messages.insert(0, {"role": "system", "content": request.instructions})
    chat = pb.ChatCompletionRequest(model=request.model, n=1)
    for message in messages:
        converted = pb.ChatMessage()
        json_format.ParseDict({k: v for k, v in message.items() if k != "content"}, converted)
        if message["content"] is None:
            converted.content.null_value = struct_pb2.NULL_VALUE
        else:
            converted.content.CopyFrom(_value(message["content"]))
        chat.messages.append(converted)
    chat.tools.extend(_tool(tool, i) for i, tool in enumerate(request.tools))
    if request.HasField("tool_choice"):
        chat.tool_choice.CopyFrom(_value(_tool_choice(value_to_python(request.tool_choice))))
    if request.text.HasField("format"):
        chat.response_format.CopyFrom(_response_format(request.text.format))
    fields: Any = request  # HasField by a name from the table below
    for name, chat_name in (
        ("max_output_tokens", "max_completion_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("parallel_tool_calls", "parallel_tool_calls"),
        ("seed", "seed"),
        ("tool_prompt", "tool_prompt"),
    ):
        if fields.HasField(name):
            setattr(chat, chat_name, getattr(request, name))
    return chat, turn


def _value(python: Any) -> struct_pb2.Value:
    value = struct_pb2.Value()
    json_format.ParseDict(plain_json(python), value)
    return value
