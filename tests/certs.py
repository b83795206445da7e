"""Throwaway X.509 material for TLS tests, generated at test time with `cryptography`.

    pki = make_pki(tmp_path)
    pki.server_cert, pki.server_key   # SAN: IP 127.0.0.1, DNS localhost; signed by pki.ca_cert
    pki.client_cert, pki.client_key   # signed by the same CA (mTLS)
    pki.other_ca_cert                 # an unrelated CA
    pki.other_client_cert, pki.other_client_key  # signed by the unrelated CA

All paths are PEM files (str). Keys are ECDSA P-256: fast to generate, and
accepted by gRPC's BoringSSL.
"""

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
class Pki:
    ca_cert: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca_cert: str
    other_client_cert: str
    other_client_key: str


def _name(common_name: str) -> x509.Name:
    return x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "weightsync tests"),
        x509.NameAttribute(NameOID.COMMON_NAME, common_name),
    ])


def _write(path: Path, *, cert: x509.Certificate | None = None, key: ec.EllipticCurvePrivateKey | None = None) -> str:
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        assert key is not None
        path.write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption(),
        ))
        path.chmod(0o600)
    return str(path)


def _builder(subject: str, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def make_ca(common_name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(common_name, _name(common_name), key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def make_leaf(
    common_name: str,
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
    *,
    server: bool,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        _builder(common_name, ca_cert.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=True, data_encipherment=False,
                key_agreement=False, key_cert_sign=False, crl_sign=False, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False,
        )
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([
                x509.IPAddress(ipaddress.IPv4Address("127.0.0.1")),
                x509.DNSName("localhost"),
            ]),
            critical=False,
        )
    return builder.sign(ca_key, hashes.SHA256()), key


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca = make_ca("weightsync test CA")
    other_ca = make_ca("unrelated test CA")
    server_cert, server_key = make_leaf("localhost", ca, server=True)
    client_cert, client_key = make_leaf("trainer", ca, server=False)
    other_client_cert, other_client_key = make_leaf("intruder", other_ca, server=False)
    return Pki(
        ca_cert=_write(directory / "ca.pem", cert=ca[0]),
        server_cert=_write(directory / "server.pem", cert=server_cert),
        server_key=_write(directory / "server.key", key=server_key),
        client_cert=_write(directory / "client.pem", cert=client_cert),
        client_key=_write(directory / "client.key", key=client_key),
        other_ca_cert=_write(directory / "other-ca.pem", cert=other_ca[0]),
        other_client_cert=_write(directory / "other-client.pem", cert=other_client_cert),
        other_client_key=_write(directory / "other-client.key", key=other_client_key),
    )
