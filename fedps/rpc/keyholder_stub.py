"""The typed client of the key holder: the wire twin of the key holder's servicer.

One method per RPC of ``keyholder.proto``, taking and returning the plain records of
:mod:`fedps.rpc.keyholder_messages`; the channel, each call's deadline, the status -> exception
mapping and (``retry_s``) the wait for a restarting key holder live here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from crypto.signing import context_digest, verify_block
from fedps.errors import InvalidArgumentError
from fedps.proto import common_pb2, keyholder_pb2, keyholder_pb2_grpc
from fedps.rpc.keyholder_messages import (
    AppliedRound,
    CommitClosing,
    CommitOpening,
    CommitSet,
    ModelState,
    ModelUpload,
    PublicContextInfo,
    RoundApplication,
    RoundChallenge,
    UpdateCommitment,
)
from fedps.rpc.service_call import invoke
from fedps.rpc.transport import create_channel

__all__ = ["APPLY_S", "CALL_S", "KeyHolderStub", "verified_signing_key"]

_log = logging.getLogger("fedps")

#: Default deadline of a call.
CALL_S = 20.0
#: Deadline of applying a round or initialising the model (decrypts and publishes it all).
APPLY_S = 300.0


class KeyHolderStub:
    """Calls the key holder at ``address``.

    Every method takes ``timeout_s``, the call's deadline, and ``retry_s``: how long a
    transient failure of the key holder (unreachable, restarting, failed inside, such as a
    full disk: :func:`fedps.rpc.transport.is_transient`) is retried (``None``: fail at once).
    """

    def __init__(self, address: str) -> None:
        self._channel = create_channel(address)
        self._stub = keyholder_pb2_grpc.KeyHolderStub(self._channel)

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def get_public_context(
        self, *, timeout_s: float = CALL_S, retry_s: float | None = None
    ) -> PublicContextInfo:
        """The public context, its id and the key holder's signature over them."""
        reply = invoke(
            lambda: self._stub.GetPublicContext(common_pb2.Empty(), timeout=timeout_s),
            "public context",
            retry_s,
        )
        return PublicContextInfo.from_proto(reply)

    def initialize_model(
        self,
        uploads: Sequence[ModelUpload],
        *,
        timeout_s: float = APPLY_S,
        retry_s: float | None = None,
    ) -> ModelState:
        """Set the initial model unless the key holder has one (the chief's call)."""
        requests = [u.to_proto() for u in uploads]
        reply = invoke(
            lambda: self._stub.InitializeModel(iter(requests), timeout=timeout_s),
            "initialise model",
            retry_s,
        )
        return ModelState.from_proto(reply)

    def apply_round(
        self,
        application: RoundApplication,
        *,
        timeout_s: float = APPLY_S,
        retry_s: float | None = None,
    ) -> AppliedRound:
        """Verify, decrypt and apply a closed round; publish the next version."""
        request = application.to_proto()
        reply = invoke(
            lambda: self._stub.ApplyRound(request, timeout=timeout_s),
            f"apply round {application.round}",
            retry_s,
        )
        return AppliedRound.from_proto(reply)

    def get_model_state(
        self, *, timeout_s: float = CALL_S, retry_s: float | None = None
    ) -> ModelState:
        """The model's version and size, and the tampering detected."""
        reply = invoke(
            lambda: self._stub.GetModelState(common_pb2.Empty(), timeout=timeout_s),
            "key holder state",
            retry_s,
        )
        return ModelState.from_proto(reply)

    def open_commits(
        self, opening: CommitOpening, *, timeout_s: float = CALL_S, retry_s: float | None = None
    ) -> None:
        """Start a round's commit phase for its cohort."""
        request = opening.to_proto()
        invoke(
            lambda: self._stub.OpenCommits(request, timeout=timeout_s),
            f"open commitments of round {opening.round}",
            retry_s,
        )

    def get_challenge(
        self,
        round_: int,
        client_id: str,
        *,
        timeout_s: float = CALL_S,
        retry_s: float | None = None,
    ) -> RoundChallenge:
        """The round's secret challenge seed and this member's pad seed (32 bytes each)."""
        request = keyholder_pb2.ChallengeRequest(round=round_, client_id=client_id)
        reply = invoke(
            lambda: self._stub.GetChallenge(request, timeout=timeout_s), "challenge", retry_s
        )
        return RoundChallenge.from_proto(reply)

    def commit(
        self,
        commitment: UpdateCommitment,
        *,
        timeout_s: float = CALL_S,
        retry_s: float | None = None,
    ) -> None:
        """Commit a signed update and its sketches before any ciphertext is pushed."""
        request = commitment.to_proto()
        invoke(lambda: self._stub.Commit(request, timeout=timeout_s), "commit", retry_s)

    def close_commits(
        self, closing: CommitClosing, *, timeout_s: float = CALL_S, retry_s: float | None = None
    ) -> CommitSet:
        """Who committed so far; with ``closing.freeze``, no commitment is accepted after."""
        request = closing.to_proto()
        what = f"{'freeze ' if closing.freeze else ''}commitments of round {closing.round}"
        reply = invoke(lambda: self._stub.CloseCommits(request, timeout=timeout_s), what, retry_s)
        return CommitSet.from_proto(reply)


def verified_signing_key(
    ctx: PublicContextInfo, *, pinned: str, refusing: str, who: str = "key holder key"
) -> bytes:
    """The key holder's signing key, from its public context ``ctx``.

    The one ``pinned`` (hex, ``security.keyholder_key``) when set, else trusted on first use with a
    warning naming ``who`` asks; the context's signature is verified with it.

    Raises
    ------
    InvalidArgumentError
        Another key than the pinned one, or a context whose signature does not verify; the
        message ends "refusing ``refusing``".
    """
    if pinned and bytes.fromhex(pinned) != ctx.signing_key:
        raise InvalidArgumentError(
            "the key holder's signing key does not match security.keyholder_key (pinned); "
            f"refusing {refusing}"
        )
    if not pinned:
        _log.warning(
            "%s not pinned (security.keyholder_key); trusting %s on first use",
            who,
            ctx.signing_key.hex()[:16],
        )
    if not verify_block(
        ctx.signing_key, context_digest(ctx.context, ctx.context_id), ctx.signature
    ):
        raise InvalidArgumentError(
            f"the key holder's public context does not verify; refusing {refusing}"
        )
    return bytes(ctx.signing_key)
