"""OpenAI requests → the front end's requests: pure conversions, no I/O.

The engine never sees OpenAI types: a chat or completion request becomes a `GenerateRequest` (the
prompt text, parameters in TGI's terms) with its sampling decided here, plus what only the API needs
(how many choices, logprobs, tools). OpenAI's ranges are checked here, in OpenAI's terms; the
validator's `prepare` then checks the engine's limits. Mapping, explicitly (`defaults` has the table):
- `temperature` absent is 1.0 and samples (OpenAI's default); 0 is greedy (`do_sample` false); as
  OpenAI, at most 2. `top_p` 1 is off (no filter).
- `max_completion_tokens` (or the older `max_tokens`) is `max_new_tokens`; absent, `defaults` decides.
- `n` choices decode in one batch; with a `seed`, choice i is seeded `seed + i`.
- `stop` is a string or a list; the stop text is not part of the returned text.
- `presence_penalty` subtracts once from every token already seen, `logit_bias` adds to the
  given token ids (both OpenAI's definitions).
- `logprobs`/`top_logprobs` (chat) and `logprobs: k` (completions) are TGI's details and
  `top_n_tokens`; values are the model's raw logprobs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format

from inference_service.errors import ValidationError, quoted
from inference_service.frontend import defaults, openai_tools
from inference_service.frontend.parameters import MAX_SEED, GenerateParameters
from inference_service.frontend.plain_json import plain_json, value_to_python
from inference_service.frontend.reasoning import ReasoningSyntax
from inference_service.frontend.tool_syntax import ToolSyntax
from textgen.v1 import generate_pb2 as pb

MAX_CHOICES = 16  # n x prompts in one call
MAX_PROMPTS = 4  # TGI's --max-client-batch-size default for /v1/completions
FIM_TOKENS = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValidationError(message)


@dataclass
class ChatPlan:
    """What a chat request asks for, once OpenAI's shapes are gone."""

    messages: list[dict[str, Any]]
    parameters: GenerateParameters
    do_sample: bool
    num_choices: int
    logprobs: bool
    include_usage: bool
    tools: list[dict[str, Any]] = field(default_factory=list)  # offered to the template
    tool_calls: openai_tools.ToolCallFormat | None = None  # the output may be tool calls
    documents: list[dict[str, Any]] = field(default_factory=list)
    tool_prompt: str | None = None
    template_variables: dict[str, Any] = field(default_factory=dict)
    tool_syntax: ToolSyntax = openai_tools.DEFAULT_SYNTAX  # how calls are written and read back
    reasoning: ReasoningSyntax | None = None  # thoughts to split from the answer
    reasoning_inside: bool = False  # the prompt opened the thoughts (known once rendered)
    token_bytes: Callable[[int], bytes] | None = None  # id → its bytes (logprobs of part of a character)


@dataclass
class CompletionPlan:
    prompts: list[str]
    parameters: GenerateParameters
    do_sample: bool
    num_choices: int  # per prompt
    logprobs: int | None  # alternatives per token, None: no logprobs
    echo: bool
    include_usage: bool
    suffix: str | None = None  # fill-in-the-middle: the text after the completion
    token_bytes: Callable[[int], bytes] | None = None  # id → its bytes (logprobs of part of a character)


# -- shared parameters ---------------------------------------------------------------------------
def _stop_sequences(request: Any) -> list[str]:
    stop = value_to_python(request.stop) if request.HasField("stop") else None
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    _check(
        isinstance(stop, list) and all(isinstance(s, str) for s in stop), "`stop` must be a string or a list of strings"
    )
    return stop


def _logit_bias(biases: Any) -> dict[int, float]:
    parsed = {}
    for key, bias in biases.items():
        _check(key.lstrip("-").isdigit(), f"`logit_bias` keys must be token ids, not {quoted(key)}")
        _check(-100.0 <= bias <= 100.0, f"`logit_bias` values must be in [-100, 100]. Given: {bias}")
        parsed[int(key)] = float(bias)
    return parsed


def _num_choices(request: Any, num_prompts: int = 1) -> int:
    n = request.n if request.HasField("n") else 1
    _check(n >= 1, "`n` must be >= 1")
    _check(n * num_prompts <= MAX_CHOICES, f"`n` x prompts must be <= {MAX_CHOICES}. Given: {n * num_prompts}")
    return n


