"""Channel settings: target, TLS, load balancing, reconnect pacing, keepalive pings.

Targets are gRPC's (`host:port`, `dns:///host:port`, `ipv4:a:p,b:p`, `unix:path`); an
`http://` or `https://` URL, what `text-generation` users pass, is read as host and port, with TLS
for https. A target that can name several servers (a `dns:` name, an address list) balances
calls round-robin over them, so one client spreads load over all replicas behind one name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from urllib.parse import urlsplit

import grpc

_LIST_SCHEMES = ("dns:", "ipv4:", "ipv6:")

# How soon gRPC re-dials a server that refused a connection. Its default starts at 1 s and grows
# to 2 min, longer than the client's own retries would wait for a server that is starting.
RECONNECT_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
)

# Pings while a call is open, so a long silent call (a unary generation answers only at its end)
# finds out when its connection died. The server permits pings every 10 s and more (its
# `inference_service.api.pings`, whose numbers these are; a test checks that they agree): more
# often, and it would close the connection under the call. gRPC stops pinging after 2 pings
# without data unless told otherwise; a long call has no data for minutes.
KEEPALIVE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 0),
)


@dataclass(frozen=True)
class Target:
    """Where calls go: a gRPC target string and whether the connection uses TLS."""

    address: str
    tls: bool
    balanced: bool  # the target may resolve to several servers


def parse_target(target: str) -> Target:
    """Read a gRPC target or an http(s) URL (`https://host` means `host:443` over TLS)."""
    target = target.strip()
    if not target:
        raise ValueError("target is empty: give host:port, dns:///host:port or a URL")
    if target.startswith(("http://", "https://")):
        url = urlsplit(target)
        if not url.hostname:
            raise ValueError(f"no host in {target!r}")
        tls = url.scheme == "https"
        port = url.port or (443 if tls else 80)
        host = f"[{url.hostname}]" if ":" in url.hostname else url.hostname
        return Target(f"{host}:{port}", tls=tls, balanced=False)
    balanced = target.startswith(_LIST_SCHEMES) or "," in target
    return Target(target, tls=False, balanced=balanced)


def channel_options(
    target: Target, load_balancing: str | None, extra: tuple[tuple[str, object], ...] = ()
) -> list[tuple[str, object]]:
    """gRPC channel options: reconnect pacing, keepalive pings, the load-balancing policy, and the
    caller's, which replace ours of the same name (gRPC itself would keep the first of two)."""
    options: dict[str, object] = {**dict(RECONNECT_OPTIONS), **dict(KEEPALIVE_OPTIONS)}
    policy = load_balancing or ("round_robin" if target.balanced else None)
    if policy:
        options["grpc.service_config"] = json.dumps({"loadBalancingConfig": [{policy: {}}]})
    options.update(extra)
    return list(options.items())


def create_channel(
    target: Target, tls: bool, credentials: grpc.ChannelCredentials | None, options: list[tuple[str, object]]
) -> grpc.aio.Channel:
    """A grpc.aio channel; TLS when asked, when the target is https, or when credentials are given."""
    if credentials is None and (tls or target.tls):
        credentials = grpc.ssl_channel_credentials()
    if credentials is not None:
        return grpc.aio.secure_channel(target.address, credentials, options=options)
    return grpc.aio.insecure_channel(target.address, options=options)
