"""`python -m gateway.certs --out DIR`: a private CA and the certificates the TLS flags take, for
tests and trials on one machine (not for production: the CA's key lies beside them).

Written into DIR (keys readable by their owner only):
- `ca.pem`, `ca.key`: the CA; `--tls-client-ca ca.pem`, and what callers trust (`curl --cacert`).
- `server.pem`, `server.key`: `--tls-cert` / `--tls-key`, for localhost, 127.0.0.1, ::1 and every
  `--host`; usable for clientAuth too, as `launch`'s Envoy presents it to a mutual-TLS engine.
- `client.pem`, `client.key`: a client certificate (extended key usage clientAuth) for mutual TLS.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
DEFAULT_DAYS = 30
NAMES = ("ca", "server", "client")


@dataclass(frozen=True)
class CertFiles:
    folder: Path

    def cert(self, name: str) -> Path:
        return self.folder / f"{name}.pem"

    def key(self, name: str) -> Path:
        return self.folder / f"{name}.key"

    @property
    def ca(self) -> Path:
        return self.cert("ca")


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def issue(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    days: int,
    *,
    ca: bool = False,
    usages: tuple[x509.ObjectIdentifier, ...] = (),
    hosts: tuple[str, ...] = (),
) -> x509.Certificate:
    """A certificate for `key`, signed by `issuer_key`; a CA's, or a leaf with these extended key
    usages and subject alternative names (DNS names, or IP addresses where they parse as one)."""
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # a little clock skew
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        signs_only = dict.fromkeys(("content_commitment", "key_encipherment", "data_encipherment"), False)
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
                **signs_only,
            ),
            critical=True,
        )
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
    if hosts:
        builder = builder.add_extension(x509.SubjectAlternativeName([_general_name(h) for h in hosts]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def write(folder: Path, stem: str, certificate: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
    (folder / f"{stem}.pem").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_bytes = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    descriptor = os.open(folder / f"{stem}.key", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(key_bytes)


def make_certs(folder: Path, hosts: tuple[str, ...] = (), days: int = DEFAULT_DAYS) -> CertFiles:
    """A CA, a server certificate for the local names and `hosts`, and a client certificate, in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, server_key, client_key = new_key(), new_key(), new_key()
    ca = issue("inference-service test CA", ca_key, name("inference-service test CA"), ca_key, days, ca=True)
    server_hosts = tuple(dict.fromkeys((*LOCAL_HOSTS, *hosts)))
    server = issue(
        (hosts or LOCAL_HOSTS)[0],
        server_key,
        ca.subject,
        ca_key,
        days,
        usages=(ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH),
        hosts=server_hosts,
    )
    client = issue(
        "inference-service client", client_key, ca.subject, ca_key, days, usages=(ExtendedKeyUsageOID.CLIENT_AUTH,)
    )
    write(folder, "ca", ca, ca_key)
    write(folder, "server", server, server_key)
    write(folder, "client", client, client_key)
    return CertFiles(folder)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.certs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder to write into (created if missing)")
    parser.add_argument(
        "--host",
        action="append",
        default=[],
        help="another DNS name or IP address of the server (repeatable); localhost, 127.0.0.1 and ::1 are always in",
    )
    parser.add_argument("--days", type=int, default=DEFAULT_DAYS, help=f"validity (default: {DEFAULT_DAYS})")
    parser.add_argument("--force", action="store_true", help="overwrite certificates already in --out")
    args = parser.parse_args(argv)
    if args.days < 1:
        parser.error("--days must be >= 1")
    taken = [path for stem in NAMES for path in (args.out / f"{stem}.pem", args.out / f"{stem}.key") if path.exists()]
    if taken and not args.force:
        parser.error(f"{taken[0]} exists; pass --force to replace the certificates in {args.out}")
    files = make_certs(args.out, tuple(args.host), args.days)
    out = files.folder
    print(
        f"wrote a CA, a server and a client certificate into {out} (valid {args.days} days)\n"
        f"serve:   inference-service launch --tls-cert {out}/server.pem --tls-key {out}/server.key "
        f"--tls-client-ca {out}/ca.pem\n"
        f"call:    curl --cacert {out}/ca.pem --cert {out}/client.pem --key {out}/client.key "
        "https://localhost:8080/health"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
