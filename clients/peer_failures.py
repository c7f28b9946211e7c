"""The calls an edge client's peers refused or failed: counted, named and logged, never fatal.

A client outlasts its peers (docs/security.md, claim 20): whatever a shard, the coordinator or
the key holder answers, the call is counted by peer and reason in :class:`PeerFailures`, shown
in the next round's progress line and logged as a warning naming the peer, and the client goes
on, after a pause (:data:`PAUSE_S`, or :func:`failure_backoff` where it asks again). Only
the client's own faults end it (:func:`own_fault`): its configuration or state folder,
as the client found them itself, never a peer that names those error classes
(:func:`from_peer`).
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from pathlib import Path

import grpc

from fedps.errors import (
    ConfigError,
    CorruptStateError,
    FedPSError,
    PeerUnavailableError,
    PolicyError,
    UnauthenticatedError,
    error_reason,
)
from fedps.rpc.transport import Backoff

__all__ = [
    "COORDINATOR",
    "KEY_HOLDER",
    "PAUSE_S",
    "SHARDS",
    "PeerFailures",
    "failure_backoff",
    "failures_text",
    "from_peer",
    "own_fault",
]

#: The peers as counted and logged (a shard by its id).
COORDINATOR, KEY_HOLDER, SHARDS = "coordinator", "key holder", "shards"
#: The pause after a step that failed before training, before the task is asked again.
PAUSE_S = 0.2

_log = logging.getLogger("fedps")
_REFUSALS_SHOWN = 32  # the most refusals one progress line names


class PeerFailures:
    """The calls a client's peers refused or failed, whatever they answered.

    Parameters
    ----------
    name
        The client's display name (for the log).
    identity
        Its identity, named with the enrolment token to check when the coordinator refuses
        its credential.
    tls_directory
        Where its enrolment token and certificate are (``tls.directory``).

    Attributes
    ----------
    counts
        The calls refused or failed, by ``"peer: reason"`` (``"shard-1: invalid_argument"``,
        ``"coordinator: unauthenticated"``); :attr:`total` is their sum.
    """

    def __init__(self, name: str, *, identity: str, tls_directory: Path) -> None:
        self.name = name
        self.identity = identity
        self.tls_directory = tls_directory
        self.counts: Counter[str] = Counter()
        # "peer (reason)" since the last take_refused (the latest, where none is taken)
        self._refused: deque[str] = deque(maxlen=_REFUSALS_SHOWN)

    @property
    def total(self) -> int:
        """How many calls peers refused or failed so far."""
        return self.counts.total()

    def failed(self, peer: str, exc: FedPSError, *, expected: bool = False) -> None:
        """A call ``peer`` refused or failed, whatever it answered: count it and log it.

        The log is a warning unless ``expected`` (a commitment after its round closed: a slow
        client).
        """
        reason = _reason(exc)
        self.counts[f"{peer}: {reason}"] += 1
        self._refused.append(f"{peer} ({reason})")
        hint = ""
        if peer == COORDINATOR and isinstance(exc, UnauthenticatedError | PolicyError):
            hint = (
                f"; if this lasts, check {self.identity}'s enrolment token "
                f"({self.tls_directory}) or certificate"
            )
        _log.log(
            logging.INFO if expected else logging.WARNING,
            "%s: %s refused or failed a call (%s): %s; going on, %s so far%s",
            self.name,
            peer,
            reason,
            exc,
            failures_text(self.total),
            hint,
        )

    def take_refused(self) -> tuple[str, ...]:
        """The refusals since the last call (the last 32), as ``peer (reason)``.

        Forgotten once taken.
        """
        refused = tuple(self._refused)
        self._refused.clear()
        return refused


def failure_backoff() -> Backoff:
    """The pauses of a loop that asks again after a failed step: 0.5 s growing to 10 s, full jitter.

    Such a step is registering, joining, asking for a task.
    """
    return Backoff(first_s=0.5, cap_s=10.0)


def from_peer(exc: FedPSError) -> bool:
    """Whether ``exc`` is a peer's answer: a status received over gRPC or a peer out of reach.

    :func:`fedps.rpc.transport.call` raises its error from the :class:`grpc.RpcError`, whatever
    class the peer named.
    """
    return isinstance(exc.__cause__, grpc.RpcError) or isinstance(exc, PeerUnavailableError)


def own_fault(exc: FedPSError) -> bool:
    """Whether ``exc`` ends the client: its own configuration or state folder, found by itself.

    Its configuration includes refusing the key holder it was pointed at; a peer that names these
    classes says nothing about this client's own files.
    """
    return isinstance(exc, ConfigError | CorruptStateError) and not from_peer(exc)


def failures_text(count: int) -> str:
    """``1 peer failure``, ``3 peer failures``."""
    return f"{count} peer failure{'' if count == 1 else 's'}"


def _reason(exc: FedPSError) -> str:
    """``exc``'s kind, short (:func:`fedps.errors.error_reason`).

    For the root class, the status it came with (``unimplemented``).
    """
    if type(exc) is not FedPSError:
        return error_reason(exc)
    cause = exc.__cause__
    return cause.code().name.lower() if isinstance(cause, grpc.Call) else "error"
