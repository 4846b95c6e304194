"""The engine cluster behind Envoy: its endpoints, how requests are spread over them, how a replica
that is down or draining is taken out, and which requests are retried.

- Endpoints: one per replica port on the upstream host; a host name is resolved by DNS (STRICT_DNS:
  every address it resolves to, e.g. a Kubernetes headless Service's pods).
- Balancing: least request (the replica with fewer requests in flight), or with `routing="prefix"`
  a ring hash of the `x-prefix-hash` header the Lua filter computes from the start of the prompt,
  so a conversation keeps landing where its prefix cache is.
- Health: active gRPC health checks (grpc.health.v1: a loading or draining replica answers
  NOT_SERVING) and outlier detection on the failures Envoy meets itself (a replica that resets or
  refuses connections), never on a gRPC status.
  With most replicas out, Envoy's panic mode tries them all; a replica that can't serve answers
  UNAVAILABLE (loading, draining) and the request is retried on another, so callers see the
  server's own answers (TGI's in-band stream errors included) rather than Envoy's.
- Retries only where no engine accepted the request, each time on another replica (found by
  walking the ring far enough past the replicas already tried, `HOST_SELECTION_ATTEMPTS`), as many
  at once as there are such requests (`MAX_CONCURRENT_RETRIES`): a connection that failed or was
  reset before the request went out, a refused stream, or an engine's own refusal before admission
  (full, loading, draining, its engine core dead), which it marks with `RETRYABLE_KEY`. Never on a
  status alone: an UNAVAILABLE or CANCELLED after admission (a connection closed under a running
  generation, a drain that timed out) would replay work that was done, and a request must run once.
  A stopping replica keeps refusing, marked, until the requests stop coming
  (`inference_service.api.linger`), so none reaches it after its handlers are gone.
"""

from __future__ import annotations

from typing import Any

from gateway.envoy_fields import discovery_type, socket_address, type_url
from inference_service.api.errors import RETRYABLE_KEY

PREFIX_HASH_HEADER = "x-prefix-hash"
ROUTINGS = ("least-request", "prefix")
HEALTH_CHECK_INTERVAL = "1s"
HEALTH_RETRIES = 3  # REST /health tries up to 4 replicas (Envoy's health checks take dead ones out)
HEALTH_TRY_TIMEOUT = "3s"  # a replica that can't answer its health in this long is not serving
# How many ring entries a retry walks past those of replicas already tried (ring hash: each try
# starts at the same entry, so with 3 every retry of a prompt whose next 3 entries belong to the
# dead replica went back to it: a 503 about 1 time in 16 while a healthy replica served).
HOST_SELECTION_ATTEMPTS = 64
# Retries in flight at once over the whole cluster (Envoy's default is 3: with a replica dead, a
# fourth request it refused at the same moment, /health's included, was answered with the refusal, a
# 503 while the other replica served). A retry is of a request no engine admitted, at most
# `num_retries` per request, so it is not capped beyond the requests themselves.
MAX_CONCURRENT_RETRIES = 1_000_000


def engine_cluster(
    name: str, host: str, ports: tuple[int, ...], routing: str, protocol_options: dict[str, Any], limits: dict[str, int]
) -> dict[str, Any]:
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, not {routing!r}")
    endpoints = [{"endpoint": {"address": socket_address(host, port)}} for port in ports]
    return {
        "name": name,
        "type": discovery_type(host),
        "connect_timeout": "5s",
        "lb_policy": "RING_HASH" if routing == "prefix" else "LEAST_REQUEST",
        "typed_extension_protocol_options": protocol_options,
        "circuit_breakers": {"thresholds": [{**limits, "max_retries": MAX_CONCURRENT_RETRIES}]},
        "health_checks": [
            {
                "timeout": "1s",
                "interval": HEALTH_CHECK_INTERVAL,
                "no_traffic_interval": HEALTH_CHECK_INTERVAL,
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                "grpc_health_check": {},
            }
        ],
        "outlier_detection": {
            # Only failures Envoy meets itself (a refused or reset connection: a replica that
            # crashed) eject a replica, for a few seconds. No gRPC status does: a request's own
            # error (INTERNAL) says nothing about the replica, UNAVAILABLE (loading, draining) is
            # retried and seen by the health checks, and DEADLINE_EXCEEDED, which a replica answers
            # when a client's own deadline expires, counts as a gateway failure: three of those
            # ejected a healthy replica.
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 3,
            "enforcing_consecutive_local_origin_failure": 100,
            "enforcing_consecutive_5xx": 0,
            "enforcing_consecutive_gateway_failure": 0,
            "enforcing_success_rate": 0,
            "enforcing_local_origin_success_rate": 0,
            "interval": "2s",
            "base_ejection_time": "5s",
            "max_ejection_percent": 100,
        },
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": endpoints}]},
    }


def retry_policy() -> dict[str, Any]:
    return {
        "retry_on": "connect-failure,reset-before-request,refused-stream,retriable-headers",
        "retriable_headers": [{"name": RETRYABLE_KEY, "string_match": {"exact": "1"}}],
        "num_retries": 2,
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {
                    "@type": type_url("envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate")
                },
            }
        ],
        "host_selection_retry_max_attempts": HOST_SELECTION_ATTEMPTS,
    }


def hash_policy(routing: str) -> list[dict[str, Any]]:
    """What the ring hash keys on (prefix routing only; a request without the header goes anywhere)."""
    return [{"header": {"header_name": PREFIX_HASH_HEADER}}] if routing == "prefix" else []


def health_retry_policy() -> dict[str, Any]:
    """`/health` is 200 while any replica serves: a health call replica A fails in any way (down,
    loading, draining, reset by its death, silent) is tried on B, then C, ... A health call admits
    nothing, so retrying it after a reset is safe, unlike a generation (`retry_policy`)."""
    return {
        "retry_on": "connect-failure,refused-stream,reset,unavailable,cancelled,deadline-exceeded,internal,"
        "resource-exhausted,5xx",
        "num_retries": HEALTH_RETRIES,
        "per_try_timeout": HEALTH_TRY_TIMEOUT,
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {
                    "@type": type_url("envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate")
                },
            }
        ],
        "host_selection_retry_max_attempts": HOST_SELECTION_ATTEMPTS,
        "retry_back_off": {"base_interval": "0.01s", "max_interval": "0.05s"},
    }
