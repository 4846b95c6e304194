"""Engine results → OpenAI's response messages (chat completions, chunks, text completions).

Pure functions and small per-choice stream readers; no I/O. Conventions:
- logprobs are raw (before penalties and temperature); -inf is written as -9999.0, as OpenAI does;
- a special token is never content; the final EOS is not a logprob entry either;
- a reasoning model's thoughts (`plan.reasoning`) go to `reasoning_content` (and `reasoning`), and
  only the answer after them is read for tool calls (in the model's format, `plan.tool_syntax`);
- a stream sends no empty delta;
- `finish_reason` is "stop" for the end of text or a stop sequence, "length", or "tool_calls".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from google.protobuf import struct_pb2

from inference_service import __version__
from inference_service.frontend.answer_stream import AnswerStream
from inference_service.frontend.openai import ChatPlan, CompletionPlan
from inference_service.frontend.reasoning import split_reasoning
from inference_service.frontend.tool_parsers import parse_tool_calls
from inference_service.outputs import FinishReason, GenerateResult, PrefillToken, RequestOutput, Token
from textgen.v1 import generate_pb2 as pb

SYSTEM_FINGERPRINT = f"{__version__}-native"
TokenBytes = Callable[[int], bytes]
MIN_LOGPROB = -9999.0


def _logprob(value: float) -> float:
    return value if math.isfinite(value) and value > MIN_LOGPROB else MIN_LOGPROB


def _text_and_bytes(token: Token, token_bytes: TokenBytes | None) -> tuple[str, bytes]:
    """A token that is part of a UTF-8 character has no text of its own: as OpenAI, its bytes are
    shown escaped (`\\xe6\\x97`) and given in `bytes` (a text's tokens' bytes join into its bytes)."""
    if token_bytes is not None and not token.special:
        raw = token_bytes(token.id)
        try:
            raw.decode()
        except UnicodeDecodeError:
            return "".join(f"\\x{byte:02x}" for byte in raw), raw
    return token.text, token.text.encode()


def _top(token: Token, token_bytes: TokenBytes | None = None) -> pb.TopLogprob:
    text, raw = _text_and_bytes(token, token_bytes)
    return pb.TopLogprob(token=text, logprob=_logprob(token.logprob), bytes=raw)


def chat_logprobs(
    tokens: Sequence[Token],
    top_tokens: Sequence[Sequence[Token]],
    reason: FinishReason | None,
    token_bytes: TokenBytes | None = None,
) -> pb.ChoiceLogprobs:
    """`reason`: how the output ended, when these tokens end it (an ending EOS is left out);
    `token_bytes`: id → the token's bytes, for tokens that are part of a character."""
    last = len(tokens) - 1 if reason == FinishReason.EOS_TOKEN else -1
    content = [
        pb.TokenLogprob(
            token=_text_and_bytes(token, token_bytes)[0],
            logprob=_logprob(token.logprob),
            bytes=_text_and_bytes(token, token_bytes)[1],
            top_logprobs=[_top(t, token_bytes) for t in (top_tokens[i] if i < len(top_tokens) else ())],
        )
        for i, token in enumerate(tokens)
        if not (token.special and i == last)
    ]
    return pb.ChoiceLogprobs(content=content)


def finish_reason(reason: FinishReason, called_tools: bool) -> str:
    if called_tools:
        return "tool_calls"
    return "length" if reason == FinishReason.LENGTH else "stop"


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
    )


def _tool_call(call: dict, index: int | None = None) -> pb.ToolCall:
    return pb.ToolCall(
        index=index,
        id=call["id"],
        type="function",
        function=pb.FunctionCall(name=call["function"]["name"], arguments=call["function"]["arguments"]),
    )


@dataclass(frozen=True)
class ResponseHeader:
    """What every response and chunk of one call repeats."""

    id: str
    created: int
    model: str


def chat_response(
    results: Sequence[GenerateResult], plan: ChatPlan, header: ResponseHeader
) -> pb.ChatCompletionResponse:
    choices = []
    for index, result in enumerate(results):
        text, thoughts, calls = result.generated_text, None, list[dict]()
        if plan.reasoning is not None:
            thoughts, text = split_reasoning(plan.reasoning, plan.reasoning_inside, text)
        if plan.tool_calls is not None:
            content, calls = parse_tool_calls(plan.tool_syntax, text, plan.tool_calls.schemas)
            text = content.strip() if calls else text  # no call: the text as written
        message = pb.ChatCompletionMessage(role="assistant")
        message.tool_calls.extend(_tool_call(call) for call in calls)
        if text or (thoughts is None and not calls):
            message.content = text
        if thoughts:
            message.reasoning_content = message.reasoning = thoughts
        choice = pb.ChatCompletionChoice(
            index=index, finish_reason=finish_reason(result.finish_reason, bool(calls)), message=message
        )
        if plan.logprobs:
            choice.logprobs.CopyFrom(
                chat_logprobs(result.tokens, result.top_tokens, result.finish_reason, plan.token_bytes)
            )
        choices.append(choice)
    return pb.ChatCompletionResponse(
        id=header.id,
        object="chat.completion",
        created=header.created,
        model=header.model,
        system_fingerprint=SYSTEM_FINGERPRINT,
        choices=choices,
        usage=usage(results[0].num_prompt_tokens, sum(r.num_generated_tokens for r in results)),
    )


