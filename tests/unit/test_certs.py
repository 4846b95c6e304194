"""`python -m gateway.certs`: what it writes (a CA; a server certificate for the local names and
--host, serverAuth and clientAuth; a client certificate with clientAuth; private keys), and that it
never overwrites certificates unless told. That they work with the TLS flags is shown by the TLS
tests, whose certificates it makes (tests/certs.py)."""

from __future__ import annotations

import ipaddress
import stat
import subprocess
import sys

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway.certs", *args], capture_output=True, text=True, timeout=60)


def _load(path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_a_ca_a_server_and_a_client_certificate(tmp_path):
    result = _run("--out", str(tmp_path), "--host", "gpu-box.internal", "--host", "10.0.0.7")
    assert result.returncode == 0, result.stderr
    assert f"--tls-cert {tmp_path}/server.pem" in result.stdout
    ca, server, client = (_load(tmp_path / f"{name}.pem") for name in ("ca", "server", "client"))
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for leaf in (server, client):
        assert leaf.issuer == ca.subject
        leaf.verify_directly_issued_by(ca)
        assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    usages = {
        name: set(c.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
        for name, c in (("server", server), ("client", client))
    }
    assert usages == {
        "server": {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH},
        "client": {ExtendedKeyUsageOID.CLIENT_AUTH},
    }
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["localhost", "gpu-box.internal"]
    assert names.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address(a) for a in ("127.0.0.1", "::1", "10.0.0.7")
    ]
    for name in ("ca", "server", "client"):
        assert stat.S_IMODE((tmp_path / f"{name}.key").stat().st_mode) == 0o600


def test_it_never_overwrites_without_force(tmp_path):
    assert _run("--out", str(tmp_path)).returncode == 0
    before = (tmp_path / "ca.pem").read_bytes()
    refused = _run("--out", str(tmp_path))
    assert refused.returncode == 2 and "pass --force" in refused.stderr
    assert (tmp_path / "ca.pem").read_bytes() == before
    assert _run("--out", str(tmp_path), "--force").returncode == 0
    assert (tmp_path / "ca.pem").read_bytes() != before
