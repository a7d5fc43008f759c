"""One error hierarchy for the whole service.

Every error carries a stable machine `code` (snake_case) and the HTTP `status` the edge maps it to;
`api/errors.py` is the only place that turns them into responses. `details` is JSON-safe data a
client can act on (which field, which limit).
"""

from __future__ import annotations

from typing import Any, ClassVar


class RegistryError(Exception):
    """Base of every error the service reports to a client."""

    status: ClassVar[int] = 500
    default_code: ClassVar[str] = "internal_error"

    def __init__(
        self, message: str, *, code: str | None = None, details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.details = details or {}


class Invalid(RegistryError):
    """The request is malformed or violates a structural rule (400)."""

    status = 400
    default_code = "invalid_request"


class Unauthorized(RegistryError):
    """No valid session, or sign-in / envelope verification failed (401)."""

    status = 401
    default_code = "unauthorized"


class Forbidden(RegistryError):
    """Authenticated, but lacking the capability or bound to another principal (403)."""

    status = 403
    default_code = "forbidden"


class NotFound(RegistryError):
    """The named resource does not exist (404)."""

    status = 404
    default_code = "not_found"


class MethodNotAllowed(RegistryError):
    """The path exists but not with this method (405)."""

    status = 405
    default_code = "method_not_allowed"


class Conflict(RegistryError):
    """The request conflicts with the current state (409)."""

    status = 409
    default_code = "conflict"


class TooLarge(RegistryError):
    """The body exceeds the admission limit of the operation (413)."""

    status = 413
    default_code = "body_too_large"


class UnsupportedMediaType(RegistryError):
    """The body is not JSON (415)."""

    status = 415
    default_code = "unsupported_media_type"


class RateLimited(RegistryError):
    """A token bucket is empty; `retry_after` says when to come back (429)."""

    status = 429
    default_code = "rate_limited"

    def __init__(self, message: str, *, retry_after: float, limit: int, code: str | None = None):
        super().__init__(message, code=code, details={"retryAfterSeconds": retry_after})
        self.retry_after = retry_after
        self.limit = limit


class UpstreamFailed(RegistryError):
    """A service we depend on (identity lookup, peer) failed (502)."""

    status = 502
    default_code = "upstream_failed"


class Unavailable(RegistryError):
    """The service cannot answer now (database down, shutting down) (503)."""

    status = 503
    default_code = "unavailable"
