"""The certificate ``up`` serves https with, and the web server's command line.

WMLA's own ``dlicmd.py`` logs on over https only, so ``up`` serves https on its own port
(``EDT_HTTPS_PORT``, 8443) beside plain http. The certificate is the one the admin names
(``EDT_TLS_CERT`` and ``EDT_TLS_KEY``, PEM files), else a self-signed one made on first start
under ``var/tls/`` (the key ``0600``, the folder ``0700``) and reused while it is valid.

No Django import here: ``up`` passes the settings in.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from config import service_files

CERT_NAME = "cert.pem"
KEY_NAME = "key.pem"
VALID_DAYS = 825
RENEW_BEFORE = datetime.timedelta(days=30)


class TlsError(Exception):
    """A certificate ``up`` cannot serve: said in one line."""


@dataclass(frozen=True)
class Certificate:
    cert: Path
    key: Path
    self_signed: bool


def certificate(var_dir: Path, env: dict | None = None, host: str = "127.0.0.1") -> Certificate:
    """The admin's certificate when ``EDT_TLS_CERT``/``EDT_TLS_KEY`` name one, else ours under
    ``var_dir/tls``, made now if it is missing or about to expire."""
    env = os.environ if env is None else env
    cert, key = env.get("EDT_TLS_CERT", ""), env.get("EDT_TLS_KEY", "")
    if cert or key:
        if not (cert and key):
            raise TlsError("Set both EDT_TLS_CERT and EDT_TLS_KEY (PEM files), or neither.")
        for name, path in (("EDT_TLS_CERT", cert), ("EDT_TLS_KEY", key)):
            if not os.access(path, os.R_OK):
                raise TlsError(f"{name}={path} is not a readable file.")
        return Certificate(Path(cert).resolve(), Path(key).resolve(), self_signed=False)
    folder = service_files.private_dir(var_dir / "tls")
    ours = Certificate(folder / CERT_NAME, folder / KEY_NAME, self_signed=True)
    if not _still_good(ours.cert, ours.key):
        _make_self_signed(ours, host)
    return ours


def _still_good(cert: Path, key: Path) -> bool:
    if not (cert.is_file() and key.is_file()):
        return False
    from cryptography import x509

    try:
        loaded = x509.load_pem_x509_certificate(cert.read_bytes())
    except ValueError:
        return False
    now = datetime.datetime.now(datetime.timezone.utc)  # noqa: UP017
    return loaded.not_valid_after_utc - RENEW_BEFORE > now


def _names(host: str) -> tuple[list[str], list[ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    """The DNS names and addresses the certificate is for: this machine's and the bind host."""
    dns = {"localhost", socket.gethostname(), socket.getfqdn()}
    ips = {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")}
    for name in {host, *dns}:
        try:
            address = ipaddress.ip_address(name.strip("[]"))
        except ValueError:
            continue
        dns.discard(name)
        if not address.is_unspecified:
            ips.add(address)
    return sorted(n for n in dns if n), sorted(ips, key=str)


def _make_self_signed(target: Certificate, host: str) -> None:
    """An RSA key and a self-signed certificate for this machine's names, written private
    (key ``0600``) to temporary names and then moved into place."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    dns, ips = _names(host)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns[0] if dns else "localhost"),
                         x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Elastic training console")])
    now = datetime.datetime.now(datetime.timezone.utc)  # noqa: UP017
    alt = [x509.DNSName(n) for n in dns] + [x509.IPAddress(a) for a in ips]
    public = key.public_key()
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
        .public_key(public).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(public),
                       critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.TraditionalOpenSSL,
                                serialization.NoEncryption())
    service_files.write_private(target.key, key_pem)
    service_files.write_private(target.cert, cert.public_bytes(serialization.Encoding.PEM))


def web_argv(host: str, port: int, https_port: int, tls: Certificate | None) -> list[str]:
    """The web server (``config.web_server``) serving http on ``host:port`` and, given a
    certificate, https on ``host:https_port``."""
    argv = [sys.executable, "-m", "config.web_server", "--host", host, "--port", str(port)]
    if tls is not None:
        argv += ["--https-port", str(https_port), "--certfile", str(tls.cert),
                 "--keyfile", str(tls.key)]
    return argv
