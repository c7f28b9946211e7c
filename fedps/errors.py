"""The fedps error hierarchy: one root, one subclass per expected failure.

The classes know nothing of the wire. Which gRPC status each one crosses the wire with, and how
a caller gets the same class back, is one table in :mod:`fedps.rpc.transport` (``ERROR_STATUS``):
a servicer's :func:`~fedps.rpc.transport.rpc_errors` turns an error into its status with the
error's message, and :func:`~fedps.rpc.transport.call` raises the same class again on the caller's
side. Programming errors stay ordinary Python exceptions.

Every class here can be built from its message alone (``cls(message)``), which is what the
caller's side does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = [
    "ConfigError",
    "CorruptStateError",
    "FedPSError",
    "InvalidArgumentError",
    "NotReadyError",
    "PeerUnavailableError",
    "PolicyError",
    "PrivacyBudgetExceededError",
    "QuarantinedError",
    "RateLimitedError",
    "RoundClosedError",
    "ShardStalledError",
    "StaleUpdateError",
    "UnauthenticatedError",
    "UnknownClientError",
    "error_reason",
]


class FedPSError(Exception):
    """Root of every error fedps raises on purpose."""


class InvalidArgumentError(FedPSError, ValueError):
    """A request is malformed: wrong size, count, parameters or values."""


class ConfigError(InvalidArgumentError):
    """A configuration file or field is invalid.

    ``fields``: the message for each bad field by its dotted name (``training.rounds``; a
    section's name for an error between its fields), where the error came from validation.
    """

    def __init__(self, message: str, *, fields: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.fields: dict[str, str] = dict(fields or {})


class CorruptStateError(FedPSError):
    """A state file or log on disk is damaged (a checksum mismatch, a truncated file).

    The role stops with one line naming the file, keeps the evidence and repairs nothing on its own.
    A local error: it stops the process that reads its own state.
    """


class UnknownClientError(FedPSError):
    """The caller is not a registered client, or not in the current cohort."""


class RoundClosedError(FedPSError):
    """The round or buffer a request names is closed, abandoned or not open yet."""


class StaleUpdateError(RoundClosedError):
    """An asynchronous update is older than the maximum staleness.

    It is too late for any buffer that is open, so a caller that handles a closed round handles it
    too.
    """


class UnauthenticatedError(FedPSError):
    """The caller presented no valid credential."""


class RateLimitedError(InvalidArgumentError):
    """A caller exceeded its per-round request budget."""


class PolicyError(FedPSError):
    """The key holder's decryption policy refuses the request."""


class QuarantinedError(PolicyError):
    """The key holder decrypts nothing more: a shard was caught tampering too often."""


class ShardStalledError(PolicyError):
    """A shard missed its call deadline ``security.max_shard_misses`` times in a row.

    It held the call open, or could not be reached, for that long: every round needs it, so none is
    applied until it answers again. A failure to answer, never evidence of tampering: nothing is
    quarantined, and a round refused for it is applied once the shard answers.
    """


class PrivacyBudgetExceededError(RoundClosedError):
    """A client would spend more than its epsilon budget."""


class PeerUnavailableError(FedPSError):
    """A peer could not be reached."""


class NotReadyError(PeerUnavailableError):
    """The peer is up but not ready yet (no model, no keys).

    Like an unreachable peer, it is worth asking again later.
    """


def error_reason(exc: BaseException) -> str:
    """The kind of ``exc`` as a short snake_case reason.

    ``StaleUpdateError`` -> ``stale_update`` (what refusal counts and metrics are keyed by); a plain
    ``ValueError`` (``INVALID_ARGUMENT`` on the wire) -> ``invalid_argument``.
    """
    if type(exc) is ValueError:
        return "invalid_argument"
    name = type(exc).__name__.removesuffix("Error")
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
