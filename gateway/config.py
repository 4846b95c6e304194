"""Envoy's bootstrap config for the REST gateway, rendered from the server's own flags.

One function renders both the config `inference-service launch` runs and the standalone
`deploy/envoy/envoy.yaml`, so the two cannot drift apart. The config is self-contained: the
descriptor set and the Lua filter are inlined.

Filter chain (requests go down, responses come back up):
  cors -> buffer (whole REST bodies first, gateway/limits.py) -> lua (TGI shapes, gateway/tgi.lua)
  -> grpc_json_transcoder (REST <-> gRPC, payload limit: 413) -> router

With `otlp_endpoint`, Envoy traces too (its OpenTelemetry tracer, OTLP/gRPC to the same collector
as the server): one span per REST request, named "<METHOD> <path>", continuing the caller's W3C
`traceparent`; the router forwards its own `traceparent` upstream, so the server's gRPC span is
its child.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from importlib import resources
from typing import Any

from gateway import yaml_text
from gateway.contract import KINDS, SERVICE, RestRoute, envoy_descriptor, rest_routes
from gateway.envoy_fields import discovery_type, socket_address, type_url
from gateway.limits import (
    UPSTREAM_HTTP2_OPTIONS,
    buffer_filter,
    connection_manager_limits,
    overload_manager,
    unbuffered,
)
from gateway.tls import TlsFiles, listener_tls, upstream_tls
from gateway.upstream import ROUTINGS, engine_cluster, hash_policy, health_retry_policy, retry_policy
from inference_service.api import pings
from inference_service.api.errors import RETRYABLE_KEY
from inference_service.api.header_limits import GATEWAY_MAX_HEADERS_COUNT, GATEWAY_MAX_REQUEST_HEADERS_KB
from inference_service.observability.tracing import otlp_target

LUA_FILTER = "envoy.filters.http.lua"
CORS_FILTER = "envoy.filters.http.cors"
CLUSTER = "textgen"
COLLECTOR_CLUSTER = "opentelemetry_collector"
UNTRACED_RPCS = ("Health", "Metrics")  # probes and scrapes would flood the trace store
# The servicer answers GenerateStream errors as a last message instead of a status when this is set.
INBAND_ERRORS_HEADER = "x-textgen-inband-errors"
# ...and sends a heartbeat after this many idle seconds, which the Lua filter writes as TGI's SSE
# keep-alive comment (TGI: 15 s).
KEEPALIVE_HEADER = "x-textgen-keepalive-s"
# Concurrency is the server's business (--max-concurrent-requests, 429): Envoy must not cap it.
UNLIMITED = 1_000_000
# A whole unary answer is buffered (transcoder, Lua): /generate with every detail of a long
# generation is megabytes. This is a ceiling, not an allocation.
RESPONSE_BUFFER_LIMIT = 64 * 2**20


@dataclass(frozen=True)
class GatewayConfig:
    """Where Envoy listens and which gRPC server it fronts."""

    hostname: str = "0.0.0.0"
    port: int = 8080
    upstream_host: str = "127.0.0.1"
    upstream_port: int = 50051
    # Replicas on upstream_host (launch --num-replicas); empty: upstream_port alone.
    upstream_ports: tuple[int, ...] = ()
    routing: str = "least-request"  # or "prefix": ring hash on the prompt's start (gateway/upstream.py)
    listener_tls: TlsFiles | None = None  # TLS for callers (gateway/tls.py); None: plaintext
    upstream_tls: TlsFiles | None = None  # TLS to the engine; None: plaintext
    payload_limit: int = 2_000_000  # bytes of a request body (TGI's --payload-limit)
    cors_allow_origin: tuple[str, ...] = ()  # empty: any origin, as TGI
    admin_host: str = "127.0.0.1"
    admin_port: int | None = 9901  # None: no admin listener; 0: any free port
    otlp_endpoint: str | None = None  # OTLP/gRPC collector for Envoy's spans; None: no tracing
    otlp_service_name: str = "inference-service-gateway"
    sse_keepalive_s: float = 15.0  # idle seconds before an SSE stream gets a `:` comment (TGI's)
    # What one caller may hold (gateway/limits.py). `max_connections` is the cap over all callers;
    # the launcher lowers it to what Envoy's open-file limit allows (`gateway.envoy`).
    max_connections: int = 50_000
    request_headers_timeout_s: float = 10.0
    request_timeout_s: float = 60.0  # to receive a whole request; answers take as long as they take
    idle_timeout_s: float = 60.0
    max_concurrent_streams: int = 256  # per HTTP/2 connection
    # How often Envoy pings the engine; the engine permits it (`inference_service.api.pings`).
    upstream_ping_interval_s: float = pings.PING_INTERVAL_S

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("--port must be in [0, 65535]")
        if not all(0 < port <= 65535 for port in self.ports):
            raise ValueError("the gRPC port must be in [1, 65535]")
        if self.routing not in ROUTINGS:
            raise ValueError(f"--routing must be one of {', '.join(ROUTINGS)}, not {self.routing!r}")
        if self.payload_limit <= 0:
            raise ValueError("--payload-limit must be > 0")
        if self.otlp_endpoint:
            otlp_target(self.otlp_endpoint)
        if self.sse_keepalive_s <= 0:
            raise ValueError("the SSE keep-alive interval must be > 0")
        if self.max_connections < 1 or self.max_concurrent_streams < 1:
            raise ValueError("the connection and stream limits must be >= 1")
        if min(self.request_headers_timeout_s, self.request_timeout_s, self.idle_timeout_s) <= 0:
            raise ValueError("the request and idle timeouts must be > 0")
        if self.upstream_ping_interval_s <= 0:
            raise ValueError("the upstream ping interval must be > 0")

    @property
    def ports(self) -> tuple[int, ...]:
        """The engine ports Envoy balances over."""
        return self.upstream_ports or (self.upstream_port,)


def _lua_metadata(route: RestRoute) -> dict[str, Any]:
    values: dict[str, Any] = {"kind": route.kind}
    if route.unwrap:
        values["unwrap"] = route.unwrap
    if route.nulls:
        values["nulls"] = ",".join(route.nulls)
    return {"filter_metadata": {LUA_FILTER: values}}


def _header(key: str, value: str) -> dict[str, Any]:
    return {"header": {"key": key, "value": value}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}


def _upstream(routing: str) -> dict[str, Any]:
    """Where a route goes: the engine cluster, no timeouts (generation may take minutes and streams
    idle while queued), safe retries, and the prefix hash with prefix routing."""
    target: dict[str, Any] = {"cluster": CLUSTER, "timeout": "0s", "idle_timeout": "0s", "retry_policy": retry_policy()}
    if hash_policy(routing):
        target["hash_policy"] = hash_policy(routing)
    return target


def _route(route: RestRoute, keepalive_s: float, routing: str) -> dict[str, Any]:
    rendered: dict[str, Any] = {
        "name": route.rpc,
        "match": {**route.path_match(), "headers": [{"name": ":method", "string_match": {"exact": route.method}}]},
        "route": _upstream(routing),
        "metadata": _lua_metadata(route),
    }
    if route.kind == "health":  # 200 while any replica serves
        rendered["route"]["retry_policy"] = health_retry_policy()
    if route.streams:
        rendered["request_headers_to_add"] = [
            _header(INBAND_ERRORS_HEADER, "1"),
            _header(KEEPALIVE_HEADER, f"{keepalive_s:g}"),
        ]
        rendered["response_headers_to_add"] = [_header("cache-control", "no-cache"), _header("x-accel-buffering", "no")]
    return rendered


def _routes(
    routes: list[RestRoute], keepalive_s: float, traced: bool = False, routing: str = "least-request"
) -> list[dict[str, Any]]:
    rendered = [_route(route, keepalive_s, routing) for route in routes]
    if traced:  # span names as OpenTelemetry's HTTP conventions have them; not sent upstream
        for route, entry in zip(routes, rendered, strict=True):
            entry["decorator"] = {"operation": f"{route.method} {route.path}", "propagate": False}
            if route.rpc in UNTRACED_RPCS:
                entry["tracing"] = {"overall_sampling": {"numerator": 0}}
    # CORS preflights: the cors filter answers allowed ones, the Lua filter the others (200, no CORS
    # headers, as TGI). The filter needs a route that has a cluster to apply the policy.
    rendered.append(
        {
            "name": "preflight",
            "match": {"prefix": "/", "headers": [{"name": ":method", "string_match": {"exact": "OPTIONS"}}]},
            "route": {"cluster": CLUSTER},
        }
    )
    # gRPC callers reach the replicas through the same port (the transcoder passes gRPC through).
    grpc = {"name": "grpc", "match": {"prefix": "/", "grpc": {}}, "route": _upstream(routing)}
    rendered.append({**grpc, "typed_per_filter_config": unbuffered()})
    # GET / and /ping are TGI's health aliases: the Lua filter rewrites them to /health.
    for route in {route.path: route for route in routes}.values():
        rendered.append(
            {
                "name": f"method-not-allowed {route.path}",
                "match": route.path_match(),
                "direct_response": {"status": 405, "body": {"inline_string": "Method Not Allowed"}},
            }
        )
    rendered.append(
        {
            "name": "not-found",
            "match": {"prefix": "/"},
            "direct_response": {"status": 404, "body": {"inline_string": "Not Found"}},
        }
    )
    return rendered


def _cors(origins: tuple[str, ...]) -> dict[str, Any]:
    """TGI's CORS: GET and POST, the content-type header, the given origins or any."""
    matches = [{"exact": origin} for origin in origins] or [{"safe_regex": {"regex": ".*"}}]
    return {
        "@type": type_url("envoy.extensions.filters.http.cors.v3.CorsPolicy"),
        "allow_origin_string_match": matches,
        "allow_methods": "GET, POST",
        "allow_headers": "content-type",
    }


