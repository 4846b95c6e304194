"""`python -m gateway`: print Envoy's config for a gRPC server running elsewhere.

    python -m gateway --upstream server.internal:50051 --port 8080 > envoy.yaml
    envoy -c envoy.yaml

With no flags it renders `deploy/envoy/envoy.yaml` (a server on 127.0.0.1:50051); `--output` writes
a file instead of printing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gateway.config import GatewayConfig, render_yaml
from gateway.tls import TlsFiles

DEPLOY_CONFIG_PATH = Path(__file__).resolve().parent.parent / "deploy" / "envoy" / "envoy.yaml"
DEPLOY_CONFIG = GatewayConfig()


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, not {text!r}")
    return host.strip("[]"), int(port)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    defaults = DEPLOY_CONFIG
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--upstream",
        type=_host_port,
        metavar="HOST:PORT",
        default=(defaults.upstream_host, defaults.upstream_port),
        help="the gRPC server (default: %(default)s)",
    )
    parser.add_argument("--hostname", default=defaults.hostname, help="REST address (default: %(default)s)")
    parser.add_argument("--port", type=int, default=defaults.port, help="REST port (default: %(default)s)")
    parser.add_argument(
        "--payload-limit",
        type=int,
        default=defaults.payload_limit,
        help="largest request body in bytes (default: %(default)s)",
    )
    parser.add_argument(
        "--cors-allow-origin", action="append", default=[], help="allowed origin, repeatable (default: any)"
    )
    parser.add_argument(
        "--admin-port",
        type=int,
        default=defaults.admin_port,
        help="Envoy's admin port on 127.0.0.1 (default: %(default)s)",
    )
    parser.add_argument("--otlp-endpoint", help="OTLP/gRPC collector for Envoy's traces (default: no tracing)")
    parser.add_argument(
        "--otlp-service-name",
        default=defaults.otlp_service_name,
        help="service.name of Envoy's spans (default: %(default)s)",
    )
    parser.add_argument("--tls-cert", help="TLS on the listener: certificate chain (PEM path, read by Envoy)")
    parser.add_argument("--tls-key", help="TLS on the listener: its private key")
    parser.add_argument("--tls-client-ca", help="mutual TLS on the listener: callers' certificates must chain to it")
    parser.add_argument("--upstream-tls-ca", help="TLS to the gRPC server, whose certificate must chain to this CA")
    parser.add_argument("--upstream-tls-cert", help="client certificate for a mutual-TLS gRPC server")
    parser.add_argument("--upstream-tls-key", help="its private key")
    parser.add_argument("--output", type=Path, help="write here instead of stdout")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    host, port = args.upstream
    if (args.tls_cert is None) != (args.tls_key is None) or (args.tls_client_ca and not args.tls_cert):
        print(
            "python -m gateway: error: --tls-cert and --tls-key go together (and --tls-client-ca needs them)",
            file=sys.stderr,
        )
        return 2
    listener_tls = TlsFiles(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    upstream_tls = None
    if args.upstream_tls_ca or args.upstream_tls_cert:
        upstream_tls = TlsFiles(args.upstream_tls_cert, args.upstream_tls_key, args.upstream_tls_ca)
    config = GatewayConfig(
        hostname=args.hostname,
        port=args.port,
        upstream_host=host,
        upstream_port=port,
        payload_limit=args.payload_limit,
        cors_allow_origin=tuple(args.cors_allow_origin),
        admin_port=args.admin_port,
        otlp_endpoint=args.otlp_endpoint,
        otlp_service_name=args.otlp_service_name,
        listener_tls=listener_tls,
        upstream_tls=upstream_tls,
    )
    text = render_yaml(config)
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
