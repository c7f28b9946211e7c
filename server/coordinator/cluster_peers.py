"""The coordinator's calls to the key holder and the shards, in one place.

:class:`ClusterPeers` is the only part of the coordinator (besides its servicer) that builds
or reads protobuf messages: the :class:`~server.coordinator.coordinator.Coordinator` gives it
plain values (round numbers, client ids, signing keys) and gets plain values back. Every call
has a deadline (a call caught in a peer's restart fails and is retried, never hangs) and is
retried until it succeeds or the coordinator stops.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from crypto.signing import model_verifier
from fedps.blocks import BlockLayout
from fedps.config import ClusterConfig
from fedps.errors import FedPSError, PeerUnavailableError
from fedps.parameter_client import ParameterClient
from fedps.proto import common_pb2, keyholder_pb2, keyholder_pb2_grpc, shard_pb2
from fedps.transport import call, call_until, create_channel

__all__ = [
    "AppliedRound",
    "ClusterPeers",
    "Commitments",
    "KeyHolderState",
    "PublicContext",
    "RoundOpening",
]

_log = logging.getLogger("fedps")

_CALL_S = 20.0
_LONG_CALL_S = 300.0  # applying a round decrypts and publishes the whole model
_T = TypeVar("_T")


@dataclass(frozen=True)
class KeyHolderState:
    """The key holder's model: whether it has one, its version, size and last round."""

    initialized: bool
    version: int
    num_params: int
    last_round: int


@dataclass(frozen=True)
class PublicContext:
    """The key holder's current CKKS context id and its Ed25519 model-signing key."""

    context_id: str
    signing_key: bytes


@dataclass(frozen=True)
class Commitments:
    """Who committed to a round at the key holder, and whether the set is frozen."""

    client_ids: frozenset[str]
    frozen: bool
    updates: tuple[common_pb2.SignedUpdate, ...]  # the signed commitments, passed on whole

    def updates_of(self, clients: Collection[str]) -> list[common_pb2.SignedUpdate]:
        """The commitments of ``clients``."""
        return [u for u in self.updates if u.client_id in clients]


@dataclass(frozen=True)
class RoundOpening:
    """A round as the key holder (commit phase) or the shards (push phase) open it."""

    round: int
    version: int  # the model version the round trains on
    run_id: str
    context_id: str  # the CKKS context the updates are encrypted under
    members: Mapping[str, bytes]  # client id -> Ed25519 signing key, sorted by client id


@dataclass(frozen=True)
class AppliedRound:
    """What the key holder published for an applied round."""

    version: int
    noise_multiplier: float  # client level: what the released model carries (0: example level)


