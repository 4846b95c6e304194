"""What Envoy accepts from callers, so that no caller can hurt another: timeouts, connection and
stream limits, header sizes, and what happens when Envoy is full.

Per connection and request (the listener's connection manager):
- a request's headers must arrive within `request_headers_timeout_s` of its first byte, and its
  whole body within `request_timeout_s`: 408 after, and the connection is closed. A caller that
  sends headers or a body slowly (or never finishes them) holds its connection for seconds, not
  forever;
- a connection with no request in flight is closed after `idle_timeout_s` (a connection that
  sends nothing at all too);
- answers have no timeout: a unary generation is silent until it answers, minutes later, and a
  stream is kept busy by its keep-alive comments; the routes to the engine turn the stream idle
  timeout off (`gateway.config`);
- at most `max_concurrent_streams` requests in flight on one HTTP/2 connection (a gRPC client
  queues the others itself);
- request headers up to `GATEWAY_MAX_REQUEST_HEADERS_KB` and `GATEWAY_MAX_HEADERS_COUNT` entries
  (431 beyond), inside what the engine accepts (`inference_service.api.header_limits`);
- a REST request reaches the engine whole: Envoy buffers its body first (`buffer_filter`), so a
  caller that sends a body slowly holds a connection of Envoy's, never a call of the engine's (2000
  such callers had the engine cancel other people's calls). gRPC callers stream to the engine as
  they send, as they would without Envoy;
- a malformed request or answer on one HTTP/2 stream resets that stream alone, never the
  connection and the other requests on it: toward callers and toward the engine, where every
  replica's requests share one connection per Envoy worker.

Overload: Envoy keeps at most `max_connections` connections open (the overload manager's
downstream connection monitor), a cap below its open-file limit (`connections_within`) so that it
always has descriptors left for the engine, the admin listener and its own files. A connection
over the cap is closed as soon as it is accepted (the caller sees a reset at once, never a hang)
while the connections already open are served; the timeouts above give the slots of idle and slow
callers back. Before, the cap (50,000) was above the descriptor limit: once Envoy ran out of
descriptors, new connections (/health's too) waited in the listen backlog, and requests could not
reach the engine, until the idle connections were closed by their owners.
"""

from __future__ import annotations

from typing import Any

from gateway.envoy_fields import type_url
from inference_service.api.header_limits import GATEWAY_MAX_HEADERS_COUNT, GATEWAY_MAX_REQUEST_HEADERS_KB

# Descriptors Envoy needs besides its callers' connections: listeners, the engine and collector
# connections, health checks, the admin, config and log files, per-worker event loops.
MIN_RESERVED_FILES = 256
BUFFER_FILTER = "envoy.filters.http.buffer"
# The buffer's own limit is above the payload limit, whose 413 the transcoder answers (in JSON).
BUFFER_SLACK_BYTES = 64 * 1024
CONNECTION_MONITOR = "envoy.resource_monitors.global_downstream_max_connections"


def _seconds(value: float) -> str:
    return f"{value:g}s"


def connections_within(open_files: int) -> int:
    """The most callers' connections Envoy can hold with `open_files` descriptors (its `ulimit -n`):
    a tenth (at least `MIN_RESERVED_FILES`) is kept for everything else."""
    reserved = max(MIN_RESERVED_FILES, open_files // 10)
    return max(1, open_files - reserved) if open_files > 2 * reserved else max(1, open_files // 2)


def connection_manager_limits(
    request_headers_timeout_s: float, request_timeout_s: float, idle_timeout_s: float, max_concurrent_streams: int
) -> dict[str, Any]:
    """The listener's connection manager fields for callers' connections and requests."""
    return {
        "request_headers_timeout": _seconds(request_headers_timeout_s),
        "request_timeout": _seconds(request_timeout_s),
        "common_http_protocol_options": {
            "idle_timeout": _seconds(idle_timeout_s),
            "max_headers_count": GATEWAY_MAX_HEADERS_COUNT,
        },
        "max_request_headers_kb": GATEWAY_MAX_REQUEST_HEADERS_KB,
        "http2_protocol_options": {
            "max_concurrent_streams": max_concurrent_streams,
            "override_stream_error_on_invalid_http_message": True,
        },
    }


def buffer_filter(payload_limit: int) -> dict[str, Any]:
    """Whole request bodies before anything goes upstream."""
    return {
        "name": BUFFER_FILTER,
        "typed_config": {
            "@type": type_url("envoy.extensions.filters.http.buffer.v3.Buffer"),
            "max_request_bytes": payload_limit + BUFFER_SLACK_BYTES,
        },
    }


def unbuffered() -> dict[str, Any]:
    """A route's setting that turns the buffer off (gRPC passed through)."""
    return {
        BUFFER_FILTER: {"@type": type_url("envoy.extensions.filters.http.buffer.v3.BufferPerRoute"), "disabled": True}
    }


# Toward the engine: an invalid answer on one stream (headers over Envoy's limits among them)
# resets that stream, not the connection every request to that replica shares.
UPSTREAM_HTTP2_OPTIONS = {"override_stream_error_on_invalid_http_message": True}


def overload_manager(max_connections: int) -> dict[str, Any]:
    """Envoy's cap on callers' connections, over all listeners and workers."""
    return {
        "resource_monitors": [
            {
                "name": CONNECTION_MONITOR,
                "typed_config": {
                    "@type": type_url(
                        "envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig"
                    ),
                    "max_active_downstream_connections": max_connections,
                },
            }
        ]
    }