# Envoy's own replies (no route, too large, unparsable JSON, server unreachable) as TGI's error JSON.
_LOCAL_REPLY_TYPES = (
    (400, "validation", "Failed to parse the request body as JSON: %LOCAL_REPLY_BODY%"),
    (404, "not_found", "%LOCAL_REPLY_BODY%"),
    (405, "method_not_allowed", "%LOCAL_REPLY_BODY%"),
    (408, "request_timeout", "Request Timeout: the request did not arrive in time"),
    (413, "payload_too_large", "Payload Too Large: the request body is larger than {limit} bytes"),
    (
        431,
        "validation",
        "Request Header Fields Too Large: the request headers are larger than {headers_kb} KiB "
        "or more than {headers_count} headers",
    ),
    (503, "unavailable", "The inference server is unreachable: %LOCAL_REPLY_BODY%"),
)


# ...and on OpenAI's routes in OpenAI's error shape. By the time the transcoder fails to parse a body
# it has rewritten `:path` to the gRPC method, so both forms are matched.
OPENAI_PATHS = (
    r"^(/v1/.*|/"
    + SERVICE.replace(".", r"\.")
    + "/("
    # Only routes with a body can fail to parse; stream RPCs folded: RE2 refuses a program past
    # Envoy's size limit.
    + "|".join(
        sorted(
            {
                # the LoRA adapter routes (vLLM's) folded into one pattern, for the same reason
                "[A-Za-z]+LoraAdapter" if r.rpc.endswith("LoraAdapter") else r.rpc.removesuffix("Stream")
                for r in rest_routes()
                if r.kind.startswith("openai") and r.method == "POST"
            }
        )
    )
    + ")(Stream)?)$"
)


