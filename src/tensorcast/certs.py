"""A private CA and certificates made at run time with the ``openssl`` command, for local clusters and tests.

Owns: ``make_ca`` (a self-signed CA), ``make_cert`` (a certificate it signs, for servers and clients alike,
naming the hosts it is valid for) and ``cluster_tls`` (both, for a ``LocalCluster``), ECDSA P-256 keys written
``0600``. Nothing here is meant for a
production cluster, whose certificates come from its own CA (docs/security.md); no key material is ever
kept in the repository. Does not own: how the certificates are used (``tls``).
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tensorcast.errors import InvalidArgument

__all__ = ["CertFiles", "cluster_tls", "make_ca", "make_cert"]

_DAYS = "30"


@dataclass(frozen=True)
class CertFiles:
    cert: Path
    key: Path


def _openssl(*args: str) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise InvalidArgument("making TLS certificates needs the openssl command, which is not installed")
    proc = subprocess.run([exe, *args], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise InvalidArgument(f"openssl {args[0]} failed: {proc.stderr.strip()[-300:]}")


def _private(path: Path) -> Path:
    """An empty file only its owner may read, for openssl to write a key into."""
    path.unlink(missing_ok=True)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    return path


def make_ca(directory: Path, name: str = "tensorcast-local-ca") -> CertFiles:
    """A self-signed CA in ``directory`` (``NAME.crt``, ``NAME.key``)."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / f"{name}.crt", _private(directory / f"{name}.key")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(key), "-out", str(cert), "-days", _DAYS, "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             "-addext", "subjectKeyIdentifier=hash")
    return CertFiles(cert, key)


def make_cert(directory: Path, ca: CertFiles, name: str, hosts: list[str]) -> CertFiles:
    """A certificate signed by ``ca`` for ``hosts`` (names and IP addresses), usable by servers and clients."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key, csr = directory / f"{name}.crt", _private(directory / f"{name}.key"), directory / f"{name}.csr"
    sans = ",".join(f"IP:{h}" if _is_ip(h) else f"DNS:{h}" for h in hosts)
    ext = directory / f"{name}.ext"
    ext.write_text(f"subjectAltName={sans}\nbasicConstraints=critical,CA:FALSE\n"
                   "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\n"
                   "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key),
             "-out", str(csr), "-subj", f"/CN={name}")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca.cert), "-CAkey", str(ca.key), "-CAcreateserial",
             "-out", str(cert), "-days", _DAYS, "-extfile", str(ext))
    csr.unlink()
    ext.unlink()
    return CertFiles(cert, key)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def cluster_tls(directory: Path, hosts: list[str]) -> dict[str, str]:
    """A CA and one certificate (for every process of a local cluster, as server and as client) in
    ``directory``, valid for loopback and ``hosts``; the configuration keys that use them."""
    ca = make_ca(directory)
    node = make_cert(directory, ca, "tensorcast-node", ["localhost", "127.0.0.1", "::1", *hosts])
    ca.key.unlink()  # nothing more is signed: the CA's key is not kept
    return {"tls.enabled": "true", "tls.cert_file": str(node.cert), "tls.key_file": str(node.key),
            "tls.ca_file": str(ca.cert)}
