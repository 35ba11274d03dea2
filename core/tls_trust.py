"""TLS to the deployment's servers: which CA a client pins, and what it says when a server fails to prove itself.

``bagua-lightning up`` makes a CA of its own (:mod:`bagua_lightning.services.redis_tls`) and, before deleting
the CA's key, signs the Redis nodes' certificates, one client certificate for trainers and the autotune
service's server certificate. The services file records the CA certificate and the client certificate and
key (paths of 0600 files in a 0700 folder). A client resolves its TLS settings like everything else
(:mod:`bagua_lightning.core.services_file`):

1. explicit arguments (``tls_ca=``, ``tls_cert=``, ``tls_key=``);
2. the environment: ``BAGUA_LIGHTNING_TLS_CA``, ``BAGUA_LIGHTNING_TLS_CERT``, ``BAGUA_LIGHTNING_TLS_KEY``
   (PEM file paths; what Kubernetes and compose mount);
3. the services file, but only for an address the same file records (a server named elsewhere is not the
   deployment's, and gets none of its secrets either);
4. none: plaintext (a local development server, the node-local cache).

With a CA, the client verifies the server's certificate against that CA alone (not the system's roots, not
``SSL_CERT_FILE``/``SSL_CERT_DIR``), host name or IP address checked, TLS 1.2 or later, during the TLS
handshake: before any password or token is sent. :meth:`ClientTLS.context` is the one place that builds that
context for Python's ``ssl`` (every Redis connection, through
:class:`~bagua_lightning.core.pinned_redis.PinnedSSLConnection`); gRPC is given the CA's PEM as its only
root certificates (``grpc.ssl_channel_credentials(root_certificates=...)``, which then reads no system or
``GRPC_DEFAULT_SSL_ROOTS_FILE_PATH`` roots). A server
that fails (a process that took a dead node's port, a server with another CA's certificate, a plaintext
listener) gets the handshake's ClientHello and nothing else; the error names its address and says it is
not this deployment's (:func:`explain_untrusted`).
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigurationError, UntrustedServerError

ENV_TLS_CA = "BAGUA_LIGHTNING_TLS_CA"
ENV_TLS_CERT = "BAGUA_LIGHTNING_TLS_CERT"
ENV_TLS_KEY = "BAGUA_LIGHTNING_TLS_KEY"
TLS_ENV = (ENV_TLS_CA, ENV_TLS_CERT, ENV_TLS_KEY)
MIN_TLS_VERSION = ssl.TLSVersion.TLSv1_2
# What gRPC and OpenSSL say when a handshake fails (gRPC gives no exception object, only its text).
_HANDSHAKE_MARKERS = ("[SSL", "SSL_ERROR", "Ssl handshake", "CERTIFICATE_VERIFY_FAILED", "certificate verify failed",
                      "TSI_", "handshake failed", "WRONG_VERSION_NUMBER")


@dataclass(frozen=True)
class ClientTLS:
    """A client's TLS settings: the pinned CA and, for servers that demand one (Redis), a client certificate.

    Attributes:
        ca: PEM file of the CA the server's certificate must chain to (the only trusted root).
        cert: PEM client certificate (mutual TLS), or None.
        key: PEM private key of ``cert``, or None.
    """

    ca: str
    cert: str | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ConfigurationError(f"TLS client certificate {self.cert!r} and key {self.key!r} go together: give "
                                     f"both (tls_cert=/tls_key=, or ${ENV_TLS_CERT} and ${ENV_TLS_KEY}) or neither.")
        for what, path in (("CA certificate", self.ca), ("client certificate", self.cert), ("client key", self.key)):
            if path is not None and not os.access(path, os.R_OK):
                raise ConfigurationError(f"TLS {what} {path} cannot be read; fix the path or its permissions "
                                         f"(${ENV_TLS_CA}, ${ENV_TLS_CERT}, ${ENV_TLS_KEY} or the services file).")

    def context(self) -> ssl.SSLContext:
        """The client ``SSLContext`` of every TLS connection to the deployment (Redis, and what else speaks
        Python's ``ssl``): this CA is the only trusted root (no system roots: ``PROTOCOL_TLS_CLIENT`` starts
        with none, and ``SSL_CERT_FILE``/``SSL_CERT_DIR`` are never read), the server's certificate is required
        and its host name or IP address checked, TLS 1.2 or later, and the client certificate shown."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname, no roots loaded
        context.minimum_version = MIN_TLS_VERSION
        context.load_verify_locations(cafile=self.ca)
        if self.cert is not None:
            context.load_cert_chain(certfile=self.cert, keyfile=self.key)
        return context

    def to_json(self) -> dict[str, str]:
        return {k: v for k, v in (("ca", self.ca), ("cert", self.cert), ("key", self.key)) if v}

    @classmethod
    def from_json(cls, data: Any) -> ClientTLS | None:
        """The services file's ``tls`` object (None when absent); ``ValueError`` naming a bad field."""
        if data is None or data == {}:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("ca"), str) or not data["ca"]:
            raise ValueError(f"'tls' {data!r} is not {{ca, cert, key}} file paths")
        for name in ("cert", "key"):
            if data.get(name) is not None and not isinstance(data[name], str):
                raise ValueError(f"'tls.{name}' {data[name]!r} is not a file path")
        # Not checked for readability here: a stale services file must still parse (``down`` reads it).
        return unchecked(data["ca"], data.get("cert"), data.get("key"))


