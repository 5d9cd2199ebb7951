"""The one rule for every id hetero-pd takes from a caller (worker, pool, request, session,
scheduler replica ids): 1-128 characters of ``[A-Za-z0-9._:-]``, so an id is safe in a Redis
key, a log line, gRPC metadata and an HTTP header as it is."""

from __future__ import annotations

import re

from hpd_common.errors import InvalidArgument

__all__ = ["ID_RE", "ID_RULE", "check_id", "is_id"]

ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
ID_RULE = "1-128 characters of [A-Za-z0-9._:-]"


def is_id(value: str) -> bool:
    """Whether ``value`` is a valid id."""
    return ID_RE.match(value) is not None


def check_id(path: str, value: str) -> None:
    """InvalidArgument naming ``path`` unless ``value`` is a valid id."""
    if not value:
        raise InvalidArgument(path, "is required")
    if ID_RE.match(value) is None:
        raise InvalidArgument(path, f"must be {ID_RULE}")
