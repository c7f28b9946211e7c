"""The plain records of ``keyholder.proto``, each with its one conversion to and from the wire.

:class:`~fedps.rpc.keyholder_stub.KeyHolderStub` sends and receives them; the key holder's
servicer and commit log decode into them and encode from them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from crypto.signed_update import SignedUpdate
from fedps.proto import keyholder_pb2
from fedps.rpc.messages import (
    MEMBERS,
    SIGNED_UPDATE,
    SIGNED_UPDATES,
    Converter,
    ParameterBlock,
    WireRecord,
    records_of,
)

__all__ = [
    "AppliedRound",
    "CommitClosing",
    "CommitOpening",
    "CommitSet",
    "ModelState",
    "ModelUpload",
    "PublicContextInfo",
    "RoundApplication",
    "RoundChallenge",
    "UpdateCommitment",
]


@dataclass(frozen=True)
class CommitOpening(WireRecord[keyholder_pb2.OpenCommitsRequest]):
    """The coordinator opens a round's commit phase for a cohort (client id -> Ed25519 key)."""

    wire = keyholder_pb2.OpenCommitsRequest
    nested: ClassVar[Mapping[str, Converter]] = {"members": MEMBERS}

    round: int
    version: int
    run_id: str
    context_id: str
    members: dict[str, bytes]
    #: the shard ring it goes with (:class:`~fedps.sharding.ring_view.RingView`; 0 and none: none)
    ring_version: int = 0
    ring_nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class UpdateCommitment(WireRecord[keyholder_pb2.CommitRequest]):
    """A client's commitment to a round.

    Its signed update and its ciphertexts' sketches (little-endian uint64, sketch count x blocks).
    """

    wire = keyholder_pb2.CommitRequest
    nested: ClassVar[Mapping[str, Converter]] = {"update": SIGNED_UPDATE}

    round: int
    update: SignedUpdate
    sketches: bytes = b""


@dataclass(frozen=True, slots=True)
class RoundChallenge(WireRecord[keyholder_pb2.Challenge]):
    """What a cohort member asks the key holder for before it encrypts.

    The round's secret challenge seed (:class:`crypto.sketch.Challenge`), which every member
    sketches under, and the member's own pad seed (:mod:`crypto.blinding`), which only it gets.
    """

    wire = keyholder_pb2.Challenge

    round: int
    seed: bytes
    pad_seed: bytes


@dataclass(frozen=True, slots=True)
class CommitClosing(WireRecord[keyholder_pb2.CloseCommitsRequest]):
    """Ask who committed to ``round``; with ``freeze``, accept no commitment after."""

    wire = keyholder_pb2.CloseCommitsRequest

    round: int
    freeze: bool


@dataclass(frozen=True)
class CommitSet(WireRecord[keyholder_pb2.CommitSet]):
    """The clients committed so far, and whether the phase is frozen.

    Once frozen, each committed signed update by client id; and the clients excluded for good
    (blamed on evidence).
    """

    wire = keyholder_pb2.CommitSet
    nested: ClassVar[Mapping[str, Converter]] = {"updates": SIGNED_UPDATES}

    client_ids: tuple[str, ...]
    frozen: bool
    updates: tuple[SignedUpdate, ...] = ()
    #: clients blamed on evidence: excluded from every later round
    excluded: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PublicContextInfo(WireRecord[keyholder_pb2.PublicContextReply]):
    """The key holder's public context, its id, its Ed25519 key and its signature.

    See :func:`crypto.signing.context_digest`.
    """

    wire = keyholder_pb2.PublicContextReply

    context: bytes
    context_id: str
    signing_key: bytes
    signature: bytes


@dataclass(frozen=True)
class ModelUpload(WireRecord[keyholder_pb2.InitializeRequest]):
    """The chief's initial model (one message of it: some of its blocks)."""

    wire = keyholder_pb2.InitializeRequest
    nested: ClassVar[Mapping[str, Converter]] = {"blocks": records_of(ParameterBlock)}

    num_params: int
    blocks: tuple[ParameterBlock, ...]
    force: bool = False
    version: int = 0
    #: the shard ring it goes with (:class:`~fedps.sharding.ring_view.RingView`; 0 and none: none)
    ring_version: int = 0
    ring_nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelState(WireRecord[keyholder_pb2.ModelState]):
    """The key holder's model.

    Version, size, last applied round, the tampering it detected by shard (with the shards it no
    longer decrypts for), and the fetches of each shard that missed their deadline (with the shards
    that missed too many in a row).
    """

    wire = keyholder_pb2.ModelState

    version: int
    num_params: int
    initialized: bool
    last_round: int
    detections: dict[str, int] = field(default_factory=dict)
    quarantined: tuple[str, ...] = ()
    #: the detections by reason, summed over the shards
    detection_reasons: dict[str, int] = field(default_factory=dict)
    #: the fetches of each shard that missed their deadline, since the key holder started
    shard_misses: dict[str, int] = field(default_factory=dict)
    #: the shards that missed ``security.max_shard_misses`` in a row, not answered since
    stalled: tuple[str, ...] = ()
    #: clients blamed on evidence (what they did), excluded from every later round
    blamed: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RoundApplication(WireRecord[keyholder_pb2.ApplyRoundRequest]):
    """The coordinator asks to apply ``round`` (trained on ``version``).

    With exactly the clients it closed with.
    """

    wire = keyholder_pb2.ApplyRoundRequest
    nested: ClassVar[Mapping[str, Converter]] = {"members": MEMBERS}

    round: int
    version: int
    run_id: str
    members: dict[str, bytes]
    #: the shard ring it goes with (:class:`~fedps.sharding.ring_view.RingView`; 0 and none: none)
    ring_version: int = 0
    ring_nodes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class AppliedRound(WireRecord[keyholder_pb2.ApplyRoundReply]):
    """What applying a round released.

    The new version, the fewest contributors of any block, block 0's total weight, the update's norm
    and (client-level DP) the noise; and the seconds the call spent in each phase
    (:data:`fedps.round_timer.KEYHOLDER_PHASES`).
    """

    wire = keyholder_pb2.ApplyRoundReply

    version: int
    fewest_contributors: int
    total_weight: float
    update_norm: float
    noise_multiplier: float = 0.0
    top_up_std: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    #: the clients the round was applied with, sorted (empty from an older key holder)
    contributors: tuple[str, ...] = ()
