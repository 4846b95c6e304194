"""What the gateway reads from the API contract: the REST routes and the descriptor Envoy loads.

The routes come from the `google.api.http` rules of `textgen.v1.TextGeneration` in the committed
descriptor set (`make protos`), so a new binding cannot be served without the gateway knowing how
to shape its response (`KINDS` must name it).

Envoy's transcoder implements `response_body` for `google.api.HttpBody` outputs only and refuses
to start otherwise, so the descriptor handed to it has those `response_body`s removed and the
gateway applies them itself (the Lua filter unwraps the field). Comments (source info) are
dropped too: Envoy does not read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

from google.api import annotations_pb2  # noqa: F401 — registers the google.api.http option
from google.protobuf import descriptor_pb2

SERVICE = "textgen.v1.TextGeneration"
HTTP_BODY = ".google.api.HttpBody"

# How the Lua filter shapes each RPC's response (see gateway/tgi.lua):
#   json    proto3 JSON -> TGI's JSON;  stream  SSE events, errors in-band;
#   health  errors become TGI's 503 "unhealthy";  raw  passed through (Prometheus text);
#   openai  proto3 JSON -> OpenAI's JSON, errors in OpenAI's shape;
#   openai_stream  OpenAI's SSE chunks ending in `data: [DONE]`, errors in OpenAI's shape;
#   anthropic  proto3 JSON -> Anthropic's JSON, errors in Anthropic's shape;
#   anthropic_stream  Anthropic's SSE events (`event: <type>` lines), errors in Anthropic's shape;
#   openai_response  a Responses object (output items' unused fields dropped), errors in OpenAI's shape;
#   openai_response_stream  Responses' typed SSE events (`event: <type>`), no `[DONE]`.
KINDS = {
    "Generate": "json",
    "CompatGenerate": "json",
    "GenerateStream": "stream",
    "Tokenize": "json",
    "Info": "json",
    "Health": "health",
    "Metrics": "raw",
    "OpenApi": "raw",
    "Docs": "raw",
    "ListModels": "json",
    "GetModel": "openai",
    "LoadLoraAdapter": "openai",
    "UnloadLoraAdapter": "openai",
    "ChatCompletion": "openai",
    "ChatCompletionStream": "openai_stream",
    "Completion": "openai",
    "CompletionStream": "openai_stream",
    "Messages": "anthropic",
    "MessagesStream": "anthropic_stream",
    "CountMessageTokens": "anthropic",
    "CreateResponse": "openai_response",
    "CreateResponseStream": "openai_response_stream",
    "GetResponse": "openai_response",
    "DeleteResponse": "openai",
}
STREAM_KINDS = ("stream", "openai_stream", "anthropic_stream", "openai_response_stream")
# Top-level fields TGI prints as null when they have no value (proto3 leaves them out).
NULLS = {"Info": ("model_sha", "model_pipeline_tag", "sha", "docker_label")}


@dataclass(frozen=True)
class RestRoute:
    """One REST binding of an RPC."""

    method: str  # "POST"
    path: str  # "/generate"
    rpc: str  # "Generate"
    kind: str  # see KINDS
    unwrap: str | None = None  # the proto's response_body, applied by the gateway
    nulls: tuple[str, ...] = ()

    @property
    def streams(self) -> bool:
        return self.kind in STREAM_KINDS

    def path_match(self) -> dict[str, str]:
        """Envoy's route match: the exact path, or the prefix before a `{variable}` (`/v1/models/{id=**}`)."""
        if "{" in self.path:
            return {"prefix": self.path.split("{", 1)[0]}
        return {"path": self.path}


def load_descriptor_set() -> descriptor_pb2.FileDescriptorSet:
    """The committed descriptor set (`protos/textgen/textgen.pb`, written by `make protos`)."""
    data = resources.files("textgen").joinpath("textgen.pb").read_bytes()
    return descriptor_pb2.FileDescriptorSet.FromString(data)


def _service(descriptor_set: descriptor_pb2.FileDescriptorSet) -> tuple[str, descriptor_pb2.ServiceDescriptorProto]:
    package, _, name = SERVICE.rpartition(".")
    for file in descriptor_set.file:
        for service in file.service:
            if file.package == package and service.name == name:
                return file.name, service
    raise LookupError(f"{SERVICE} is not in the descriptor set")


def rest_routes(descriptor_set: descriptor_pb2.FileDescriptorSet | None = None) -> list[RestRoute]:
    """The REST routes, in the proto's order."""
    descriptor_set = descriptor_set or load_descriptor_set()
    _, service = _service(descriptor_set)
    routes = []
    for method in service.method:
        rule = method.options.Extensions[annotations_pb2.http]
        pattern = rule.WhichOneof("pattern")
        if pattern is None:
            continue
        if method.name not in KINDS:
            raise LookupError(
                f"{SERVICE}.{method.name} has a REST binding but gateway.contract.KINDS "
                "does not say how to shape its response"
            )
        for binding in (rule, *rule.additional_bindings):
            pattern = binding.WhichOneof("pattern")
            unwrap = binding.response_body if method.output_type != HTTP_BODY and binding.response_body else None
            routes.append(
                RestRoute(
                    method=pattern.upper(),
                    path=getattr(binding, pattern),
                    rpc=method.name,
                    kind=KINDS[method.name],
                    unwrap=unwrap,
                    nulls=NULLS.get(method.name, ()),
                )
            )
    return routes


def envoy_descriptor(descriptor_set: descriptor_pb2.FileDescriptorSet | None = None) -> bytes:
    """The descriptor set as Envoy's transcoder accepts it (see the module docstring)."""
    trimmed = descriptor_pb2.FileDescriptorSet()
    trimmed.CopyFrom(descriptor_set or load_descriptor_set())
    file_name, _ = _service(trimmed)
    for file in trimmed.file:
        file.ClearField("source_code_info")
        if file.name != file_name:
            continue
        for service in file.service:
            for method in service.method:
                rule = method.options.Extensions[annotations_pb2.http]
                if method.output_type != HTTP_BODY and rule.response_body:
                    rule.ClearField("response_body")
    return trimmed.SerializeToString(deterministic=True)