def _in_range(request: Any, name: str, low: float, high: float) -> None:
    if request.HasField(name):
        value = getattr(request, name)
        _check(low <= value <= high, f"`{name}` must be >= {low} and <= {high}. Given: {value}")


def _sampling_parameters(
    request: Any, max_tokens: int | None, top_n_tokens: int | None
) -> tuple[GenerateParameters, bool]:
    """The parameters both routes share, and whether the request samples: OpenAI's ranges and
    meanings, each field mapped explicitly."""
    _in_range(request, "temperature", 0.0, 2.0)
    _check(not request.HasField("top_p") or 0.0 < request.top_p <= 1.0, "`top_p` must be > 0.0 and <= 1.0")
    _in_range(request, "frequency_penalty", -2.0, 2.0)
    _in_range(request, "presence_penalty", -2.0, 2.0)
    _check(
        not request.HasField("repetition_penalty") or request.repetition_penalty > 0.0,
        "`repetition_penalty` must be strictly positive",
    )
    _check(not request.HasField("top_k") or request.top_k > 0, "`top_k` must be strictly positive")
    temperature = request.temperature if request.HasField("temperature") else defaults.OPENAI_TEMPERATURE
    do_sample = temperature > 0.0  # OpenAI: temperature 0 is greedy
    parameters = GenerateParameters(
        max_new_tokens=max_tokens,
        stop=_stop_sequences(request),
        top_n_tokens=top_n_tokens,
        details=True,
        temperature=temperature if do_sample else None,
        top_p=request.top_p if request.HasField("top_p") and request.top_p < 1.0 else None,  # 1: no filter
        frequency_penalty=request.frequency_penalty if request.HasField("frequency_penalty") else None,
        repetition_penalty=request.repetition_penalty if request.HasField("repetition_penalty") else None,
        top_k=request.top_k if request.HasField("top_k") else None,
        presence_penalty=request.presence_penalty if request.HasField("presence_penalty") else None,
        seed=request.seed if request.HasField("seed") else None,
        logit_bias=_logit_bias(request.logit_bias),
    )
    return parameters, do_sample


def choice_seeds(seed: int, num_choices: int, requested: bool, draw: Any) -> list[int]:
    """Choice i's seed: `seed + i` when the caller gave one (reproducible), else a fresh draw."""
    if requested:
        return [(seed + i) % (MAX_SEED + 1) for i in range(num_choices)]
    return [seed] + [draw() for _ in range(num_choices - 1)]


# -- chat -----------------------------------------------------------------------------------------
def _message(message: pb.ChatMessage) -> dict[str, Any]:
    converted = plain_json(json_format.MessageToDict(message, preserving_proto_field_name=True))
    if message.HasField("content"):
        converted["content"] = value_to_python(message.content) if message.content.ByteSize() else None
    converted.setdefault("content", None)
    converted.pop("images", None)
    if message.images:  # raw bytes, not the base64 JSON would carry
        converted["images"] = [image.data for image in message.images]
    for call in converted.get("tool_calls", ()):
        call.pop("index", None)
        call.setdefault("type", "function")
    return converted


def chat_plan(
    request: pb.ChatCompletionRequest,
    tool_syntax: ToolSyntax = openai_tools.DEFAULT_SYNTAX,
    reasoning: ReasoningSyntax | None = None,
) -> ChatPlan:
    """Raises ValidationError (or ToolError) for what the engine's validation does not check.
    `tool_syntax` and `reasoning`: the model's formats (`--tool-call-parser`, `--reasoning-parser`)."""
    _check(len(request.messages) > 0, "`messages` must not be empty")
    _check(not request.HasField("top_logprobs") or request.logprobs, "`top_logprobs` needs `logprobs` set to true")
    max_tokens = (
        request.max_completion_tokens
        if request.HasField("max_completion_tokens")
        else (request.max_tokens if request.HasField("max_tokens") else None)
    )
    if max_tokens is None:
        max_tokens = defaults.CHAT_MAX_NEW_TOKENS
    top_n = request.top_logprobs if request.HasField("top_logprobs") else None
    parameters, do_sample = _sampling_parameters(request, max_tokens, top_n)
    tools = [plain_json(json_format.MessageToDict(t, preserving_proto_field_name=True)) for t in request.tools]
    tool_choice = value_to_python(request.tool_choice) if request.HasField("tool_choice") else None
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
    tool_calls = openai_tools.tool_call_format(tools, tool_choice, parallel)
    response_grammar = response_format_grammar(request.response_format) if request.HasField("response_format") else None
    parameters.grammar = openai_tools.combined_grammar(tool_calls, response_grammar, tool_syntax)
    return ChatPlan(
        messages=[_message(m) for m in request.messages],
        parameters=parameters,
        do_sample=do_sample,
        num_choices=_num_choices(request),
        logprobs=request.logprobs,
        include_usage=request.stream_options.include_usage,
        tools=tools if tool_choice != "none" else [],
        tool_calls=tool_calls,
        documents=[plain_json(json_format.MessageToDict(d)) for d in request.documents],
        tool_prompt=request.tool_prompt if request.HasField("tool_prompt") else None,
        template_variables=value_to_python(request.chat_template_kwargs) or {},
        tool_syntax=tool_syntax,
        reasoning=reasoning,
    )


