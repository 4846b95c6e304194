"""HTTP/2 keepalive pings, agreed on both ends of every hop, in one place.

A long request is silent for minutes: a unary generation sends nothing until its answer. The
calling side of each connection pings to learn that the connection still lives, and a gRPC server
polices pings: by grpc's default, a ping less than 5 minutes after the previous one with nothing
sent in between is a strike, and the third strike closes the connection (GOAWAY "too_many_pings"),
failing every call on it. Envoy pinged every 30 s, so every request longer than about two minutes
failed. The engine therefore permits pings three times as often as any of its callers sends them
(margin for Envoy's jitter and for network delays), idle connections included.

Who pings whom:
- Envoy → engine: every `PING_INTERVAL_S`, plus Envoy's jitter (up to 15 % more, never less), on
  every pooled connection, busy or idle (`gateway.config`, replicas and TLS alike).
- typed client → Envoy or engine: every `PING_INTERVAL_S` while a call is open (the client package
  keeps its own copy of these numbers in `textgen_client._channel`; a test checks they agree).
- any client → Envoy: Envoy does not police pings, and its stream timeouts are off (`gateway.config`)
  because a unary request is silent until its answer.
"""

from __future__ import annotations

PING_INTERVAL_S = 30.0  # how often callers ping (Envoy to the engine, the typed client)
PING_TIMEOUT_S = 10.0  # no answer to a ping in this long: the connection is dead
MIN_PING_INTERVAL_S = PING_INTERVAL_S / 3  # the engine takes pings this often without a strike
MAX_PING_STRIKES = 2  # grpc's default: a caller that pings more often than permitted is still cut off


def server_options(min_ping_interval_s: float = MIN_PING_INTERVAL_S) -> list[tuple[str, int]]:
    """The gRPC server's ping policy: pings at least `min_ping_interval_s` apart are welcome, on a
    connection with calls or without (Envoy keeps idle connections pooled and pings them too)."""
    return [
        # GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS: the pings a server receives
        ("grpc.http2.min_ping_interval_without_data_ms", round(min_ping_interval_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES),
    ]