class ClusterPeers:
    """The key holder and the shards, as the coordinator calls them.

    Parameters
    ----------
    cluster
        The addresses of the key holder and the shards.
    stop
        Set when the coordinator stops: ends every retry loop.
    """

    def __init__(self, cluster: ClusterConfig, *, stop: threading.Event) -> None:
        self._stop = stop
        self._params = ParameterClient(dict(zip(cluster.shard_ids, cluster.shards, strict=True)))
        self._keyholder = keyholder_pb2_grpc.KeyHolderStub(create_channel(cluster.keyholder))

    def retry(self, fn: Callable[[], _T], what: str, retry_on: type[FedPSError] = FedPSError) -> _T:
        """Call until it succeeds (or the coordinator stops), retrying ``retry_on`` errors."""
        return call_until(fn, what, retry_on=retry_on, stop=self._stop)

    # ------------------------------------------------------------------ the key holder
    def model_state(self) -> KeyHolderState:
        """The key holder's model state (waits for the key holder)."""
        state = self.retry(
            lambda: self._keyholder.GetModelState(common_pb2.Empty(), timeout=_CALL_S),
            "key holder state",
        )
        return KeyHolderState(state.initialized, state.version, state.num_params, state.last_round)

    def public_context(self) -> PublicContext:
        """The key holder's current context id and model-signing key."""
        reply = self.retry(
            lambda: self._keyholder.GetPublicContext(common_pb2.Empty(), timeout=_CALL_S),
            "public context",
        )
        return PublicContext(reply.context_id, bytes(reply.signing_key))

    def initialize(
        self, layout: BlockLayout, vector: np.ndarray, version: int, *, force: bool
    ) -> int:
        """Give the key holder the model ``vector`` at ``version`` (``force``: replace its
        own); returns the version it publishes."""
        blocks = [
            common_pb2.ParameterBlock(
                block=b,
                version=version,
                values=layout.block_of(vector, b).astype("<f4").tobytes(),
            )
            for b in range(layout.num_blocks)
        ]
        request = keyholder_pb2.InitializeRequest(
            num_params=layout.num_params, blocks=blocks, force=force, version=version
        )
        state = self.retry(
            lambda: self._keyholder.InitializeModel(iter([request]), timeout=_LONG_CALL_S),
            "initialise model",
        )
        return int(state.version)

    def open_commits(self, opening: RoundOpening) -> None:
        """Open a round's commit phase at the key holder for ``opening.members``.

        Raises
        ------
        FedPSError
            If the key holder refuses (e.g. it froze this round for another cohort).
        """
        request = keyholder_pb2.OpenCommitsRequest(
            round=opening.round,
            version=opening.version,
            run_id=opening.run_id,
            context_id=opening.context_id,
            members=_members(opening.members),
        )
        self.retry(
            lambda: self._keyholder.OpenCommits(request, timeout=_CALL_S),
            f"open commitments of round {opening.round}",
            retry_on=PeerUnavailableError,
        )

    def commitments(self, round_: int, *, freeze: bool) -> Commitments:
        """Who committed to ``round_`` so far; with ``freeze``, accept no commitment after."""
        what = "freeze commitments" if freeze else "commitments"
        request = keyholder_pb2.CloseCommitsRequest(round=round_, freeze=freeze)
        reply = self.retry(
            lambda: self._keyholder.CloseCommits(request, timeout=_CALL_S),
            f"{what} of round {round_}",
        )
        return Commitments(frozenset(reply.client_ids), reply.frozen, tuple(reply.updates))

    def apply_round(
        self, round_: int, version: int, *, run_id: str, members: Mapping[str, bytes]
    ) -> AppliedRound:
        """Ask the key holder to check, decrypt and apply exactly ``members``' sum.

        Raises
        ------
        FedPSError
            A policy refusal, or an aggregate that cannot be decrypted (a key holder or shard
            that is restarting only delays the round).
        """
        request = keyholder_pb2.ApplyRoundRequest(
            round=round_, version=version, run_id=run_id, members=_members(members)
        )
        reply = self.retry(
            lambda: self._keyholder.ApplyRound(request, timeout=_LONG_CALL_S),
            f"apply round {round_}",
            retry_on=PeerUnavailableError,
        )
        return AppliedRound(reply.version, reply.noise_multiplier)

    # ------------------------------------------------------------------ the shards
    def open_round(self, opening: RoundOpening, updates: list[common_pb2.SignedUpdate]) -> None:
        """Open a round on every shard for ``opening.members`` and their commitments."""
        request = shard_pb2.OpenRoundRequest(
            round=opening.round,
            version=opening.version,
            members=_members(opening.members),
            context_id=opening.context_id,
            run_id=opening.run_id,
            commitments=updates,
        )
        for sid, stub in self._params.stubs.items():
            self.retry(lambda: stub.OpenRound(request, timeout=_CALL_S), f"open round on {sid}")  # noqa: B023

    def close_round(self, round_: int, cohort: frozenset[str]) -> set[str]:
        """Close ``round_`` on every shard; returns the clients of ``cohort`` whose pushes
        every shard holding blocks found complete."""
        accepted = set(cohort)
        request = shard_pb2.CloseRoundRequest(round=round_)
        for sid, stub in self._params.stubs.items():
            reply = self.retry(
                lambda: stub.CloseRound(request, timeout=_CALL_S),  # noqa: B023
                f"close round on {sid}",
            )
            if reply.blocks:
                accepted &= set(reply.complete_clients)
        return accepted

    def discard_round(self, round_: int) -> None:
        """Discard ``round_``'s sums on every shard (one attempt each; a failure is logged)."""
        request = shard_pb2.CloseRoundRequest(round=round_)
        for sid, stub in self._params.stubs.items():
            try:
                call(lambda: stub.DiscardRound(request, timeout=_CALL_S), f"discard round on {sid}")  # noqa: B023
            except FedPSError as exc:
                _log.warning("could not discard round %d on %s: %s", round_, sid, exc)

    def pull_model(
        self, layout: BlockLayout, min_version: int, signing_key: bytes | None
    ) -> np.ndarray:
        """The published model (one attempt), every block's key-holder signature checked
        against ``signing_key`` when there is one."""
        verify = model_verifier(signing_key) if signing_key is not None else None
        vector, _ = self._params.pull(layout, min_version, verify=verify)
        return vector


def _members(members: Mapping[str, bytes]) -> list[common_pb2.CohortMember]:
    return [common_pb2.CohortMember(client_id=c, signing_key=k) for c, k in members.items()]
