"""The twin's certificates and keys, made fresh at each start (nothing secret is kept in the repo).

One CA signs the API server's serving certificate (127.0.0.1 and the in-cluster names), a
client certificate per component (its user name is the certificate's CN, its groups the O
fields, as the API server's x509 authenticator reads them), and the serving certificates of
the controllers' webhooks, which the API server calls at https://127.0.0.1:<port>. The service
account signing key pair is separate, as in any cluster. etcd has a CA of its own, as kubeadm
gives it (pki/etcd/): a certificate the cluster's CA signs, a CSR's approved by the controller
manager included, is not a key to etcd.

Each private key is a new file, created 0600 (O_EXCL), in a folder only its owner may enter.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from twin.paths import private_folder

_VALID = datetime.timedelta(days=2)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key, path: Path) -> None:
    """A new file, 0600 from its creation: written with the umask and chmodded afterwards, it was
    readable by others in between, through a descriptor opened then and kept. O_EXCL refuses a
    file (or a symlink) already at the path rather than writing a key into it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))


def _name(common_name: str, groups: tuple[str, ...] = ()) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name),
                      *(x509.NameAttribute(NameOID.ORGANIZATION_NAME, g) for g in groups)])


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


class Authority:
    """A CA in a folder; issue() writes <name>.crt and <name>.key beside it."""

    def __init__(self, folder: Path):
        self.folder = private_folder(folder)
        self._key = _key()
        now = datetime.datetime.now(datetime.timezone.utc)
        self._cert = (x509.CertificateBuilder()
                      .subject_name(_name("pdstack-twin-ca")).issuer_name(_name("pdstack-twin-ca"))
                      .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
                      .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + _VALID)
                      .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                      .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                   content_commitment=False, key_encipherment=False,
                                                   data_encipherment=False, key_agreement=False,
                                                   encipher_only=False, decipher_only=False), critical=True)
                      .sign(self._key, hashes.SHA256()))
        self.ca = Pair(folder / "ca.crt", folder / "ca.key")
        self.ca.cert.write_bytes(self.pem)
        _write_key(self._key, self.ca.key)

    @classmethod
    def existing(cls, folder: Path, issue_into: Path) -> "Authority":
        """The CA a started twin made in `folder` (ca.crt, ca.key), issuing into `issue_into`: a
        test's own identities (a node's certificate), signed as the twin signs its components'."""
        authority = cls.__new__(cls)
        authority.folder = private_folder(issue_into)
        authority.ca = Pair(folder / "ca.crt", folder / "ca.key")
        authority._key = serialization.load_pem_private_key(authority.ca.key.read_bytes(), password=None)
        authority._cert = x509.load_pem_x509_certificate(authority.ca.cert.read_bytes())
        return authority

    @property
    def pem(self) -> bytes:
        return self._cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, name: str, common_name: str, *, groups: tuple[str, ...] = (), server_names: tuple[str, ...] = (),
              client: bool = False) -> Pair:
        key = _key()
        now = datetime.datetime.now(datetime.timezone.utc)
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
        builder = (x509.CertificateBuilder().subject_name(_name(common_name, groups)).issuer_name(self._cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + _VALID))
        if server_names:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
            builder = builder.add_extension(x509.SubjectAlternativeName([
                x509.IPAddress(ipaddress.ip_address(n)) if _is_ip(n) else x509.DNSName(n) for n in server_names]),
                critical=False)
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        pair = Pair(self.folder / f"{name}.crt", self.folder / f"{name}.key")
        pair.cert.write_bytes(builder.sign(self._key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
        _write_key(key, pair.key)
        return pair


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def service_account_keys(folder: Path) -> Pair:
    """The key pair the API server verifies (public) and the token signers sign (private) with."""
    key = _key()
    pair = Pair(folder / "sa.pub", folder / "sa.key")
    _write_key(key, pair.key)
    pair.cert.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                        serialization.PublicFormat.SubjectPublicKeyInfo))
    return pair