def chat_chunk(
    header: ResponseHeader, choices: Sequence[pb.ChatCompletionChunkChoice] = (), usage_: pb.Usage | None = None
) -> pb.ChatCompletionChunk:
    return pb.ChatCompletionChunk(
        id=header.id,
        object="chat.completion.chunk",
        created=header.created,
        model=header.model,
        system_fingerprint=SYSTEM_FINGERPRINT,
        choices=choices,
        usage=usage_,
    )


def _visible_text(output: RequestOutput) -> str:
    return "".join(token.text for token in output.tokens if not token.special)


@dataclass
class ChatChoiceStream:
    """One choice's outputs as chunk choices: the role first, then thoughts, content or tool-call
    deltas; the final text (stop sequence removed) decides the last delta."""

    index: int
    plan: ChatPlan
    _fed: str = ""
    _started: bool = False
    _answer: AnswerStream = field(init=False)
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0

    def __post_init__(self) -> None:
        self._answer = AnswerStream.for_plan(self.plan)

    def choices(self, output: RequestOutput) -> list[pb.ChatCompletionChunkChoice]:
        text = _visible_text(output)
        if output.finished and output.generated_text is not None:
            text = output.generated_text[len(self._fed) :] if output.generated_text.startswith(self._fed) else ""
        self._fed += text
        delta = pb.ChatCompletionDelta()
        if not self._started:
            delta.role, self._started = "assistant", True
        for item in self._answer.pieces(text, output.finished):
            _add(delta, item)
        if delta.role and not (delta.HasField("content") or delta.tool_calls or delta.HasField("reasoning_content")):
            delta.content = ""
        choice = pb.ChatCompletionChunkChoice(index=self.index, delta=delta)
        if self.plan.logprobs:
            choice.logprobs.CopyFrom(
                chat_logprobs(output.tokens, output.top_tokens, output.finish_reason, self.plan.token_bytes)
            )
        if output.finish_reason is not None:
            self.num_prompt_tokens, self.num_generated_tokens = output.num_prompt_tokens, output.num_generated_tokens
            called = self._answer.called
            choice.finish_reason = finish_reason(output.finish_reason, called)
        elif not (delta.ByteSize() or choice.logprobs.content):
            return []  # nothing to tell yet (e.g. a marker or a call's name still incomplete)
        return [choice]


def _add(delta: pb.ChatCompletionDelta, item: tuple) -> None:
    kind = item[0]
    if kind == "content":
        if item[1]:
            delta.content = delta.content + item[1]
    elif kind == "reasoning":
        delta.reasoning_content = delta.reasoning_content + item[1]
        delta.reasoning = delta.reasoning_content
    elif kind == "call":
        _, index, call_id, name = item
        delta.tool_calls.append(
            pb.ToolCall(index=index, id=call_id, type="function", function=pb.FunctionCall(name=name, arguments=""))
        )
    else:
        _, index, piece = item
        delta.tool_calls.append(pb.ToolCall(index=index, function=pb.FunctionCall(arguments=piece)))


# -- text completions ------------------------------------------------------------------------------
def completion_logprobs(
    tokens: Sequence[Token],
    top_tokens: Sequence[Sequence[Token]],
    offset: int,
    prompt: tuple[str, Sequence[PrefillToken]] | None = None,
    token_bytes: TokenBytes | None = None,
) -> pb.CompletionLogprobs:
    """The legacy shape: parallel lists, and `top_logprobs` as one {token: logprob} object each.
    `prompt`: with `echo`, the prompt's text and tokens, whose entries come first (from offset 0)."""
    logprobs = pb.CompletionLogprobs()
    if prompt is not None:
        _add_prompt_entries(logprobs, *prompt, token_bytes)
    for i, token in enumerate(tokens):
        if token.special:
            continue
        top = top_tokens[i] if i < len(top_tokens) else ()
        _add_entry(logprobs, token.text, token.logprob, top, offset, token_bytes)
        offset += len(token.text)
    return logprobs


