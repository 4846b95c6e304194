"""Small pieces every part of Envoy's rendered config spells the same way."""

from __future__ import annotations

import ipaddress
from typing import Any


def type_url(name: str) -> str:
    """The `@type` of a typed config: `type.googleapis.com/<proto message>`."""
    return f"type.googleapis.com/{name}"


def socket_address(host: str, port: int) -> dict[str, Any]:
    address: dict[str, Any] = {"address": host, "port_value": port}
    if host == "::":
        address["ipv4_compat"] = True
    return {"socket_address": address}


def discovery_type(host: str) -> str:
    """A cluster of an IP address is static; of a host name, resolved by DNS (every address it names)."""
    try:
        ipaddress.ip_address(host)
        return "STATIC"
    except ValueError:
        return "STRICT_DNS"
