"""Request errors of the autotuning service, by category.

The tuner and the session raise these; the servicer maps each category to one
gRPC status code in a single place (:mod:`.servicer`). They carry no grpc
import so the logic stays testable without a server.
"""

from __future__ import annotations

from ...core.errors import BaguaLightningError


class AutotuneRequestError(BaguaLightningError):
    """A request the service refuses; the message names the field, the value and the fix."""


class InvalidArgumentError(AutotuneRequestError, ValueError):
    """A field is malformed (maps to INVALID_ARGUMENT)."""


class NotFoundError(AutotuneRequestError, LookupError):
    """The model was never registered (maps to NOT_FOUND)."""


class FailedPreconditionError(AutotuneRequestError):
    """The request contradicts the model's registration (maps to FAILED_PRECONDITION)."""


class ResourceExhaustedError(AutotuneRequestError):
    """The request exceeds the service's size limits (maps to RESOURCE_EXHAUSTED)."""
