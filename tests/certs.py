"""A throwaway CA and certificates for TLS tests (made with `cryptography`, valid for 1 day)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from pdserve.tls import TLSFiles


@dataclass(frozen=True)
class TestPKI:
    ca_file: str
    server: TLSFiles  # what a server runs with: its cert + key, and the CA for client certs
    client: TLSFiles  # what a client presents: its cert + key, and the CA to trust


def _write_key(key, path: Path) -> str:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(path)


def _issue(name: str, issuer_key, issuer_name, key, *, is_ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(issuer_name or x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    if not is_ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def make_pki(directory: Path) -> TestPKI:
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _issue("pdserve-test-ca", ca_key, None, ca_key, is_ca=True)
    ca_file = directory / "ca.pem"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files = {}
    for role in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _issue(f"pdserve-{role}", ca_key, ca.subject, key, is_ca=False)
        cert_file = directory / f"{role}.pem"
        cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        files[role] = TLSFiles(str(cert_file), _write_key(key, directory / f"{role}.key"),
                               str(ca_file))  # fmt: skip
    return TestPKI(str(ca_file), files["server"], files["client"])
