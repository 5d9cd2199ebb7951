"""Domain errors: carry data, know nothing of gRPC.

`hpd_common.rpc` translates each class to one gRPC status code, in one place
(DESIGN.md section 5). Raise these from domain, service and store code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class HpdError(Exception):
    """Base of every expected failure; anything else reaching the edge is a bug."""


class InvalidArgument(HpdError):
    """A request field is invalid; `field` is its dotted path (e.g. `capability.tp_size`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class NotFound(HpdError):
    """The named object does not exist (or no longer does, e.g. an expired lease)."""

    def __init__(self, kind: str, key: str) -> None:
        super().__init__(f"{kind} {key!r} not found")
        self.kind = kind
        self.key = key


class AlreadyExists(HpdError):
    """The object exists and the caller may not take it over."""


class PermissionDenied(HpdError):
    """The caller's credential does not grant this operation."""


class FailedPrecondition(HpdError):
    """The system is not in a state where the operation can ever succeed as asked."""

    def __init__(self, message: str, reasons: Mapping[str, Sequence[str]] | None = None) -> None:
        super().__init__(message)
        self.reasons = dict(reasons or {})


class ResourceExhausted(HpdError):
    """Capable capacity exists but is saturated or throttled; retry after `retry_after_ms`."""

    def __init__(self, message: str, retry_after_ms: int = 0) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class Aborted(HpdError):
    """A concurrent change won; the caller may retry the whole operation."""


class Unavailable(HpdError):
    """A dependency (Redis, the registry) is unreachable or the view is too stale."""
