"""Certificates for TLS tests, made here: a CA, a server certificate for localhost / 127.0.0.1
(usable as a client certificate too, as Envoy presents it to a mutual-TLS engine), a client
certificate, and a stranger's certificate signed by another CA."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path  # signed by a CA the server does not trust
    stranger_key: Path

    def read(self, name: str) -> bytes:
        return getattr(self, name).read_bytes()


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _issue(
    subject: str,
    key,
    issuer_name: x509.Name,
    issuer_key,
    *,
    ca: bool = False,
    sans: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(folder: Path, name: str, certificate: x509.Certificate, key) -> tuple[Path, Path]:
    cert_path, key_path = folder / f"{name}.pem", folder / f"{name}.key"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


def make_certs(folder: Path) -> Certs:
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, other_ca_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _issue("test CA", ca_key, _name("test CA"), ca_key, ca=True)
    ca_path, _ = _write(folder, "ca", ca, ca_key)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = _issue(
        "localhost",
        server_key,
        ca.subject,
        ca_key,
        sans=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    client_key, stranger_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    client = _issue("a client", client_key, ca.subject, ca_key)
    stranger = _issue("a stranger", stranger_key, _name("another CA"), other_ca_key)
    return Certs(
        ca_path,
        *_write(folder, "server", server, server_key),
        *_write(folder, "client", client, client_key),
        *_write(folder, "stranger", stranger, stranger_key),
    )
