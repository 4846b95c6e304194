"""W3C trace context of the caller's current OpenTelemetry span, as call metadata.

OpenTelemetry is optional (the `otel` extra): without it, or with no span active, nothing is
added. It is imported on the first call rather than with the client, which keeps
`import textgen_client` fast. The globally configured propagator writes the headers (by default
`traceparent`, plus `tracestate` and `baggage` when they have content).
"""

from __future__ import annotations

from collections.abc import Callable

_inject: Callable[[dict[str, str]], None] | None = None
_loaded = False


def _load() -> Callable[[dict[str, str]], None] | None:
    global _inject, _loaded
    if not _loaded:
        try:
            from opentelemetry import propagate
        except ImportError:
            _inject = None
        else:
            _inject = propagate.inject
        _loaded = True
    return _inject


def trace_metadata() -> list[tuple[str, str]]:
    """Metadata pairs carrying the current trace context; empty when there is none."""
    inject = _load()
    if inject is None:
        return []
    carrier: dict[str, str] = {}
    inject(carrier)
    return [(key.lower(), value) for key, value in carrier.items()]
