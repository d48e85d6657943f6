"""Throwaway certificates for the TLS and mTLS tests (made with `cryptography`)."""

from __future__ import annotations

import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _pem(obj) -> bytes:
    if isinstance(obj, x509.Certificate):
        return obj.public_bytes(serialization.Encoding.PEM)
    return obj.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _issue(name: str, issuer_key, issuer_name, *, ca: bool, san: bool = False):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name or subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False
        )
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    return key, cert


def make_pki(folder: Path) -> dict[str, bytes | Path]:
    """A throwaway CA, a server and a client certificate, and a rogue CA's client cert."""
    ca_key, ca_cert = _issue("test CA", None, None, ca=True)
    server_key, server_cert = _issue("localhost", ca_key, ca_cert.subject, ca=False, san=True)
    client_key, client_cert = _issue("router", ca_key, ca_cert.subject, ca=False)
    rogue_key, rogue_ca = _issue("rogue CA", None, None, ca=True)
    bad_key, bad_cert = _issue("intruder", rogue_key, rogue_ca.subject, ca=False)
    files = {
        "ca": _pem(ca_cert),
        "server_cert": _pem(server_cert),
        "server_key": _pem(server_key),
        "client_cert": _pem(client_cert),
        "client_key": _pem(client_key),
        "bad_cert": _pem(bad_cert),
        "bad_key": _pem(bad_key),
    }
    out: dict[str, bytes | Path] = dict(files)
    for name, data in files.items():
        path = folder / f"{name}.pem"
        path.write_bytes(data)
        out[f"{name}_path"] = path
    return out
