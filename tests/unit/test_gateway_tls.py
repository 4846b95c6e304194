"""TLS in the rendered Envoy config: the listener (mutual with a client CA, ALPN for gRPC and REST)
and the engine cluster (verified against a CA, or accepted unverified only when no CA is given);
Envoy accepts the configs with real certificate files."""

from __future__ import annotations

import subprocess

import pytest

from gateway.__main__ import main as gateway_main
from gateway.config import GatewayConfig, render
from gateway.tls import TlsFiles
from tests.certs import make_certs


def _parts(config: GatewayConfig) -> tuple[dict, dict]:
    resources = render(config)["static_resources"]
    chain = resources["listeners"][0]["filter_chains"][0]
    cluster = next(c for c in resources["clusters"] if c["name"] == "textgen")
    return chain.get("transport_socket", {}), cluster.get("transport_socket", {})


def test_plaintext_by_default():
    assert _parts(GatewayConfig()) == ({}, {})


def test_mutual_tls_on_the_listener_and_tls_to_the_engine():
    listener, upstream = _parts(
        GatewayConfig(
            listener_tls=TlsFiles("s.pem", "s.key", "ca.pem"), upstream_tls=TlsFiles("s.pem", "s.key", "ca.pem")
        )
    )
    tls = listener["typed_config"]
    assert tls["require_client_certificate"] is True
    assert tls["common_tls_context"]["validation_context"] == {"trusted_ca": {"filename": "ca.pem"}}
    assert tls["common_tls_context"]["alpn_protocols"] == ["h2", "http/1.1"]
    context = upstream["typed_config"]["common_tls_context"]
    assert context["alpn_protocols"] == ["h2"]  # gRPC needs HTTP/2 negotiated
    assert context["validation_context"] == {"trusted_ca": {"filename": "ca.pem"}}
    assert context["tls_certificates"][0]["certificate_chain"] == {"filename": "s.pem"}


def test_without_a_ca_nothing_is_demanded_and_the_engine_is_not_verified():
    listener, upstream = _parts(GatewayConfig(listener_tls=TlsFiles("s.pem", "s.key"), upstream_tls=TlsFiles()))
    assert "require_client_certificate" not in listener["typed_config"]
    context = upstream["typed_config"]["common_tls_context"]
    assert context["validation_context"] == {"trust_chain_verification": "ACCEPT_UNTRUSTED"}
    assert "tls_certificates" not in context


def test_envoy_accepts_tls_configs_with_real_files(tmp_path):
    from gateway.envoy import GatewayError, envoy_binary

    try:
        binary = envoy_binary()
    except GatewayError:
        pytest.skip("envoy is not installed (the gateway extra)")
    certs = make_certs(tmp_path / "certs")
    output = tmp_path / "envoy.yaml"
    assert (
        gateway_main(
            [
                "--tls-cert",
                str(certs.server_cert),
                "--tls-key",
                str(certs.server_key),
                "--tls-client-ca",
                str(certs.ca),
                "--upstream-tls-ca",
                str(certs.ca),
                "--upstream-tls-cert",
                str(certs.client_cert),
                "--upstream-tls-key",
                str(certs.client_key),
                "--output",
                str(output),
            ]
        )
        == 0
    )
    result = subprocess.run(
        [binary, "--mode", "validate", "-c", str(output), "-l", "error"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr
    assert gateway_main(["--tls-cert", str(certs.server_cert)]) == 2  # the key is missing