# ...and on Anthropic's routes in Anthropic's (matched first: their paths are under /v1/ too).
ANTHROPIC_PATHS = (
    r"^(/v1/messages(/.*)?|/"
    + SERVICE.replace(".", r"\.")
    + "/("
    + "|".join(sorted(rpc for rpc, kind in KINDS.items() if kind.startswith("anthropic")))
    + "))$"
)
ANTHROPIC_ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large"}


def _error_text(error: str, payload_limit: int) -> str:
    return error.format(
        limit=payload_limit, headers_kb=GATEWAY_MAX_REQUEST_HEADERS_KB, headers_count=GATEWAY_MAX_HEADERS_COUNT
    )


def _local_reply_config(payload_limit: int) -> dict[str, Any]:
    def json_body(error: str, error_type: str) -> dict[str, Any]:
        return {"json_format": {"error": error, "error_type": error_type}}

    def openai_body(error: str, error_type: str, status: int) -> dict[str, Any]:
        kind = "server_error" if status >= 500 else "invalid_request_error"
        return {"json_format": {"error": {"message": error, "type": kind, "param": None, "code": error_type}}}

    def status_filter(status: int) -> dict[str, Any]:
        return {
            "status_code_filter": {
                "comparison": {
                    "op": "EQ",
                    "value": {"default_value": status, "runtime_key": f"gateway.local_reply.{status}"},
                }
            }
        }

    def anthropic_body(error: str, status: int) -> dict[str, Any]:
        kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return {"json_format": {"type": "error", "error": {"type": kind, "message": error}}}

    def path_filter(regex: str) -> dict[str, Any]:
        return {"header_filter": {"header": {"name": ":path", "string_match": {"safe_regex": {"regex": regex}}}}}

    path_regex = {"safe_regex": {"regex": OPENAI_PATHS}}
    openai_path = {"header_filter": {"header": {"name": ":path", "string_match": path_regex}}}
    # Envoy's 503 when no engine could be reached (UF) or none is healthy (UH): no engine saw the
    # request, so it carries the engine's retry marker, for callers' own retries.
    unsent = {"response_flag_filter": {"flags": ["UF", "UH"]}}

    def mapper(filters: list[dict[str, Any]], body: dict[str, Any], marked: bool = False) -> dict[str, Any]:
        entry = {
            "filter": filters[0] if len(filters) == 1 else {"and_filter": {"filters": filters}},
            "body_format_override": body,
        }
        if marked:
            entry["headers_to_add"] = [_header(RETRYABLE_KEY, "1")]
        return entry

    mappers = []
    for on_path, body in (
        ([path_filter(ANTHROPIC_PATHS)], lambda error, error_type, status: anthropic_body(error, status)),
        ([openai_path], openai_body),
        ([], lambda error, error_type, status: json_body(error, error_type)),
    ):
        for status, error_type, error in _LOCAL_REPLY_TYPES:
            text = body(_error_text(error, payload_limit), error_type, status)
            if status == 503:
                mappers.append(mapper([status_filter(status), unsent, *on_path], text, marked=True))
            mappers.append(mapper([status_filter(status), *on_path], text))
    return {"mappers": mappers, "body_format": json_body("%LOCAL_REPLY_BODY%", "gateway")}


