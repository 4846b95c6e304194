"""Engine results → OpenAI's response messages (chat completions, chunks, text completions).

Pure functions and small per-choice stream readers; no I/O. Conventions:
- logprobs are raw (before penalties and temperature); -inf is written as -9999.0, as OpenAI does;
- a special token (the final EOS) is neither content nor a logprob entry;
- `finish_reason` is "stop" for the end of text or a stop sequence, "length", or "tool_calls".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from inference_service import __version__
from inference_service.frontend.openai import ChatPlan, CompletionPlan
from inference_service.frontend.openai_tools import ToolCallStream, parse_tool_calls
from inference_service.outputs import FinishReason, GenerateResult, RequestOutput, Token
from textgen.v1 import generate_pb2 as pb

SYSTEM_FINGERPRINT = f"{__version__}-native"
MIN_LOGPROB = -9999.0


def _logprob(value: float) -> float:
    return value if math.isfinite(value) and value > MIN_LOGPROB else MIN_LOGPROB


def _top(token: Token) -> pb.TopLogprob:
    return pb.TopLogprob(token=token.text, logprob=_logprob(token.logprob), bytes=token.text.encode())


def chat_logprobs(tokens: Sequence[Token], top_tokens: Sequence[Sequence[Token]]) -> pb.ChoiceLogprobs:
    content = [
        pb.TokenLogprob(
            token=token.text,
            logprob=_logprob(token.logprob),
            bytes=token.text.encode(),
            top_logprobs=[_top(t) for t in (top_tokens[i] if i < len(top_tokens) else ())],
        )
        for i, token in enumerate(tokens)
        if not token.special
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
        calls = parse_tool_calls(result.generated_text) if plan.tool_calls is not None else None
        message = pb.ChatCompletionMessage(role="assistant")
        if calls:
            message.tool_calls.extend(_tool_call(call) for call in calls)
        else:
            message.content = result.generated_text
        choice = pb.ChatCompletionChoice(
            index=index, finish_reason=finish_reason(result.finish_reason, bool(calls)), message=message
        )
        if plan.logprobs:
            choice.logprobs.CopyFrom(chat_logprobs(result.tokens, result.top_tokens))
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
    """One choice's outputs as chunk choices: the role first, then content or tool-call deltas; the
    final text (stop sequence removed) decides the last delta."""

    index: int
    plan: ChatPlan
    _fed: str = ""
    _started: bool = False
    _tools: ToolCallStream | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0

    def __post_init__(self) -> None:
        if self.plan.tool_calls is not None:
            self._tools = ToolCallStream()

    def choices(self, output: RequestOutput) -> list[pb.ChatCompletionChunkChoice]:
        text = _visible_text(output)
        if output.finished and output.generated_text is not None:
            text = output.generated_text[len(self._fed) :] if output.generated_text.startswith(self._fed) else ""
        self._fed += text
        delta = pb.ChatCompletionDelta()
        if not self._started:
            delta.role, self._started = "assistant", True
        self._add(delta, text)
        choice = pb.ChatCompletionChunkChoice(index=self.index, delta=delta)
        if self.plan.logprobs:
            choice.logprobs.CopyFrom(chat_logprobs(output.tokens, output.top_tokens))
        if output.finish_reason is not None:
            self.num_prompt_tokens, self.num_generated_tokens = output.num_prompt_tokens, output.num_generated_tokens
            called = self._tools is not None and self._tools.mode == "calls"
            choice.finish_reason = finish_reason(output.finish_reason, called)
        elif not text and delta.role == "" and not self.plan.logprobs:
            return []
        return [choice]

    def _add(self, delta: pb.ChatCompletionDelta, text: str) -> None:
        if self._tools is None:
            if text or delta.role:
                delta.content = text
            return
        for item in self._tools.feed(text):
            if item[0] == "content":
                delta.content = delta.content + item[1]
            elif item[0] == "call":
                _, index, call_id, name = item
                delta.tool_calls.append(
                    pb.ToolCall(
                        index=index, id=call_id, type="function", function=pb.FunctionCall(name=name, arguments="")
                    )
                )
            else:
                _, index, piece = item
                delta.tool_calls.append(pb.ToolCall(index=index, function=pb.FunctionCall(arguments=piece)))


# -- text completions ------------------------------------------------------------------------------
def completion_logprobs(
    tokens: Sequence[Token], top_tokens: Sequence[Sequence[Token]], offset: int
) -> pb.CompletionLogprobs:
    """The legacy shape: parallel lists, and `top_logprobs` as one {token: logprob} object each."""
    logprobs = pb.CompletionLogprobs()
    for i, token in enumerate(tokens):
        if token.special:
            continue
        logprobs.tokens.append(token.text)
        logprobs.token_logprobs.append(_logprob(token.logprob))
        logprobs.text_offset.append(offset)
        offset += len(token.text)
        top = logprobs.top_logprobs.add()
        top.update({t.text: _logprob(t.logprob) for t in (top_tokens[i] if i < len(top_tokens) else ())})
    return logprobs


def completion_choice(
    index: int, text: str, result: GenerateResult | RequestOutput, plan: CompletionPlan, echoed: str, offset: int
) -> pb.CompletionChoice:
    """`echoed`: the prompt when this choice's first text is sent with `echo`, else ""; `offset`:
    characters of this choice's text sent before (logprobs' text offsets count the prompt too)."""
    choice = pb.CompletionChoice(index=index, text=echoed + text)
    if result.finish_reason is not None:
        choice.finish_reason = finish_reason(result.finish_reason, False)
    if plan.logprobs is not None:
        choice.logprobs.CopyFrom(completion_logprobs(result.tokens, result.top_tokens, len(echoed) + offset))
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
        if not text and not echoed and output.finish_reason is None:
            return []
        choice = completion_choice(self.index, text, output, self.plan, echoed, len(self._sent))
        self._sent, self._echoed = self._sent + text, True
        if output.finish_reason is not None:
            self.num_prompt_tokens, self.num_generated_tokens = output.num_prompt_tokens, output.num_generated_tokens
        return [choice]
