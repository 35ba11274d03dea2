"""A deployment's own certificate authority and its certificates: Redis nodes, trainers, the autotune service.

Why: the cluster bus (``port + 10000``) has no password. Any local process could otherwise ``CLUSTER MEET``
it, join the cluster, take its slots and receive the clients' ``AUTH <password>``. With ``tls-cluster``,
``tls-replication`` and ``tls-auth-clients`` a node accepts (and connects to) a peer only when the peer
shows a certificate signed by this deployment's CA. ``up`` makes that CA and one certificate per node; the
CA's private key is deleted as soon as the node certificates are signed, so nobody, not even the owner of
the state folder, can certify another node later (a new ``up`` makes a new CA).

Made with the ``openssl`` command line tool (the ``cryptography`` package is not a dependency; the
services image installs ``openssl``). Private keys are never on a command line and never on disk with
other permissions than 0600: ``openssl genpkey`` writes them to a pipe, and Python writes the 0600 file.
ECDSA P-256 keys, SHA-256 signatures, valid for ten years (the deployment lives until the next ``up``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import shutil
import subprocess
from pathlib import Path

from ..core import procs
from ..core.errors import ConfigurationError
from ..core.redis_server import NodeTLS
from ..core.tls_trust import ClientTLS

CA_CERT = "ca.crt"
CLIENT_CERT, CLIENT_KEY = "client.crt", "client.key"  # the trainers' (and the autotune service's) Redis client
SERVICE_CERT, SERVICE_KEY = "autotune.crt", "autotune.key"  # the autotune service's gRPC server certificate
VALID_DAYS = 3650
_TIMEOUT_S = 30.0  # one openssl call; key generation on a loaded machine takes milliseconds


def openssl_binary() -> str:
    """Path of ``openssl``; :class:`ConfigurationError` naming the fix when it is missing."""
    path = shutil.which("openssl")
    if path is None:
        raise ConfigurationError("openssl is not on PATH; the Redis cluster bus needs it for its certificates. "
                                 "Install it (Debian: `apt-get install openssl`).")
    return path


def _openssl(*args: str, stdin: bytes | None = None) -> bytes:
    try:
        result = subprocess.run([openssl_binary(), *args], input=stdin, capture_output=True, check=False,
                                timeout=_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ConfigurationError(f"openssl {args[0]} did not finish within {_TIMEOUT_S:.0f} s.") from None
    if result.returncode != 0:
        raise ConfigurationError(f"openssl {args[0]} failed: {result.stderr.decode(errors='replace').strip()}")
    return result.stdout


def _new_key(path: Path) -> Path:
    pem = _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256")
    return procs.write_private(path, pem.decode())


def _alt_names(hosts: list[str]) -> str:
    return ",".join(f"IP:{h}" if _is_ip(h) else f"DNS:{h}" for h in dict.fromkeys(hosts))


def _sign(folder: Path, name: str, ca_cert: Path, ca_key: Path, usage: str, hosts: list[str] | None) -> Path:
    """A new key ``<name>.key`` and its certificate ``<name>.crt`` signed by the CA; returns the certificate."""
    key = _new_key(folder / f"{name}.key")
    names = _alt_names(hosts or [])
    pem = _openssl("req", "-new", "-x509", "-key", str(key), "-CA", str(ca_cert), "-CAkey", str(ca_key),
                   "-sha256", "-days", str(VALID_DAYS), "-subj", f"/CN={name}",
                   "-addext", "basicConstraints=critical,CA:FALSE",
                   "-addext", "keyUsage=critical,digitalSignature,keyEncipherment",
                   "-addext", f"extendedKeyUsage={usage}",
                   *(["-addext", f"subjectAltName={names}"] if names else []))
    return procs.write_private(folder / f"{name}.crt", pem.decode())


def make_node_certificates(folder: Path, ports: list[int], hosts: list[str], *, clients: bool = False,
                           service_hosts: list[str] | None = None) -> dict[int, NodeTLS]:
    """A fresh CA and one certificate per node port in ``folder`` (made 0700); returns each node's files.

    Args:
        folder: where the files go (``ca.crt``, ``node-<port>.crt``, ``node-<port>.key``).
        ports: the nodes' ports; each node gets its own key and certificate (CN ``node-<port>``).
        hosts: addresses the nodes are reached at (put in the certificates' subjectAltName).
        clients: the nodes serve clients over TLS too; also sign the client certificate ``client.crt``.
        service_hosts: also sign the autotune service's server certificate ``autotune.crt`` for these
            addresses (subjectAltName); None: none.
    """
    procs.private_dir(folder)
    ca_key = _new_key(folder / "ca.key")
    try:
        ca_cert = folder / CA_CERT
        pem = _openssl("req", "-x509", "-new", "-key", str(ca_key), "-sha256", "-days", str(VALID_DAYS),
                       "-subj", f"/CN=bagua-lightning redis {folder.name} CA",
                       "-addext", "basicConstraints=critical,CA:TRUE",
                       "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        procs.write_private(ca_cert, pem.decode())
        out = {}
        for port in ports:
            # Used both ways on the bus: as server (accepting a peer) and as client (connecting to one).
            cert = _sign(folder, f"node-{port}", ca_cert, ca_key, "serverAuth,clientAuth", hosts)
            out[port] = NodeTLS(cert_file=cert, key_file=cert.with_suffix(".key"), ca_file=ca_cert, clients=clients)
        if clients:
            _sign(folder, Path(CLIENT_CERT).stem, ca_cert, ca_key, "clientAuth", None)
        if service_hosts:
            _sign(folder, Path(SERVICE_CERT).stem, ca_cert, ca_key, "serverAuth", service_hosts)
        return out
    finally:
        # Nobody can certify another node after this (a new `up` makes a new CA).
        ca_key.unlink(missing_ok=True)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def client_tls(folder: Path) -> ClientTLS | None:
    """The client side of the deployment whose certificates are in ``folder``: its CA and the client
    certificate (None when the deployment's nodes serve clients in plaintext)."""
    if not (folder / CLIENT_CERT).exists():
        return None
    return ClientTLS(ca=str(folder / CA_CERT), cert=str(folder / CLIENT_CERT), key=str(folder / CLIENT_KEY))


def service_certificate(folder: Path) -> tuple[Path, Path] | None:
    """``(certificate, key)`` of the autotune service in ``folder``, when they were made."""
    cert = folder / SERVICE_CERT
    return (cert, folder / SERVICE_KEY) if cert.exists() else None


def remove_tls_dir(folder: Path) -> None:
    """Delete the certificate files a deployment made in ``folder`` (and the folder once empty); nothing else."""
    for pattern in ("ca.crt", "ca.key", "node-*.crt", "node-*.key", CLIENT_CERT, CLIENT_KEY, SERVICE_CERT,
                    SERVICE_KEY):
        for path in folder.glob(pattern):
            path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        folder.rmdir()
