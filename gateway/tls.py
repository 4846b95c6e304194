"""TLS in Envoy's config: on the REST/gRPC listener (callers to Envoy) and on the engine cluster
(Envoy to the engine), from PEM files that Envoy reads itself (nothing secret is inlined).

- Listener: the certificate and key; with a CA, mutual TLS (callers must present a certificate it
  signed). ALPN offers h2 and http/1.1, so gRPC and REST callers share the port.
- Engine: Envoy speaks TLS (ALPN h2, as gRPC requires), verifies the engine's certificate against
  a CA when one is given, and presents a client certificate when the engine demands mutual TLS.
  Without a CA it accepts the engine's certificate unverified: only for the launcher's own hop over
  loopback to the engine process it started.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.envoy_fields import type_url

TLS_SOCKET = "envoy.transport_sockets.tls"


@dataclass(frozen=True)
class TlsFiles:
    cert: str | None = None  # PEM certificate chain (Envoy's own, or its client certificate upstream)
    key: str | None = None
    ca: str | None = None  # listener: clients must be signed by it; upstream: the engine must be


def _certificates(files: TlsFiles) -> list[dict[str, Any]]:
    if files.cert is None:
        return []
    return [{"certificate_chain": {"filename": files.cert}, "private_key": {"filename": files.key}}]


def listener_tls(files: TlsFiles) -> dict[str, Any]:
    if files.cert is None or files.key is None:
        raise ValueError("TLS on the listener needs a certificate and its key")
    context: dict[str, Any] = {"alpn_protocols": ["h2", "http/1.1"], "tls_certificates": _certificates(files)}
    tls: dict[str, Any] = {
        "@type": type_url("envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext"),
        "common_tls_context": context,
    }
    if files.ca:
        context["validation_context"] = {"trusted_ca": {"filename": files.ca}}
        tls["require_client_certificate"] = True
    return {"name": TLS_SOCKET, "typed_config": tls}


def upstream_tls(files: TlsFiles) -> dict[str, Any]:
    validation = (
        {"trusted_ca": {"filename": files.ca}} if files.ca else {"trust_chain_verification": "ACCEPT_UNTRUSTED"}
    )
    context: dict[str, Any] = {"alpn_protocols": ["h2"], "validation_context": validation}
    if files.cert:
        context["tls_certificates"] = _certificates(files)
    return {
        "name": TLS_SOCKET,
        "typed_config": {
            "@type": type_url("envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"),
            "common_tls_context": context,
        },
    }
