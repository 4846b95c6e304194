"""Chat prompts: the model's own chat template, rendered through transformers.

The template is the tokenizer's (`tokenizer_config.json`'s `chat_template`, or the
`chat_template.jinja` beside it: transformers reads both) unless `--chat-template FILE` replaces it.
Messages are OpenAI's dicts; before rendering they are brought to what templates expect:
- content given as a list of parts becomes one string (text parts joined); for a vision-language
  model, content holding images stays a list of `{"type": "text"}` and `{"type": "image"}` parts
  (`chat_images` rewrote them), which its template turns into the model's image placeholders;
- an assistant message that called tools keeps its `tool_calls`; for a template that does not know
  them, its content becomes the calls as the JSON text the model wrote (the grammar's format);
- a last assistant message is continued (assistant prefill), not closed, as TGI and vLLM do.
A template that does not use `tools` gets the definitions after a tool prompt appended to the last
message (TGI's fallback), so every model can be offered tools.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import jinja2

from inference_service.errors import TemplateError, quoted, shortened

# Put before the tool definitions when the template cannot render them itself.
DEFAULT_TOOL_PROMPT = (
    "You have access to the following functions. To call one, reply with only a JSON "
    'object {"name": <function name>, "arguments": <arguments object>}:'
)
NO_TEMPLATE = (
    "the model has no chat template: pass one with --chat-template FILE (a Jinja template as in "
    "tokenizer_config.json), or use /v1/completions or /generate with a prompt"
)
RENDER_ERROR_CHARS = 200  # of a template's own error message (it may quote the messages)


def load_template_file(path: str | Path) -> str:
    """The text of a `--chat-template` file (a Jinja template, or a tokenizer_config.json holding one)."""
    text = Path(path).read_text(encoding="utf-8")
    if Path(path).suffix == ".json":
        template = json.loads(text).get("chat_template")
        if not isinstance(template, str):
            raise ValueError(f"{path} has no 'chat_template' string")
        return template
    return text


def tool_calls_text(tool_calls: list[dict[str, Any]]) -> str:
    """Calls as the model writes them under the tool grammar: one JSON object a line."""
    lines = []
    for call in tool_calls:
        function = call.get("function") or {}
        arguments = function.get("arguments") or "{}"
        with contextlib.suppress(json.JSONDecodeError):  # else shown as the text it was
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        lines.append(json.dumps({"name": function.get("name", ""), "arguments": arguments}, ensure_ascii=False))
    return "\n".join(lines)


class ChatTemplate:
    """Renders OpenAI-style conversations into the prompt text the model was trained on."""

    def __init__(self, tokenizer: Any, template: str | None = None):
        self._tokenizer = tokenizer
        self.source: str | dict | None = template or getattr(tokenizer, "chat_template", None)

    @property
    def available(self) -> bool:
        return bool(self.source)

    def _uses(self, name: str) -> bool:
        sources = self.source.values() if isinstance(self.source, dict) else [self.source or ""]
        return any(name in text for text in sources)

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        tool_prompt: str | None = None,
        variables: dict[str, Any] | None = None,
        image_parts: bool = False,
    ) -> str:
        """The prompt text (special tokens included: tokenize it without adding more).
        `image_parts`: content lists holding images are kept as parts (a vision model's template)."""
        if not self.available:
            raise TemplateError(NO_TEMPLATE)
        if not messages:
            raise TemplateError("`messages` must not be empty")
        messages = [self._prepared(message, image_parts) for message in messages]
        if tools and not self._uses("tools"):
            messages = _with_tool_prompt(messages, tools, tool_prompt or DEFAULT_TOOL_PROMPT)
            tools = None
        continued = messages[-1]["role"] == "assistant"
        try:
            return self._tokenizer.apply_chat_template(
                messages,
                tools=tools or None,
                documents=documents or None,
                chat_template=self._template(),
                add_generation_prompt=not continued,
                continue_final_message=continued,
                tokenize=False,
                **(variables or {}),
            )
        except Exception as error:  # Jinja syntax, raise_exception(), a missing variable
            raise TemplateError(_render_failure(error)) from error

    def _template(self) -> str | None:
        """A dict of named templates: transformers picks "default" (or "tool_use" with tools) itself."""
        return None if isinstance(self.source, dict) else self.source

    def _prepared(self, message: dict[str, Any], image_parts: bool = False) -> dict[str, Any]:
        role = message.get("role")
        if role not in ("system", "user", "assistant", "tool", "developer"):
            raise TemplateError(f"unknown message role {quoted(role)}: use system, user, assistant or tool")
        prepared = {key: value for key, value in message.items() if value is not None}
        content = message.get("content")
        keep = image_parts and isinstance(content, list) and any(p.get("type") == "image" for p in content)
        prepared["content"] = content if keep else _content_text(content)
        if role == "developer":  # OpenAI's newer name for system
            prepared["role"] = "system"
        calls = message.get("tool_calls")
        if calls and not self._uses("tool_calls"):
            text = tool_calls_text(calls)
            prepared["content"] = f"{prepared['content']}\n{text}" if prepared["content"] else text
            del prepared["tool_calls"]
        return prepared


def _render_failure(error: Exception) -> str:
    """What a caller is told when rendering failed: the template's own message (`raise_exception`,
    an undefined variable) or transformers' (a ValueError), first line and shortened; any other
    exception is the template engine's internals."""
    if isinstance(error, (jinja2.TemplateError, ValueError)) and str(error).strip():
        return shortened(str(error).strip().splitlines()[0], RENDER_ERROR_CHARS)
    return "the chat template could not render these messages"


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TemplateError("`content` must be a string or a list of content parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            texts.append(str(part.get("text", "")))
        else:
            raise TemplateError(f"unsupported content part type {quoted(kind)}: use 'text'")
    return "".join(texts)


def _with_tool_prompt(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], tool_prompt: str
) -> list[dict[str, Any]]:
    definitions = "\n".join(json.dumps(tool.get("function", tool), ensure_ascii=False) for tool in tools)
    last = dict(messages[-1])
    last["content"] = f"{last['content']}\n\n{tool_prompt}\n{definitions}".lstrip("\n")
    return [*messages[:-1], last]
