"""Certificates for the TLS tests, made here with the `cryptography` package: a CA, server certificates
it signs (valid for 127.0.0.1 and localhost), client certificates for mutual TLS. Private keys are
created owner-only (0600) before a byte is written, as a deployment's secrets should be."""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Pair:
    cert: Path
    key: Path


@dataclass
class CA:
    """A test CA; `issue` writes a certificate it signs and its key into the CA's folder."""

    folder: Path
    name: str
    cert: Path
    _key: Any
    _cert: Any

    @classmethod
    def create(cls, folder: Path, name: str = "ca") -> CA:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec

        folder.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        subject = _name(f"nanokv test {name}")
        cert = (_builder(subject, subject, key.public_key())
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(key, hashes.SHA256()))
        path = folder / f"{name}.pem"
        path.write_bytes(_pem(cert))
        return cls(folder, name, path, key, cert)

    def issue(self, name: str, *, server: bool = True, client: bool = False, host: str | None = "127.0.0.1",
              dns: tuple[str, ...] = ("localhost",)) -> Pair:
        """host: the IP address the certificate is valid for (None: names only, as a Service's pods
        reached by address, whose clients check the name they expect instead)."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID

        key = ec.generate_private_key(ec.SECP256R1())
        usages = [u for u, on in ((ExtendedKeyUsageOID.SERVER_AUTH, server), (ExtendedKeyUsageOID.CLIENT_AUTH, client))
                  if on]
        b = (_builder(_name(name), self._cert.subject, key.public_key())
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
        if server:
            ips = [x509.IPAddress(ipaddress.ip_address(host))] if host else []
            sans = [*ips, *(x509.DNSName(d) for d in dns)]
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = b.sign(self._key, hashes.SHA256())
        pair = Pair(self.folder / f"{name}.pem", self.folder / f"{name}.key")
        pair.cert.write_bytes(_pem(cert))
        write_key(pair.key, key)
        return pair


def write_key(path: Path, key: Any) -> None:
    """The key as PKCS#8 PEM in a file that is 0600 from its creation (no window where others may read it)."""
    from cryptography.hazmat.primitives import serialization

    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    if path.exists():
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _name(cn: str) -> Any:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _builder(subject: Any, issuer: Any, public_key: Any) -> Any:
    from cryptography import x509

    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)))


def _pem(cert: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return bytes(cert.public_bytes(serialization.Encoding.PEM))
