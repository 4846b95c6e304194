"""Pure conversions between the client's Python values and the protobuf messages.

The only module that touches message fields, so a contract change shows up in one place.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

from google.protobuf import json_format

from textgen_client._proto.textgen.v1 import generate_pb2 as pb
from textgen_client.errors import ValidationError
from textgen_client.types import (
    BestOfSequence,
    Details,
    EngineStats,
    FinishReason,
    Grammar,
    InfoResponse,
    LoraAdapter,
    PrefillToken,
    Response,
    SimpleToken,
    StreamDetails,
    StreamResponse,
    Token,
)

_FINISH_REASONS = {reason.value: reason for reason in FinishReason}


def build_request(prompt: str, parameters: dict[str, Any]) -> pb.GenerateRequest:
    """A `GenerateRequest` with every parameter that is not None.

    `parameters` uses the client's names (`stop_sequences` for the proto's `stop`). A value
    protobuf can't hold (a negative `max_new_tokens`, a str `seed`) raises `ValidationError`
    here, before anything is sent.
    """
    if not isinstance(prompt, str):
        raise ValidationError(
            f"Input validation error: `inputs` must be a str, not {type(prompt).__name__}", "validation"
        )
    message = pb.GenerateParameters()
    for name, value in parameters.items():
        if value is None:
            continue
        try:
            _set_parameter(message, name, value)
        except (TypeError, ValueError) as error:
            raise ValidationError(f"Input validation error: `{name}`={value!r}: {error}", "validation") from None
    return pb.GenerateRequest(inputs=prompt, parameters=message)


def _set_parameter(message: pb.GenerateParameters, name: str, value: Any) -> None:
    if name == "stop_sequences":
        if isinstance(value, str):
            raise TypeError("expected a list of str, not one str")
        message.stop.extend(value)
    elif name == "grammar":
        grammar = value if isinstance(value, Grammar) else Grammar(**value)
        message.grammar.type = str(grammar.type)
        json_format.ParseDict(grammar.value, message.grammar.value)  # a schema dict stays a JSON object
    else:
        setattr(message, name, value)


def _logprob(value: float) -> float | None:
    """NaN is the wire's "no logprob" (the first prompt token)."""
    return None if math.isnan(value) else value


def _finish_reason(value: str) -> FinishReason | str:
    return _FINISH_REASONS.get(value, value)


def _optional(message: Any, field: str) -> Any:
    return getattr(message, field) if message.HasField(field) else None


def token(message: pb.Token) -> Token:
    return Token(id=message.id, text=message.text, logprob=_logprob(message.logprob), special=message.special)


def _tokens(messages: Iterable[pb.Token]) -> list[Token]:
    return [token(m) for m in messages]


def _prefill(messages: Iterable[pb.PrefillToken]) -> list[PrefillToken]:
    return [PrefillToken(id=m.id, text=m.text, logprob=_logprob(m.logprob)) for m in messages]


def _top_tokens(messages: Any) -> list[list[Token]] | None:
    return [_tokens(m.tokens) for m in messages] or None


def _best_of(message: pb.BestOfSequence) -> BestOfSequence:
    return BestOfSequence(
        generated_text=message.generated_text,
        finish_reason=_finish_reason(message.finish_reason),
        generated_tokens=message.generated_tokens,
        seed=_optional(message, "seed"),
        prefill=_prefill(message.prefill),
        tokens=_tokens(message.tokens),
        top_tokens=_top_tokens(message.top_tokens),
    )


def response(message: pb.GenerateResponse) -> Response:
    """`Response` of a `Generate` reply; `details` is None when the server sent none."""
    details = None
    if message.HasField("details"):
        d = message.details
        details = Details(
            finish_reason=_finish_reason(d.finish_reason),
            generated_tokens=d.generated_tokens,
            seed=_optional(d, "seed"),
            prefill=_prefill(d.prefill),
            tokens=_tokens(d.tokens),
            top_tokens=_top_tokens(d.top_tokens),
            best_of_sequences=[_best_of(b) for b in d.best_of_sequences] or None,
        )
    return Response(generated_text=message.generated_text, details=details)


def stream_response(message: pb.StreamResponse) -> StreamResponse:
    """`StreamResponse` of one `GenerateStream` message."""
    details = None
    if message.HasField("details"):
        d = message.details
        details = StreamDetails(
            finish_reason=_finish_reason(d.finish_reason),
            generated_tokens=d.generated_tokens,
            seed=_optional(d, "seed"),
            input_length=d.input_length,
        )
    return StreamResponse(
        index=message.index,
        token=token(message.token),
        top_tokens=_tokens(message.top_tokens) if len(message.top_tokens) else None,
        generated_text=_optional(message, "generated_text"),
        details=details,
    )


def simple_tokens(message: pb.TokenizeResponse) -> list[SimpleToken]:
    return [SimpleToken(id=t.id, text=t.text, start=t.start, stop=t.stop) for t in message.tokens]


_INFO_OPTIONAL = frozenset({"model_sha", "model_pipeline_tag", "sha", "docker_label", "max_batch_size"})


def info(message: pb.InfoResponse) -> InfoResponse:
    """`InfoResponse` of an `Info` reply: every scalar field by name, absent optionals as None."""
    fields: dict[str, Any] = {}
    for field in dataclasses.fields(InfoResponse):
        if field.name in _INFO_OPTIONAL:
            fields[field.name] = _optional(message, field.name)
        elif field.name == "waiting_served_ratio":  # a float32 on the wire: 0.3, not 0.30000001
            fields[field.name] = float(f"{message.waiting_served_ratio:.7g}")
        elif field.name == "lora_adapters":
            fields[field.name] = tuple(LoraAdapter(a.id, a.source, a.rank) for a in message.lora_adapters)
        elif field.name != "stats":
            fields[field.name] = getattr(message, field.name)
    stats = None
    if message.HasField("stats"):
        s = message.stats
        stats = EngineStats(
            num_waiting=s.num_waiting,
            num_running=s.num_running,
            num_free_blocks=s.num_free_blocks,
            num_total_blocks=s.num_total_blocks,
            num_preemptions=s.num_preemptions,
            num_steps=s.num_steps,
        )
    return InfoResponse(**fields, stats=stats)
