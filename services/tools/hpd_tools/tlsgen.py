"""A throwaway certificate authority for ``hpd up --tls``: mutual TLS on one machine with
nothing to set up.

:func:`ensure_pki` makes (once, in a folder) a CA, one server certificate for every
address the services answer on (``localhost``, ``127.0.0.1``, ``::1``, this host's name
and the listen address), one client certificate that the services, the CLI and the
agents present, and one client certificate per role (``role-<role>.pem``, common name
``hpd-<role>``): with ``hpd up --tls --auth`` the tokens file names these as identities,
so a caller presenting one needs no token (``hpd_common.auth``). A restart reuses them
while they have more than a day left, so clients keep trusting the same CA. Keys are ECDSA
P-256, written 0600. For production, bring your own certificates (the ``tls_*`` and
``call_*`` settings).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from hpd_common.auth import Role

VALID_DAYS = 30


@dataclass(frozen=True, slots=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    @classmethod
    def in_folder(cls, folder: Path) -> Pki:
        """The files' paths in ``folder`` (the one place they are named), made or not."""
        return cls(
            folder / "ca.pem",
            folder / "server.pem",
            folder / "server.key",
            folder / "client.pem",
            folder / "client.key",
        )

    def role_cert(self, role: str) -> tuple[Path, Path]:
        """(certificate, key) of the client certificate named ``hpd-<role>``."""
        folder = self.ca.parent
        return folder / f"role-{role}.pem", folder / f"role-{role}.key"

    def files(self) -> list[Path]:
        """Every file of the folder: the CA, the server and client pairs, each role's pair."""
        fixed = [self.ca, self.server_cert, self.server_key, self.client_cert, self.client_key]
        return fixed + [path for role in ROLES for path in self.role_cert(role)]


ROLES = tuple(role.value for role in Role)


def role_cert_name(role: str) -> str:
    """The common name of ``role``'s client certificate."""
    return f"hpd-{role}"


def role_cert_names() -> dict[Role, str]:
    """Each role's client certificate name, as a tokens file names them (``cert_name``)."""
    return {role: role_cert_name(role.value) for role in Role}


def _write(path: Path, data: bytes, private: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _name(cn: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "hetero-pd (hpd up --tls)"),
            x509.NameAttribute(NameOID.COMMON_NAME, cn),
        ]
    )


def _still_good(pki: Pki, hosts: Sequence[str]) -> bool:
    if not all(path.exists() for path in pki.files()):
        return False
    try:
        cert = x509.load_pem_x509_certificate(pki.server_cert.read_bytes())
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return False
    have = {str(v) for v in sans.get_values_for_type(x509.DNSName)} | {
        str(v) for v in sans.get_values_for_type(x509.IPAddress)
    }
    left = cert.not_valid_after_utc - dt.datetime.now(dt.UTC)
    return left > dt.timedelta(days=1) and set(_sans(hosts)) <= have


def _sans(hosts: Sequence[str]) -> list[str]:
    out = ["localhost", "127.0.0.1", "::1", socket.gethostname()]
    for h in hosts:
        if h and h not in ("0.0.0.0", "::") and h not in out:
            out.append(h)
    return out


def _ca(
    now: dt.datetime, until: dt.datetime
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A throwaway CA: its key and self-signed certificate."""
    ca_key = _key()
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("hetero-pd throwaway CA"))
        .issuer_name(_name("hetero-pd throwaway CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return ca_key, ca


def _leaf(
    ca_key: ec.EllipticCurvePrivateKey,
    ca: x509.Certificate,
    now: dt.datetime,
    until: dt.datetime,
    cn: str,
    usage: x509.ObjectIdentifier,
    sans: list[str],
) -> tuple[bytes, bytes]:
    """A certificate the CA signs for ``cn`` (PEM) and its key (PEM)."""
    key = _key()
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if sans:
        entries: list[x509.GeneralName] = []
        for name in sans:
            try:
                entries.append(x509.IPAddress(ipaddress.ip_address(name)))
            except ValueError:
                entries.append(x509.DNSName(name))
        builder = builder.add_extension(x509.SubjectAlternativeName(entries), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def ensure_pki(folder: Path, hosts: Sequence[str] = ()) -> Pki:
    """The CA and certificates in ``folder``, made now unless usable ones are there."""
    folder = folder.absolute()
    folder.mkdir(parents=True, exist_ok=True)
    pki = Pki.in_folder(folder)
    if _still_good(pki, hosts):
        return pki
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    until = now + dt.timedelta(days=VALID_DAYS)
    ca_key, ca = _ca(now, until)

    def leaf(cn: str, usage: x509.ObjectIdentifier, sans: list[str]) -> tuple[bytes, bytes]:
        return _leaf(ca_key, ca, now, until, cn, usage, sans)

    server_pem, server_key = leaf(
        "hetero-pd services", ExtendedKeyUsageOID.SERVER_AUTH, _sans(hosts)
    )
    client_pem, client_key = leaf("hetero-pd client", ExtendedKeyUsageOID.CLIENT_AUTH, [])
    _write(pki.ca, ca.public_bytes(serialization.Encoding.PEM), private=False)
    _write(pki.server_cert, server_pem, private=False)
    _write(pki.server_key, server_key, private=True)
    _write(pki.client_cert, client_pem, private=False)
    _write(pki.client_key, client_key, private=True)
    for role in ROLES:
        pem, key = leaf(role_cert_name(role), ExtendedKeyUsageOID.CLIENT_AUTH, [])
        cert_path, key_path = pki.role_cert(role)
        _write(cert_path, pem, private=False)
        _write(key_path, key, private=True)
    return pki


def main(argv: Sequence[str] | None = None) -> int:
    """`hpd certs DIR`: the CA and certificates of `ensure_pki` in DIR for the given
    server names, and DIR/tokens.yaml naming each role certificate as that role (plus a
    random token per role), for a control plane you run yourself with mutual TLS, e.g.
    the compose stack (compose.yaml, whose `certs` service runs this)."""
    import argparse

    from hpd_common.auth import write_tokens_file

    p = argparse.ArgumentParser(
        prog="hpd certs",
        description="Make a throwaway CA, a server certificate for the given names, a "
        "client certificate per role (role-<role>.pem, common name hpd-<role>) and a "
        "tokens file that names them (tokens.yaml). Existing, still valid files are kept.",
        epilog="Example: hpd certs ./tls --host registry --host scheduler --host kvbroker "
        "--owner 10001   (the compose stack's `certs` service runs this for you)",
    )
    p.add_argument("dir", help="folder to write to (made if missing)")
    p.add_argument(
        "--host", action="append", default=[], help="a name or address the servers answer on"
    )
    p.add_argument(
        "--owner",
        type=int,
        default=-1,
        help="give the files to this uid (the image's user is 10001), keys staying 0600",
    )
    args = p.parse_args(argv)
    folder = Path(args.dir)
    pki = ensure_pki(folder, args.host)
    tokens = folder / "tokens.yaml"
    if not tokens.exists():
        write_tokens_file(tokens, cert_names=role_cert_names())
    if args.owner >= 0:
        for path in [folder, *folder.iterdir()]:
            os.chown(path, args.owner, -1)
    print(f"CA {pki.ca}; server certificate for {', '.join(_sans(args.host))}; tokens {tokens}")
    return 0
