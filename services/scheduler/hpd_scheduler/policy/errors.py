"""Typed errors of the policy core.

Every error carries data (the offending field or config key path, the worker id, the reasons),
so the one translator at the API edge can pick a status code and name the culprit. All of them
are ``ValueError`` subclasses: bad input to a pure function is a value problem. Bad input is
also the foundation's ``InvalidArgument`` (its field: the argument, or the config key path),
so ``hpd_common.rpc.status_for`` answers it INVALID_ARGUMENT naming the field wherever it
reaches the edge, with no translation by hand on the way.
"""

from __future__ import annotations

from hpd_common.errors import InvalidArgument

__all__ = ["ConfigError", "InvalidInputError", "PolicyError", "UnknownPluginError"]


class PolicyError(ValueError):
    """Base class of every error raised by the policy core."""


class InvalidInputError(PolicyError, InvalidArgument):
    """An argument is out of its domain (negative tokens, zero bandwidth, unknown tier...).

    ``field`` names the argument or request field, for INVALID_ARGUMENT at the edge.
    """

    def __init__(self, field: str, message: str) -> None:
        InvalidArgument.__init__(self, field, message)  # ValueError's comes first in the MRO

    def __reduce__(self) -> tuple[type[InvalidInputError], tuple[str, str]]:
        # rebuilt from its fields, not from ``args`` (one formatted string): the suite's
        # worker processes send errors back pickled
        return (type(self), (self.field, self.message))


class ConfigError(PolicyError, InvalidArgument):
    """A scheduler profile that cannot be loaded.

    ``key_path`` is the dotted path of the offending key in the YAML document, for example
    ``profiles.default.decode.scorers[2].weight``, so an operator can find it at once.
    """

    def __init__(self, key_path: str, message: str) -> None:
        InvalidArgument.__init__(self, key_path, message)  # ValueError's comes first in the MRO
        self.key_path = key_path

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, str]]:
        # as InvalidInputError's: a bad profile in a suite worker reached the parent as
        # "ConfigError.__init__() missing 1 required positional argument" instead of its key
        return (type(self), (self.key_path, self.message))


class UnknownPluginError(ConfigError):
    """A plugin type name that no registered plugin carries."""