def unchecked(ca: str, cert: str | None, key: str | None) -> ClientTLS:
    """A :class:`ClientTLS` whose files are not checked now (they are read when a connection is made)."""
    obj = object.__new__(ClientTLS)
    for name, value in (("ca", ca), ("cert", cert), ("key", key)):
        object.__setattr__(obj, name, value)
    return obj


def _path(value: str | os.PathLike[str] | None) -> str | None:
    return os.fspath(value) if value else None


def resolve_client_tls(recorded: ClientTLS | None, *, ca: str | os.PathLike[str] | None = None,
                       cert: str | os.PathLike[str] | None = None,
                       key: str | os.PathLike[str] | None = None) -> ClientTLS | None:
    """The TLS settings for one server: arguments, else the environment, else ``recorded`` (the services file's,
    which the caller passes only for an address that file records), else None (plaintext).

    A CA given by argument or environment replaces the recorded one; the client certificate and key are
    looked up the same way (argument, environment, recorded).
    """
    ca_path = _path(ca) or os.environ.get(ENV_TLS_CA) or (recorded.ca if recorded else None)
    if not ca_path:
        if _path(cert) or _path(key):
            raise ConfigurationError(f"a TLS client certificate was given without a CA to verify the server with; "
                                     f"give tls_ca= or ${ENV_TLS_CA} too.")
        return None
    cert_path = _path(cert) or os.environ.get(ENV_TLS_CERT) or (recorded.cert if recorded else None)
    key_path = _path(key) or os.environ.get(ENV_TLS_KEY) or (recorded.key if recorded else None)
    return ClientTLS(ca=ca_path, cert=cert_path, key=key_path)


def handshake_failed(exc: BaseException | str | None) -> bool:
    """Whether ``exc`` (an exception, its chain, or a gRPC error text) is a failed TLS handshake."""
    seen = 0
    while isinstance(exc, BaseException) and seen < 8:
        if isinstance(exc, ssl.SSLError | UntrustedServerError):
            return True
        text = str(exc)
        if any(m in text for m in _HANDSHAKE_MARKERS):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return isinstance(exc, str) and any(m in exc for m in _HANDSHAKE_MARKERS)


def untrusted(address: str, detail: str) -> UntrustedServerError:
    """The error for a server at ``address`` that failed the handshake (``detail``: what TLS said)."""
    return UntrustedServerError(
        f"{address} is not this deployment's server: it did not prove itself with a certificate of the "
        f"deployment's CA ({detail.strip()[:300]}); nothing was sent to it. If the deployment moved, run "
        "`bagua-lightning status`; if this is a dead node's port, the cache keeps serving from the other nodes."
    )


def explain_untrusted(exc: BaseException | None, address: str | None = None) -> BaseException | None:
    """``exc`` itself, or, when it is a failed TLS handshake, an :class:`UntrustedServerError` that names the
    address (``address``, else the one redis-py's text names) and says it is not this deployment's."""
    if exc is None or isinstance(exc, UntrustedServerError) or not handshake_failed(exc):
        return exc
    text = str(exc)
    if address is None and " connecting to " in text:
        address = text.split(" connecting to ", 1)[1].split(". ", 1)[0].rstrip(".")
    error = untrusted(address or "the server", text)
    error.__cause__ = exc
    return error


def read_pem(path: str | Path) -> bytes:
    """The bytes of a PEM file; :class:`ConfigurationError` naming it when it cannot be read."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigurationError(f"TLS file {path} cannot be read ({exc.strerror}); fix the path (tls_ca=, "
                                 f"${ENV_TLS_CA}) or its permissions.") from None
