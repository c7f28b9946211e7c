"""A parameter-server shard: plaintext model blocks out, encrypted update blocks in.

The shard owns the blocks the consistent-hash ring gives it. It serves their current
published values (:mod:`server.shard.published_model`), and for the open round it validates
every pushed ciphertext block (exact size, every coefficient below q, the key generation's
context id, ownership, cohort membership, round and version) before adding it into a running
sum modulo q. The sum is one block per owned block, whatever the number of clients; the
manifest records who is in it and with what weight, so a client's block is never counted twice.
Each client's pushed ciphertexts stay in the shard's log (in memory without one) for as long as
the round: the key holder asks for the sum of exactly the clients the round closed with, and
after a failed check for the evidence (:mod:`server.shard.evidence`). A shard never holds a
secret key: it can add ciphertexts, never read them.

With a :class:`~server.shard.shard_log.ShardLog`, every accepted change is logged (and by default
fsynced) before it is acknowledged, and :meth:`Shard.recover` rebuilds the sums, manifests and
published model after a restart; a push retried after a lost acknowledgement finds its blocks
in the manifest and is acknowledged as a duplicate, never added twice.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Collection
from dataclasses import replace

import numpy as np

from crypto import PlainContext, PublicContext, new_sum, pack_sums, unpack_blocks
from crypto.signed_update import SignedUpdate
from crypto.signing import chunk_roots, is_weak_key
from fedps.errors import (
    CorruptStateError,
    InvalidArgumentError,
    NotReadyError,
    RateLimitedError,
    RoundClosedError,
    StaleUpdateError,
    UnknownClientError,
    error_reason,
)
from fedps.learning.staleness import multiplier
from fedps.rpc.messages import Aggregate, Contribution
from fedps.rpc.shard_messages import (
    HeldCiphertext,
    OpenedBlock,
    PushBatch,
    RoundOpening,
    ShardStatus,
    TraceQuery,
)
from fedps.sharding.hash_ring import HashRing
from fedps.sharding.ring_view import RingView
from fedps.sharding.sparse_mask import sent_blocks
from server.shard.evidence import HeldRows, answer_trace
from server.shard.published_model import PublishedModel
from server.shard.round_state import ROOT_BYTES, ClientEntry, RoundState
from server.shard.shard_log import ShardLog, ShardLogRecord

__all__ = ["Shard"]

_log = logging.getLogger("fedps")

_MAX_WEIGHT = 1e6


class Shard:
    """The shard's state and rules, independent of gRPC.

    The rounds live here; the published model the shard serves is :attr:`model`
    (:class:`~server.shard.published_model.PublishedModel`: publish, pull, signatures).

    Parameters
    ----------
    shard_id
        This shard's name on the ring.
    ring
        The cluster's hash ring.
    public_context
        Returns the key holder's public context for a context id (fetched once per key
        generation).
    max_messages_per_round
        Push messages one client may send this shard per round
        (``security.max_pushes_per_round``).
    staleness
        The staleness function of asynchronous mode (None: synchronous rounds).
    max_staleness
        The oldest model version, in versions behind, an asynchronous update may train.
    verify_model
        The key holder's signature check of a published block, ``(version, block, values,
        signature)``; None: publishes are not checked.
    log
        The shard's durable log (None: nothing survives a restart).
    density
        Shared random-k sparsification (``compression.density``, 1: whole updates): an update
        is the first ``ceil(density x blocks)`` blocks
        (:func:`fedps.sharding.sparse_mask.sent_blocks`) and its signed commitment ends with its
        round's mask seed, one more root.
    fields
        Values per coefficient of an update (``compression.bits``' quantized packing; 1: one
        real value): an update of the whole model is ``ceil(blocks / fields)`` blocks.
    standby
        The shard may start off ``ring`` (``cluster.standby``): it owns nothing until the
        operator adds it and a ring with it comes.
    """

    def __init__(
        self,
        shard_id: str,
        ring: HashRing,
        public_context: Callable[[str], PublicContext | PlainContext],
        *,
        max_messages_per_round: int = 64,
        staleness: Callable[[int], float] | None = None,
        max_staleness: int = 0,
        verify_model: Callable[[int, int, bytes, bytes], bool] | None = None,
        log: ShardLog | None = None,
        density: float = 1.0,
        fields: int = 1,
        standby: bool = False,
    ) -> None:
        if shard_id not in ring.nodes and not standby:
            raise InvalidArgumentError(f"{shard_id} is not on the ring {ring.nodes}")
        self.shard_id = shard_id
        self._public_context = public_context
        self._max_messages = max_messages_per_round
        self._staleness = staleness  # None: synchronous rounds
        self._max_staleness = max_staleness
        self._density = density
        self._fields = fields
        sent_blocks(1, density, fields)  # checks them
        self._lock = threading.Lock()
        #: the published model's blocks this shard serves (the key holder publishes them)
        self.model = PublishedModel(shard_id, ring, verify_model=verify_model, log=log)
        self._rounds: dict[int, RoundState] = {}
        self._open: RoundState | None = None
        self._log = log
        self._replaying = False
        self.stats = {"accepted": 0, "duplicates": 0, "refused": 0, "bytes": 0}
        #: refused push messages by reason (:func:`fedps.errors.error_reason`)
        self.refusals: dict[str, int] = {}

    # ------------------------------------------------------------------ durability
    def recover(self) -> int:
        """Rebuild the published model and every kept round from the log.

        Returns the number of records replayed (0 without a log).
        """
        if self._log is None:
            return 0
        saved = self.model.recover()
        replayed = 0
        self._replaying = True
        try:
            for round_, record in self._log.records():
                kind = record.kind
                if record.opening is not None:
                    self.open_opening(record.opening)
                elif record.push is not None:
                    self._replay_push(record.push, record.multiplier)
                elif kind == "close":
                    self.close_round(round_)
                elif kind == "discard":
                    self.discard_round(round_)
                replayed += 1
        finally:
            self._replaying = False
        if replayed or saved:
            _log.info(
                "%s recovered version %d and %d logged changes (rounds %s)",
                self.shard_id,
                self.version,
                replayed,
                sorted(self._rounds),
            )
        return replayed

    def _append(self, round_: int, record: ShardLogRecord) -> None:
        if self._log is not None and not self._replaying:
            self._log.append(round_, record)

    def _replay_push(self, push: PushBatch, multiplier: int) -> None:
        state = self._require(push.round)
        public = self._public_context(state.context_id)
        coefficients = unpack_blocks(public, [data for _, data in push.blocks])
        with self._lock:
            self._add(state, public, push.update, multiplier, push.blocks, coefficients)

    # ------------------------------------------------------------------ rounds
    def open_opening(self, o: RoundOpening) -> None:
        """:meth:`open_round` for an opening as the coordinator sends it (and the log keeps it)."""
        self.open_round(
            o.round,
            o.version,
            o.members,
            o.context_id,
            o.run_id,
            o.commitments,
            ring=RingView.of(o),
        )

    def open_round(
        self,
        round_: int,
        version: int,
        members: dict[str, bytes],
        context_id: str,
        run_id: str = "",
        commitments: dict[str, SignedUpdate] | None = None,
        *,
        ring: RingView | None = None,
    ) -> None:
        """Start accepting pushes for ``round_`` from ``members`` (idempotent).

        ``members`` maps each cohort client to the Ed25519 key it registered;
        ``commitments`` each member's signed update as committed at the key holder (a push
        must carry exactly it); ``ring`` the shard ring the round goes on with. A newer ring
        for the same round (a shard was removed) reopens it as it is, its sums kept: the
        clients push the blocks that moved here.
        """
        ring = ring or RingView()
        commitments = dict(commitments or {})
        if not members:
            raise InvalidArgumentError("a round needs a non-empty cohort")
        if any(c not in members or u.client_id != c for c, u in commitments.items()):
            raise InvalidArgumentError("a commitment belongs to no cohort member")
        if any(is_weak_key(key) for key in members.values()):
            raise InvalidArgumentError("every cohort member needs a valid 32-byte Ed25519 key")
        self._public_context(context_id)  # fetch and validate the key generation now
        opening = ShardLogRecord(
            "open",
            round_,
            opening=RoundOpening(
                round_, version, members, context_id, run_id, commitments, **ring.fields()
            ),
        )
        with self._lock:
            existing = self._rounds.get(round_)
            if existing is not None and (
                existing.version,
                existing.members,
                existing.run_id,
                existing.commitments,
            ) == (version, members, run_id, commitments):
                if ring.carried and ring.version > existing.ring_version:  # closed or not
                    self._append(round_, opening)  # durable first: the moved blocks come here
                    self.model.adopt(ring)  # unless the key holder's publication adopted it
                    existing.closed, existing.ring_version = False, ring.version
                    self._open = existing
                return
            self.model.adopt(ring)  # a newer one; refuses a ring without this shard first
            if (
                existing is not None
                and self._staleness is not None
                and not existing.closed
                and (existing.version, existing.run_id) == (version, run_id)
                and all(existing.members.get(c, k) == k for c, k in members.items())
                and set(existing.members) <= set(members)
            ):
                self._append(round_, opening)
                existing.members.update(members)  # async: clients joined the open buffer
                existing.commitments.update(commitments)
                return
            if existing is not None:
                # A restarted coordinator reopens an unfinished round: start it afresh.
                _log.warning(
                    "%s: round %d reopened; its old sums are discarded", self.shard_id, round_
                )
            self._append(round_, opening)  # durable first: a failed write changes nothing
            if self._open is not None and not self._open.closed:
                _log.warning("%s: round %d replaced by %d", self.shard_id, self._open.round, round_)
                self._open.closed = True
            state = RoundState(round_, version, dict(members), context_id, run_id, commitments)
            state.ring_version = ring.version
            self._rounds[round_] = state
            self._open = state
            # The previous round stays until the next opens (the key holder may fetch it
            # again); older ones are gone from memory and disk.
            for old in [r for r in self._rounds if r < round_ - 1]:
                del self._rounds[old]
            if self._log is not None and not self._replaying:
                self._log.forget_before(round_ - 1)

    def push(self, batch: PushBatch) -> tuple[int, int]:
        """Validate and add one push message; returns ``(accepted, duplicates)``.

        Every block of the message is validated before any is added, so a bad message
        changes nothing.
        """
        try:
            return self._push(batch)
        except (
            InvalidArgumentError,
            NotReadyError,
            RoundClosedError,
            UnknownClientError,
            RateLimitedError,
            StaleUpdateError,
        ) as exc:
            with self._lock:
                self.stats["refused"] += 1
                reason = error_reason(exc)
                self.refusals[reason] = self.refusals.get(reason, 0) + 1
            raise

    def _push(self, batch: PushBatch) -> tuple[int, int]:
        state = self._rounds.get(batch.round)
        if state is None and batch.round > self.open_round_number:
            # Committed clients push as soon as the key holder froze the commitments; the
            # coordinator opens the round here right after (the caller retries UNAVAILABLE).
            raise NotReadyError(f"round {batch.round} is not open on {self.shard_id} yet")
        if state is None or state.closed:
            raise RoundClosedError(f"round {batch.round} is not open on {self.shard_id}")
        if batch.client_id not in state.members:
            raise UnknownClientError(
                f"client {batch.client_id!r} is not in the cohort of round {batch.round}"
            )
        multiplier = self._multiplier(state, batch)
        if batch.context_id != state.context_id:
            raise InvalidArgumentError("ciphertexts use another key generation (context id)")
        if not (math.isfinite(batch.weight) and 0 < batch.weight <= _MAX_WEIGHT):
            raise InvalidArgumentError(f"weight must be in (0, {_MAX_WEIGHT:g}]")
        if not batch.blocks:
            raise InvalidArgumentError("push carries no blocks")
        with self._lock:
            sent = state.messages.get(batch.client_id, 0) + 1
            state.messages[batch.client_id] = sent
        if sent > self._max_messages:
            raise RateLimitedError(
                f"client {batch.client_id!r} sent more than {self._max_messages} push messages "
                f"in round {batch.round}"
            )
        update = self._check_signature(state, batch)
        public = self._public_context(state.context_id)
        owned = set(self.update_blocks)
        seen: set[int] = set()
        for block, _ in batch.blocks:
            if block not in owned:
                raise InvalidArgumentError(
                    f"block {block} is not owned by {self.shard_id} (owner: "
                    f"{self.model.ring.owner(block) if block < self.model.num_blocks else 'none'})"
                )
            if block in seen:
                raise InvalidArgumentError(f"block {block} appears twice in one message")
            seen.add(block)
        coefficients = unpack_blocks(public, [data for _, data in batch.blocks])
        for (block, _), root in zip(batch.blocks, chunk_roots(coefficients), strict=True):
            if root != update.roots[block]:
                raise InvalidArgumentError(
                    f"block {block} does not match the client's signed commitment"
                )
        with self._lock:
            if state.closed:
                raise RoundClosedError(f"round {batch.round} closed during the push")
            known = state.entries.get(batch.client_id)
            fresh = [
                i
                for i, (block, _) in enumerate(batch.blocks)
                if known is None or not known.has(block)
            ]
            if fresh:  # durable before it is added, and before it is acknowledged
                logged = replace(batch, blocks=[batch.blocks[i] for i in fresh])
                record = ShardLogRecord("push", batch.round, push=logged, multiplier=multiplier)
                self._append(batch.round, record)
            blocks = [batch.blocks[i] for i in fresh]
            self._add(state, public, update, multiplier, blocks, coefficients[fresh])
            duplicates = len(batch.blocks) - len(fresh)
            self.stats["duplicates"] += duplicates
            self.stats["bytes"] += sum(len(d) for _, d in batch.blocks)
        return len(fresh), duplicates

    def _add(
        self,
        state: RoundState,
        public: PublicContext | PlainContext,
        update: SignedUpdate,
        multiplier: int,
        blocks: list[tuple[int, bytes]],
        coefficients: np.ndarray,
    ) -> None:
        """Add one client's blocks (number, packed data) into the sums.

        The caller holds the lock.
        """
        if not blocks:
            return
        entry = state.entries.get(update.client_id)
        if entry is None:
            entry = state.entries[update.client_id] = ClientEntry.of(update, multiplier)
        for (block, data), coeffs in zip(blocks, coefficients, strict=True):
            total = state.sums.get(block)
            if total is None:
                total = state.sums[block] = new_sum(public)
            total.add(coeffs, multiplier)
            entry.blocks |= 1 << block
            if self._log is None:  # else the log holds it (Shard.trace reads it back)
                entry.data[block] = data
        self.stats["accepted"] += len(blocks)

    def _multiplier(self, state: RoundState, batch: PushBatch) -> int:
        """The staleness multiplier: 1 in sync mode, the fixed-point staleness weight in async mode.

        In sync mode the update must be for the round's version; in async mode updates older than
        the maximum staleness are refused.
        """
        if self._staleness is None:
            if batch.version != state.version:
                raise InvalidArgumentError(
                    f"round {batch.round} trains version {state.version}, update is for "
                    f"version {batch.version}"
                )
            return 1
        age = state.version - batch.version
        if age < 0:
            raise InvalidArgumentError(f"update is for version {batch.version}, from the future")
        if age > self._max_staleness:
            raise StaleUpdateError(
                f"update trained on version {batch.version} is {age} versions old; "
                f"the maximum staleness is {self._max_staleness}"
            )
        return multiplier(self._staleness, age)

    def _check_signature(self, state: RoundState, batch: PushBatch) -> SignedUpdate:
        """The signed update a push belongs to; verified once per client and round."""
        update = batch.update
        committed = state.commitments.get(batch.client_id)
        if state.commitments and committed != update:
            raise InvalidArgumentError(
                f"push from {batch.client_id!r} is not the update it committed to at the key holder"
            )
        known = state.entries.get(batch.client_id)
        if known is not None:
            if known.signed(batch.client_id) != update:
                raise InvalidArgumentError(
                    f"client {batch.client_id!r} sent a second, different update in this round"
                )
            return update
        sent = sent_blocks(self.model.num_blocks, self._density, self._fields)
        if self._density >= 1 and len(update.roots) != sent:
            raise InvalidArgumentError(
                f"a signed update commits to {len(update.roots)} blocks; an update of the model "
                f"has {sent}"
            )
        if self._density < 1 and len(update.roots) != sent + 1:  # the last: the mask seed
            raise InvalidArgumentError(
                f"a signed update commits to {len(update.roots)} roots; a sparsified update "
                f"has {sent} blocks and its round's mask seed"
            )
        if any(len(root) != ROOT_BYTES for root in update.roots):
            raise InvalidArgumentError(f"every chunk root must be {ROOT_BYTES} bytes")
        key = state.members[batch.client_id]
        if not update.verify(
            key, run_id=state.run_id, round_=state.round, context_id=state.context_id
        ):
            raise InvalidArgumentError(
                f"push from {batch.client_id!r} is unsigned or its signature does not verify"
            )
        return update

    def close_round(self, round_: int) -> list[str]:
        """Stop accepting pushes; return the clients that pushed every owned block."""
        with self._lock:
            state = self._require(round_)
            if not state.closed:
                self._append(round_, ShardLogRecord("close", round_))
            state.closed = True
            owned = self.update_blocks
            if not owned:
                return sorted(state.members)
            return sorted(
                c
                for c, entry in state.entries.items()
                if c in state.members and all(entry.has(b) for b in owned)
            )

    def discard_round(self, round_: int) -> None:
        """Forget an abandoned round's sums; they are never decrypted."""
        with self._lock:
            state = self._require(round_)
            self._append(round_, ShardLogRecord("discard", round_))
            state.closed = True
            state.sums.clear()
            state.entries.clear()

    def aggregates(
        self, round_: int, contributors: Collection[str]
    ) -> tuple[list[Aggregate], list[SignedUpdate]]:
        """The closed round's sum of exactly ``contributors`` for every owned block.

        ``contributors`` are the clients the round closed with; the sums come with manifests and
        signed updates, for the key holder.

        A client that pushed here but is not a contributor (another shard found its pushes
        incomplete) is left out of the sums: every shard sums the same set, so a shard that
        reports fewer complete clients than it has cannot get another one blamed.

        Raises
        ------
        RoundClosedError
            The round is unknown or still open.
        InvalidArgumentError
            A contributor did not push every block this shard owns (or none are named).
        """
        wanted = frozenset(contributors)
        if not wanted:
            raise InvalidArgumentError("name the contributors to sum")
        with self._lock:
            state = self._require(round_)
            if not state.closed:
                raise RoundClosedError(f"round {round_} is still open")
            entries = {c: state.entries.get(c) for c in sorted(wanted)}
            incomplete = [c for c, e in entries.items() if e is None or not e.blocks]
            owned = self.update_blocks
            if incomplete and owned:
                raise InvalidArgumentError(
                    f"{self.shard_id} holds no pushes of {incomplete[:5]} in round {round_}"
                )
            holders = {b: self._holders(state, b, wanted) for b in owned}
            # the usual case, every block summed over exactly the contributors: packed at once
            exact = [b for b in owned if set(holders[b]) == wanted]
            packed = dict(zip(exact, pack_sums([state.sums[b] for b in exact]), strict=True))
            aggregates = [
                self._aggregate(state, b, wanted, holders[b], packed.get(b)) for b in owned
            ]
            return aggregates, [e.signed(c) for c, e in entries.items() if e is not None]

    def _holders(
        self, state: RoundState, block: int, wanted: frozenset[str]
    ) -> dict[str, ClientEntry]:
        """The clients whose block ``block`` is in the sum, every one of ``wanted`` among them.

        The caller holds the lock.
        """
        holders = {c: e for c, e in state.entries.items() if e.has(block)}
        missing = sorted(wanted - set(holders))
        if missing:
            raise InvalidArgumentError(
                f"{self.shard_id} holds no push of block {block} from {missing[:5]}"
            )
        return holders

    def _aggregate(
        self,
        state: RoundState,
        block: int,
        wanted: frozenset[str],
        holders: dict[str, ClientEntry],
        packed: bytes | None,
    ) -> Aggregate:
        """Block ``block``'s sum over ``wanted``, with its manifest (the caller holds the lock).

        ``packed`` is the running sum, packed, when ``holders`` are exactly ``wanted``; None:
        the sum of exactly ``wanted`` is computed again from their pushes.
        """
        if packed is None:  # rarely: someone else's pushes were incomplete; sum exactly the set
            public = self._public_context(state.context_id)
            total = new_sum(public)
            clients = sorted(wanted)
            data = self._pushed(state, [(c, block) for c in clients])
            rows = unpack_blocks(public, [data[c, block] for c in clients])
            for c, row in zip(clients, rows, strict=True):
                total.add(row, holders[c].multiplier)
            packed = total.packed()
        manifest = {
            c: Contribution(e.weight, e.root(block), e.version, e.multiplier)
            for c, e in holders.items()
            if c in wanted
        }
        return Aggregate(block, packed, manifest)

    def trace(self, query: TraceQuery) -> tuple[list[OpenedBlock], list[HeldCiphertext]]:
        """Answer the key holder's :class:`~fedps.rpc.shard_messages.TraceQuery`.

        From the ciphertexts this shard holds (:func:`server.shard.evidence.answer_trace`).

        Raises
        ------
        InvalidArgumentError
            A malformed query (sketches of the wrong size, a plaintext round), or blocks or
            clients this shard holds no pushes of.
        """
        public = self._public_context(self._require(query.round).context_id)

        def held(blocks: Collection[int], clients: Collection[str]) -> HeldRows:
            return self._held_rows(query.round, blocks, clients)

        return answer_trace(query, public, held)

    def _held_rows(
        self, round_: int, blocks: Collection[int], clients: Collection[str]
    ) -> HeldRows:
        """:meth:`_held` (taking the lock), with each ciphertext's validated coefficients."""
        with self._lock:
            held = self._held(round_, blocks, clients)
            public = self._public_context(self._require(round_).context_id)
        if not held:
            return held, np.zeros((0, 0), dtype=np.uint64)
        return held, unpack_blocks(public, [data for _, _, data in held])

    def _held(
        self, round_: int, blocks: Collection[int], clients: Collection[str]
    ) -> list[tuple[str, int, bytes]]:
        """``(client, block, packed)`` of every client's push of every block of round ``round_``.

        The round is closed; the caller holds the lock.

        Raises
        ------
        InvalidArgumentError
            A block this shard does not own, or a client without a push of it here.
        """
        state = self._require(round_)
        if not state.closed:
            raise RoundClosedError(f"round {round_} is still open")
        owned = set(self.update_blocks)
        pairs = []
        for block in sorted(set(blocks)):
            if block not in owned:
                raise InvalidArgumentError(f"block {block} is not owned by {self.shard_id}")
            for client in sorted(set(clients)):
                entry = state.entries.get(client)
                if entry is None or not entry.has(block):
                    raise InvalidArgumentError(
                        f"{self.shard_id} holds no push of block {block} from {client!r}"
                    )
                pairs.append((client, block))
        data = self._pushed(state, pairs)
        return [(client, block, data[client, block]) for client, block in pairs]

    def _pushed(
        self, state: RoundState, pairs: list[tuple[str, int]]
    ) -> dict[tuple[str, int], bytes]:
        """The packed ciphertexts of ``(client, block)`` pairs the shard added in ``state``.

        From memory, or read back from the round's log.
        """
        if self._log is None:
            return {(c, b): state.entries[c].data[b] for c, b in pairs}
        found = self._log.pushed(state.round, set(pairs))
        missing = sorted(set(pairs) - set(found))
        if missing:  # the log is what was acknowledged: it holds every added block
            raise CorruptStateError(
                f"{self.shard_id}: the log of round {state.round} lacks the added push of "
                f"{missing[0]}; restore the log from a backup (docs/operations.md)"
            )
        return found

    def _require(self, round_: int) -> RoundState:
        state = self._rounds.get(round_)
        if state is None:
            raise RoundClosedError(f"round {round_} is unknown to {self.shard_id}")
        return state

    @property
    def open_round_number(self) -> int:
        """The number of the most recent round (0 if none)."""
        return self._open.round if self._open else 0

    @property
    def round_is_open(self) -> bool:
        """Whether the most recent round still accepts pushes."""
        return self._open is not None and not self._open.closed

    def status(self) -> ShardStatus:
        """What this shard reports to the operator."""
        return ShardStatus(
            shard_id=self.shard_id,
            version=self.version,
            blocks=len(self.owned_blocks),
            open_round=self.open_round_number,
            round_open=self.round_is_open,
            pushes_accepted=self.stats["accepted"],
            pushes_refused=self.stats["refused"],
            bytes_received=self.stats["bytes"],
            refusals=dict(self.refusals),
        )

    @property
    def version(self) -> int:
        """The published model's version (0 before the first)."""
        return self.model.version

    @property
    def owned_blocks(self) -> list[int]:
        """Blocks this shard owns in the published model."""
        return list(self.model.owned)

    @property
    def update_blocks(self) -> list[int]:
        """Blocks of an update this shard owns: the model's, or a sparsified update's.

        A sparsified update is the first ``ceil(density x blocks)`` blocks.
        """
        sent = sent_blocks(self.model.num_blocks, self._density, self._fields)
        return [b for b in self.model.owned if b < sent]
