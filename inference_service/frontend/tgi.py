"""TGI's requests (`Generate`, `GenerateStream`, `CompatGenerate`) → the front end's `GenerateRequest`.

Each field is copied explicitly; a proto3 `optional` field that is absent becomes None, and
`validation` applies TGI's rules and defaults to it (`defaults` has the table).
"""

from __future__ import annotations

from google.protobuf import json_format

from inference_service.frontend.parameters import GenerateParameters, GenerateRequest
from inference_service.frontend.plain_json import plain_json
from textgen.v1 import generate_pb2 as pb


def is_compat_route(request: pb.GenerateRequest) -> bool:
    """TGI's root route `/` is the only one whose body may carry `stream` (the gateway maps it to
    CompatGenerate or GenerateStream)."""
    return request.HasField("stream")


def request_from_pb(
    request: pb.GenerateRequest, *, compat_route: bool = False, pipeline_tag: str | None = None
) -> GenerateRequest:
    """An absent `parameters` is all defaults (validation documents why it doesn't sample then)."""
    compat_route = compat_route or is_compat_route(request)
    return GenerateRequest(
        inputs=request.inputs,
        parameters=parameters_from_pb(request.parameters, compat_route=compat_route, pipeline_tag=pipeline_tag),
    )


def parameters_from_pb(
    message: pb.GenerateParameters, *, compat_route: bool = False, pipeline_tag: str | None = None
) -> GenerateParameters:
    """On the compat route `return_full_text` defaults to true for a `text-generation` model or one
    whose pipeline tag is unknown (TGI's rule); an encoder-decoder's `text2text-generation` says false."""
    return_full_text = message.return_full_text if message.HasField("return_full_text") else None
    if compat_route and return_full_text is None:
        return_full_text = pipeline_tag in (None, "text-generation")
    grammar = None
    if message.HasField("grammar"):
        grammar = {"type": message.grammar.type, "value": plain_json(json_format.MessageToDict(message.grammar.value))}
    return GenerateParameters(
        best_of=message.best_of if message.HasField("best_of") else None,
        temperature=message.temperature if message.HasField("temperature") else None,
        repetition_penalty=message.repetition_penalty if message.HasField("repetition_penalty") else None,
        frequency_penalty=message.frequency_penalty if message.HasField("frequency_penalty") else None,
        top_k=message.top_k if message.HasField("top_k") else None,
        top_p=message.top_p if message.HasField("top_p") else None,
        typical_p=message.typical_p if message.HasField("typical_p") else None,
        do_sample=message.do_sample,
        max_new_tokens=message.max_new_tokens if message.HasField("max_new_tokens") else None,
        return_full_text=return_full_text,
        stop=list(message.stop),
        truncate=message.truncate if message.HasField("truncate") else None,
        watermark=message.watermark,
        details=message.details,
        decoder_input_details=message.decoder_input_details,
        seed=message.seed if message.HasField("seed") else None,
        top_n_tokens=message.top_n_tokens if message.HasField("top_n_tokens") else None,
        grammar=grammar,
        adapter_id=message.adapter_id if message.HasField("adapter_id") else None,
        forced_bos_token=message.forced_bos_token if message.HasField("forced_bos_token") else None,
    )


def wants_details(request: pb.GenerateRequest) -> bool:
    return request.parameters.details or request.parameters.decoder_input_details