def response_format_grammar(response_format: pb.ResponseFormat) -> dict[str, Any] | None:
    """OpenAI's `response_format` (or TGI's grammar shape in it) as TGI's grammar; None for text."""
    kind = response_format.type
    if kind in ("", "text"):
        return None
    if kind == "json_schema" and response_format.HasField("json_schema"):
        schema = value_to_python(response_format.json_schema.schema)
        _check(isinstance(schema, dict), "`response_format.json_schema.schema` must be a JSON schema object")
        return {"type": "json", "value": schema}
    if response_format.HasField("value"):  # TGI's {"type": "json" | "json_object" | "regex", "value": ...}
        return {"type": kind, "value": value_to_python(response_format.value)}
    if kind == "json_object":
        return {"type": "json", "value": {"type": "object"}}
    raise ValidationError(f"`response_format.type` must be text, json_object or json_schema, not {quoted(kind)}")


# -- completions ------------------------------------------------------------------------------------
def completion_plan(request: pb.CompletionRequest, *, has_fill_in_middle: bool) -> CompletionPlan:
    prompt = value_to_python(request.prompt) if request.HasField("prompt") else None
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not (isinstance(prompts, list) and len(prompts) > 0 and all(isinstance(p, str) for p in prompts)):
        raise ValidationError("`prompt` must be a string or a non-empty list of strings")
    _check(len(prompts) <= MAX_PROMPTS, f"at most {MAX_PROMPTS} prompts per request. Given: {len(prompts)}")
    _check(
        not request.HasField("suffix") or has_fill_in_middle,
        "`suffix` is not supported: this model has no fill-in-the-middle tokens",
    )
    num_choices = _num_choices(request, len(prompts))
    _check(
        not request.HasField("best_of") or request.best_of in (1, num_choices),
        "`best_of` must equal `n` (every generated choice is returned)",
    )
    logprobs = request.logprobs if request.HasField("logprobs") else None
    max_tokens = request.max_tokens if request.HasField("max_tokens") else defaults.COMPLETION_MAX_NEW_TOKENS
    parameters, do_sample = _sampling_parameters(request, max_tokens, logprobs or None)
    parameters.decoder_input_details = bool(request.echo and logprobs is not None)
    if request.HasField("response_format"):
        parameters.grammar = response_format_grammar(request.response_format)
    return CompletionPlan(
        prompts=prompts,
        parameters=parameters,
        do_sample=do_sample,
        num_choices=num_choices,
        logprobs=logprobs,
        echo=request.echo,
        include_usage=request.stream_options.include_usage,
        suffix=request.suffix if request.HasField("suffix") else None,
    )


def has_fill_in_middle(tokenizer: Any) -> bool:
    unknown = getattr(tokenizer, "unk_token_id", None)
    ids = [tokenizer.convert_tokens_to_ids(token) for token in FIM_TOKENS]
    return all(isinstance(i, int) and i != unknown for i in ids)


def with_suffix(prompt: str, suffix: str | None) -> str:
    """The fill-in-the-middle prompt (StarCoder's tokens) when a suffix is given."""
    if suffix is None:
        return prompt
    return f"{FIM_TOKENS[0]}{prompt}{FIM_TOKENS[1]}{suffix}{FIM_TOKENS[2]}"