def _http_filters(descriptor: bytes, payload_limit: int, lua_source: str) -> list[dict[str, Any]]:
    return [
        {"name": CORS_FILTER, "typed_config": {"@type": type_url("envoy.extensions.filters.http.cors.v3.Cors")}},
        buffer_filter(payload_limit),  # gateway/limits.py
        {
            "name": LUA_FILTER,
            "typed_config": {
                "@type": type_url("envoy.extensions.filters.http.lua.v3.Lua"),
                "default_source_code": {"inline_string": lua_source},
            },
        },
        {
            "name": "envoy.filters.http.grpc_json_transcoder",
            "typed_config": {
                "@type": type_url("envoy.extensions.filters.http.grpc_json_transcoder.v3.GrpcJsonTranscoder"),
                "proto_descriptor_bin": base64.b64encode(descriptor).decode("ascii"),
                "services": [SERVICE],
                # Route on the REST path (the routes above), not on the gRPC path it becomes.
                "match_incoming_request_route": True,
                "ignore_unknown_query_parameters": True,
                # Path variables fully decoded (`%2F` and `%25` too): a model id reaches the server as named.
                "url_unescape_spec": "ALL_CHARACTERS",
                # The payload limit (413); answers get the buffer they need (see RESPONSE_BUFFER_LIMIT).
                "max_request_body_size": payload_limit,
                "max_response_body_size": RESPONSE_BUFFER_LIMIT,
                "print_options": {
                    "preserve_proto_field_names": True,
                    "always_print_primitive_fields": True,
                    "stream_sse_style_delimited": True,
                },
            },
        },
        {
            "name": "envoy.filters.http.router",
            "typed_config": {
                "@type": type_url("envoy.extensions.filters.http.router.v3.Router"),
                "suppress_envoy_headers": True,
            },
        },
    ]


def _listener(config: GatewayConfig, routes: list[RestRoute], descriptor: bytes, lua_source: str) -> dict[str, Any]:
    manager = {
        "@type": type_url("envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"),
        "stat_prefix": "rest",
        "codec_type": "AUTO",
        "server_name": "inference-service",
        # Off: a unary request sends nothing until its answer, minutes later; any idle timeout would
        # cut long generations (routes have no timeouts either, see `_upstream`).
        "stream_idle_timeout": "0s",
        "local_reply_config": _local_reply_config(config.payload_limit),
        "route_config": {
            "name": "rest",
            "virtual_hosts": [
                {
                    "name": "tgi",
                    "domains": ["*"],
                    "routes": _routes(
                        routes, config.sse_keepalive_s, traced=bool(config.otlp_endpoint), routing=config.routing
                    ),
                    "typed_per_filter_config": {CORS_FILTER: _cors(config.cors_allow_origin)},
                }
            ],
        },
        "http_filters": _http_filters(descriptor, config.payload_limit, lua_source),
    }
    manager.update(
        connection_manager_limits(
            config.request_headers_timeout_s,
            config.request_timeout_s,
            config.idle_timeout_s,
            config.max_concurrent_streams,
        )
    )
    if config.otlp_endpoint:
        manager["tracing"] = _tracing(config)
    chain: dict[str, Any] = {
        "filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]
    }
    if config.listener_tls is not None:
        chain["transport_socket"] = listener_tls(config.listener_tls)
    return {
        "name": "rest",
        "address": socket_address(config.hostname, config.port),
        "per_connection_buffer_limit_bytes": max(RESPONSE_BUFFER_LIMIT, config.payload_limit),
        "filter_chains": [chain],
    }


