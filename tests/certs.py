"""Certificates for TLS tests: the ones `python -m gateway.certs` makes (the recipe users run: a CA,
a server certificate for localhost / 127.0.0.1 usable as a client certificate too, a client
certificate), made by running it, and a stranger's certificate signed by another CA."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from gateway import certs


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


def make_certs(folder: Path) -> Certs:
    subprocess.run(
        [sys.executable, "-m", "gateway.certs", "--out", str(folder), "--days", "2"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    other_ca_key, stranger_key = certs.new_key(), certs.new_key()
    stranger = certs.issue("a stranger", stranger_key, certs.name("another CA"), other_ca_key, days=2)
    certs.write(folder, "stranger", stranger, stranger_key)
    files = certs.CertFiles(folder)
    return Certs(
        files.ca,
        files.cert("server"),
        files.key("server"),
        files.cert("client"),
        files.key("client"),
        files.cert("stranger"),
        files.key("stranger"),
    )
