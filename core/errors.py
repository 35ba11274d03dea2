"""The project's exception hierarchy.

One root, :class:`BaguaLightningError`, and a few subclasses by category. Input
errors also derive from the matching builtin (``ValueError``/``TypeError``) so
callers that catch those keep working.
"""

from __future__ import annotations


class BaguaLightningError(Exception):
    """Root of every error raised on purpose by bagua-lightning."""


class ConfigurationError(BaguaLightningError, ValueError):
    """A value given by the user is out of range or inconsistent; the message names it and the fix."""


class ServiceUnavailableError(BaguaLightningError, ConnectionError):
    """A network service (autotuner, Redis) could not be reached before its deadline."""


class PlanMismatchError(BaguaLightningError, RuntimeError):
    """Ranks disagree on the bucket plan; raised instead of letting a collective hang."""


class CacheError(BaguaLightningError):
    """The sample cache cannot store or decode an entry."""


class AutotuneError(BaguaLightningError):
    """The autotune service refused or failed a call; ``code`` is the gRPC status code's name."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class ModelNotRegisteredError(AutotuneError, LookupError):
    """The autotune service does not hold the model (never registered, restarted or evicted): register it."""


class AutotuneRequestRejectedError(AutotuneError, ValueError):
    """The autotune service refused the request's content (invalid, contradicting, over a limit)."""


class AutotuneAuthenticationError(AutotuneError, PermissionError):
    """The autotune service requires a token and the call had none or a wrong one."""


class UntrustedServerError(ServiceUnavailableError):
    """A server did not prove, during the TLS handshake, that it belongs to the deployment (its certificate is
    not signed by the pinned CA, or it speaks no TLS at all); nothing was sent to it."""
