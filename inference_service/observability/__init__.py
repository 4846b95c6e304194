"""Traces (OpenTelemetry), metrics (Prometheus, TGI's names) and request logs.

Kept import-light: `cli` and `api.config` import parts of it before any flag is parsed, so the
heavier modules load only when a server is built (`hub.Observability`).
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "Observability":
        from inference_service.observability.hub import Observability

        return Observability
    raise AttributeError(name)
