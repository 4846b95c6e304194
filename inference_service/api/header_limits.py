"""How large a call's headers (gRPC metadata) may be: on the engine, and on Envoy in front of it.

grpc's defaults refuse metadata over 8 KiB at random and over 16 KiB always (RESOURCE_EXHAUSTED),
while Envoy forwarded headers up to 60 KiB: a REST caller with large headers got 429 (which
clients retry) and a `/health` with them said unhealthy. Now the two agree: the engine accepts
`MAX_METADATA_BYTES`, and Envoy answers 431 to request headers over
`GATEWAY_MAX_REQUEST_HEADERS_KB` (half of it) or `GATEWAY_MAX_HEADERS_COUNT` entries, so what Envoy
adds (x-forwarded-*, x-request-id, traceparent) and grpc's accounting (32 bytes more per entry)
never take a call Envoy forwards over the engine's limit.
"""

from __future__ import annotations

MAX_METADATA_BYTES = 64 * 1024
GATEWAY_MAX_REQUEST_HEADERS_KB = 32
GATEWAY_MAX_HEADERS_COUNT = 100  # Envoy's default
GRPC_BYTES_PER_ENTRY = 32  # what grpc (as HPACK) counts for each entry beside its name and value


def metadata_options() -> list[tuple[str, int]]:
    """The engine's metadata limit, soft and hard alike (no refusals at random in between)."""
    return [("grpc.max_metadata_size", MAX_METADATA_BYTES), ("grpc.absolute_max_metadata_size", MAX_METADATA_BYTES)]