def _seconds(value: float) -> str:
    return f"{value:.3f}".rstrip("0").rstrip(".") + "s"


def _keepalive(config: GatewayConfig) -> dict[str, Any]:
    """Envoy's pings to the engine, which the engine permits (`inference_service.api.pings`): without
    them a dead engine host would hold a silent unary request forever."""
    return {"interval": _seconds(config.upstream_ping_interval_s), "timeout": _seconds(pings.PING_TIMEOUT_S)}


def _cluster(config: GatewayConfig) -> dict[str, Any]:
    limits = {key: UNLIMITED for key in ("max_connections", "max_pending_requests", "max_requests")}
    protocol = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": type_url("envoy.extensions.upstreams.http.v3.HttpProtocolOptions"),
            "explicit_http_config": {"http2_protocol_options": {"connection_keepalive": _keepalive(config)}},
        }
    }
    options = protocol["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["explicit_http_config"]
    options["http2_protocol_options"].update(UPSTREAM_HTTP2_OPTIONS)
    cluster = engine_cluster(CLUSTER, config.upstream_host, config.ports, config.routing, protocol, limits)
    if config.upstream_tls is not None:
        cluster["transport_socket"] = upstream_tls(config.upstream_tls)
    return cluster


def _tracing(config: GatewayConfig) -> dict[str, Any]:
    """Envoy's OpenTelemetry tracer; sampling is Envoy's default (every request), and a caller's
    sampled flag in `traceparent` is kept."""
    return {
        "provider": {
            "name": "envoy.tracers.opentelemetry",
            "typed_config": {
                "@type": type_url("envoy.config.trace.v3.OpenTelemetryConfig"),
                "grpc_service": {"envoy_grpc": {"cluster_name": COLLECTOR_CLUSTER}, "timeout": "5s"},
                "service_name": config.otlp_service_name,
            },
        }
    }


def _collector_cluster(endpoint: str) -> dict[str, Any]:
    host, port, tls = otlp_target(endpoint)
    discovery = discovery_type(host)
    endpoint_address = {"endpoint": {"address": socket_address(host, port)}}
    cluster: dict[str, Any] = {
        "name": COLLECTOR_CLUSTER,
        "type": discovery,
        "connect_timeout": "5s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": type_url("envoy.extensions.upstreams.http.v3.HttpProtocolOptions"),
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {"cluster_name": COLLECTOR_CLUSTER, "endpoints": [{"lb_endpoints": [endpoint_address]}]},
    }
    if tls:
        cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": type_url("envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"),
                "sni": host,
            },
        }
    return cluster


def lua_source(routing: str = "least-request") -> str:
    source = resources.files("gateway").joinpath("tgi.lua").read_text(encoding="utf-8")
    return f"PREFIX_ROUTING = true\n{source}" if routing == "prefix" else source


def render(config: GatewayConfig) -> dict[str, Any]:
    """Envoy's bootstrap config (a dict ready for YAML or JSON)."""
    bootstrap: dict[str, Any] = {}
    if config.admin_port is not None:
        bootstrap["admin"] = {"address": socket_address(config.admin_host, config.admin_port)}
    bootstrap["static_resources"] = {
        "listeners": [_listener(config, rest_routes(), envoy_descriptor(), lua_source(config.routing))],
        "clusters": [_cluster(config)] + ([_collector_cluster(config.otlp_endpoint)] if config.otlp_endpoint else []),
    }
    bootstrap["overload_manager"] = overload_manager(config.max_connections)
    return bootstrap


HEADER = (
    "# Envoy config of the inference-service REST gateway (TGI's REST API over textgen.v1 gRPC).\n"
    "# Rendered by gateway/config.py: `python -m gateway --help`; edit the code, not this file.\n"
    "# Run Envoy with `ulimit -n` above max_active_downstream_connections (gateway/limits.py).\n"
)


def render_yaml(config: GatewayConfig) -> str:
    return HEADER + yaml_text.dump(render(config))