def _add_entry(
    logprobs: pb.CompletionLogprobs,
    text: str,
    logprob: float | None,
    top: Sequence[Token],
    offset: int,
    token_bytes: TokenBytes | None,
) -> None:
    """One token's entry; a logprob of None (the first prompt token's) is JSON's null, and so are
    its alternatives. Alternatives are keyed by text (part of a character: its bytes, escaped);
    where two share a key, the likelier one's value stays."""
    logprobs.tokens.append(text)
    logprobs.text_offset.append(offset)
    chosen, alternatives = logprobs.token_logprobs.add(), logprobs.top_logprobs.add()
    if logprob is None:
        chosen.null_value = alternatives.null_value = struct_pb2.NULL_VALUE
        return
    chosen.number_value = _logprob(logprob)
    by_text: dict[str, float] = {}
    for token in sorted(top, key=lambda t: -t.logprob):
        by_text.setdefault(_text_and_bytes(token, token_bytes)[0], _logprob(token.logprob))
    alternatives.struct_value.update(by_text)


def _add_prompt_entries(
    logprobs: pb.CompletionLogprobs, prompt: str, tokens: Sequence[PrefillToken], token_bytes: TokenBytes | None
) -> None:
    """The echoed prompt's tokens, each at the character of the prompt where it starts. A first token
    the text does not hold (a BOS the tokenizer added) is listed, as vLLM does, but takes no room."""
    text, cursor, characters = prompt.encode(), 0, 0
    for position, token in enumerate(tokens):
        shown, raw = _text_and_bytes(Token(token.id, token.text, 0.0, False), token_bytes)
        inside = cursor < len(text) and text[cursor] & 0xC0 == 0x80  # a token may start inside a character
        _add_entry(logprobs, shown, token.logprob, token.top_tokens, characters - inside, token_bytes)
        if position > 0 or text.startswith(raw, cursor):
            taken = text[cursor : cursor + len(raw)]
            characters += sum(1 for byte in taken if byte & 0xC0 != 0x80)  # lead bytes: one per character
            cursor += len(taken)


def completion_choice(
    index: int, text: str, result: GenerateResult | RequestOutput, plan: CompletionPlan, echoed: str, offset: int
) -> pb.CompletionChoice:
    """`echoed`: the prompt when this choice's first text is sent with `echo`, else ""; `offset`:
    characters of this choice's text sent before (logprobs' text offsets count the prompt too).
    With `echo` and `logprobs`, the prompt's logprobs come with its text."""
    choice = pb.CompletionChoice(index=index, text=echoed + text)
    if result.finish_reason is not None:
        choice.finish_reason = finish_reason(result.finish_reason, False)
    if plan.logprobs is not None:
        prompt = (echoed, result.prefill_tokens or ()) if echoed else None
        choice.logprobs.CopyFrom(
            completion_logprobs(result.tokens, result.top_tokens, len(echoed) + offset, prompt, plan.token_bytes)
        )
    return choice


def completion_response(
    results: Sequence[GenerateResult], plan: CompletionPlan, header: ResponseHeader
) -> pb.CompletionResponse:
    choices = [
        completion_choice(i, r.generated_text, r, plan, plan.prompts[i // plan.num_choices] if plan.echo else "", 0)
        for i, r in enumerate(results)
    ]
    num_prompt_tokens = sum(results[i * plan.num_choices].num_prompt_tokens for i in range(len(plan.prompts)))
    return completion_chunk(header, choices, usage(num_prompt_tokens, sum(r.num_generated_tokens for r in results)))


def completion_chunk(
    header: ResponseHeader, choices: Sequence[pb.CompletionChoice] = (), usage_: pb.Usage | None = None
) -> pb.CompletionResponse:
    return pb.CompletionResponse(
        id=header.id,
        object="text_completion",
        created=header.created,
        model=header.model,
        system_fingerprint=SYSTEM_FINGERPRINT,
        choices=choices,
        usage=usage_,
    )


@dataclass
class CompletionChoiceStream:
    """One choice's outputs as text completion chunks (the prompt first with `echo`)."""

    index: int
    prompt: str
    plan: CompletionPlan
    _sent: str = ""
    _echoed: bool = False
    num_prompt_tokens: int = 0  # once finished
    num_generated_tokens: int = 0

    def choices(self, output: RequestOutput) -> list[pb.CompletionChoice]:
        text = _visible_text(output)
        if output.finished and output.generated_text is not None:
            text = output.generated_text[len(self._sent) :] if output.generated_text.startswith(self._sent) else ""
        echoed = self.prompt if self.plan.echo and not self._echoed else ""
        scored = self.plan.logprobs is not None and any(not token.special for token in output.tokens)
        if not (text or echoed or scored or output.finish_reason is not None):
            return []  # nothing to tell yet; a token with no text of its own (part of a character) still has a logprob
        before = len(self._sent) + (len(self.prompt) if self.plan.echo and self._echoed else 0)  # text sent before
        choice = completion_choice(self.index, text, output, self.plan, echoed, before)
        self._sent, self._echoed = self._sent + text, True
        if output.finish_reason is not None:
            self.num_prompt_tokens, self.num_generated_tokens = output.num_prompt_tokens, output.num_generated_tokens
        return [choice]
