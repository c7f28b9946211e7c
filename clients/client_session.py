"""An edge client's session: who it is to the run and the channels it talks over.

:class:`ClientSession` holds what an update needs around it but not inside it: the client's
enrolment token and signing key, its registration with the coordinator (through an
:class:`Uplink`) and the tasks it asks for, the channels to the key holder and the shards,
the hash ring that says which shard owns a block, and the key holder's public context with
its encryptor, fetched and verified when the client joins a run and again when a round names
a new one (the key holder rotated its keys).

The session is also what the coordinator hears from the client between rounds: the spend
recorded in its privacy ledger goes with every registration and task request, and a round
ends with its report.

A context fetched after a rotation is verified against the key holder's signing key the
session already holds (trusted on first use unless ``security.keyholder_key`` pins it): a
rotation changes the encryption key, never the signing key.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Protocol, TypeVar

import numpy as np

from clients.peer_failures import (
    COORDINATOR,
    KEY_HOLDER,
    PAUSE_S,
    PeerFailures,
    failure_backoff,
    own_fault,
)
from clients.privacy_ledger import PrivacyLedger
from crypto import PLAINTEXT_CONTEXT_ID, BlockEncryptor, PlainContext, PublicContext
from crypto.enrolment import TOKEN_SUFFIX, read_token
from crypto.signing import model_verifier
from fedps.ckks_params import ckks_params, quantized_packing
from fedps.config import FedPSConfig, TlsConfig
from fedps.errors import ConfigError, FedPSError, InvalidArgumentError, UnknownClientError
from fedps.rpc.coordinator_messages import (
    Assignment,
    AssignmentQuery,
    ClientRegistration,
    RegistrationReply,
    UpdateReport,
)
from fedps.rpc.keyholder_stub import KeyHolderStub, verified_signing_key
from fedps.rpc.model_reader import ModelReader
from fedps.sharding.blocks import BlockLayout, flatten_model
from fedps.sharding.hash_ring import HashRing
from fedps.sharding.ring_view import RingView
from fedps.sharding.sparse_mask import sent_blocks, upload_layout

__all__ = ["LONG_POLL_S", "ClientSession", "Uplink", "pause", "read_enrolment_token"]

_log = logging.getLogger("fedps")
#: How long a waiting client lets the coordinator hold its ``GetTask`` call (a long poll).
LONG_POLL_S = 2.0
_T = TypeVar("_T")
_UNKNOWN = "{}: not known before the client connected and joined a run"


def pause(task: Assignment) -> None:
    """Wait what a WAIT answer asks before the next ``GetTask``.

    Nothing after a held call, which has waited already; at least 50 ms otherwise.
    """
    if task.retry_after > 0:
        time.sleep(max(0.05, task.retry_after))


class Uplink(Protocol):
    """What an edge client asks of whoever runs the rounds.

    Its registration, its next task, and its report of a round. The default is the coordinator over
    gRPC (:class:`fedps.rpc.coordinator_stub.CoordinatorStub`). ``retry_s``: how long a transient
    failure is retried (``None``: fail at once).

    :meth:`EdgeClient.run <clients.edge_client.EdgeClient.run>` and
    :meth:`~clients.edge_client.EdgeClient.run_task` use it, and
    :meth:`~clients.edge_client.EdgeClient.train_round` to announce the round's spend
    (``announce=True``). A caller that drives the rounds itself (a Flower node, whose
    strategy's messages carry each step) calls ``train_round(..., announce=False)`` and
    :meth:`~clients.edge_client.EdgeClient.send`, and carries the spend and the report in its
    own replies.
    """

    def register(
        self, registration: ClientRegistration, *, retry_s: float | None = None
    ) -> RegistrationReply:
        """Register the client: the reply gives its id, its run, its peers and its credential."""

    def get_task(self, query: AssignmentQuery, *, retry_s: float | None = None) -> Assignment:
        """The client's next task."""

    def report_update(self, report: UpdateReport, *, retry_s: float | None = None) -> None:
        """Report a round."""

    def close(self) -> None:
        """Release what the uplink holds (a channel)."""


def read_enrolment_token(tls: TlsConfig, identity: str, *, required: bool) -> str:
    """``identity``'s enrolment token from ``tls.directory``.

    Empty if there is none and none is ``required``.

    Raises
    ------
    ConfigError
        The token is ``required`` and not there.
    """
    token = read_token(tls.directory, identity)
    if token is None and required:
        path = tls.directory / f"{identity}{TOKEN_SUFFIX}"
        raise ConfigError(
            f"without TLS a client needs its enrolment token: {path} not found; "
            "create it with `fedps certs`"
        )
    return token or ""


class ClientSession:
    """A client's identity in a run and its channels to the other roles.

    Building it opens nothing: :meth:`register` introduces the client to the coordinator,
    :meth:`connect` opens the channels to the key holder and the shards, and :meth:`join`
    fetches and adopts the key holder's public context for a run (:meth:`start` does all
    three, as the coordinator says). Every call to the
    coordinator carries the spend the ledger recorded (:meth:`poll_task`,
    :meth:`announce_spend`, :meth:`sit_out`, :meth:`report`).

    Parameters
    ----------
    config
        The cluster configuration.
    name
        The client's display name (for the log).
    enrolment_token
        The token that proves the client's identity (empty: its certificate does).
    ledger
        The client's privacy ledger: its state holds the signing key, its trainer the
        examples and parameters registered, and its recorded spend goes with every
        registration and task request.
    failures
        Where the key holder's refusals of a new context are counted.
    uplink
        Where the client registers and asks for tasks.
    peer_wait_s
        How long a call to a peer retries its transient failures.

    Attributes
    ----------
    client_id, run_id
        The id the coordinator gave the client and the run it joined (empty before).
    keyholder_key
        The key holder's signing key, once its public context verified.
    context_id
        The id of the public context the client encrypts under.
    """

    def __init__(
        self,
        config: FedPSConfig,
        *,
        name: str,
        enrolment_token: str,
        ledger: PrivacyLedger,
        failures: PeerFailures,
        uplink: Uplink,
        peer_wait_s: float,
    ) -> None:
        self.config = config
        #: the quantized packing of ``compression.bits`` (None: one real value per coefficient)
        self.packing = quantized_packing(config)
        self.name = name
        self.enrolment_token = enrolment_token
        self.ledger = ledger
        self.signer = ledger.state.signer
        self.failures = failures
        self.uplink = uplink
        self.peer_wait_s = peer_wait_s
        self.num_params = flatten_model(ledger.trainer.model).size
        self.client_id = ""
        self.run_id = ""
        self.keyholder_key = b""
        self.context_id = ""
        # Known once connected (connect) and joined to a run (join):
        self._keyholder: KeyHolderStub | None = None
        self._params: ModelReader | None = None
        self._ring: HashRing | None = None
        self.ring_view = RingView()  #: the shard ring's version and shards (after connect)
        self._values_per_block = 0
        self._encryptor: BlockEncryptor | PlainContext | None = None
        self._layout: BlockLayout | None = None

    # ------------------------------------------------------------------ the coordinator
    def start(self, deadline: float) -> bool:
        """Register, connect to the key holder and the shards the coordinator names, join its run.

        Whatever a peer answers is counted and asked again after a backoff, until ``deadline``
        (``time.time()``). False: the deadline passed first. Raises what the client's own
        configuration refuses (the coordinator's TLS certificate, the key holder's context:
        :meth:`fetch_context`).
        """
        backoff = failure_backoff()
        while (left := deadline - time.time()) > 0:
            try:
                reply = self.register(left)
                self.connect(
                    reply.keyholder,
                    reply.shards,
                    virtual_nodes=reply.virtual_nodes,
                    ring=RingView.of(reply),
                )
            except FedPSError as exc:
                if own_fault(exc):  # e.g. our TLS configuration refuses the coordinator
                    raise
                self.failures.failed(COORDINATOR, exc)
            else:
                try:
                    self.join(run_id=reply.run_id, client_id=self.client_id, timeout_s=left)
                    return True
                except FedPSError as exc:  # its public context: unreachable, or refused
                    if own_fault(exc):  # our configuration refuses that key holder
                        raise
                    self.failures.failed(KEY_HOLDER, exc)
            backoff.pause()
        _log.warning("%s: joined no run before its timeout", self.name)
        return False

    def register(self, timeout_s: float) -> RegistrationReply:
        """Register with the coordinator, carrying the recorded spend and what it trains.

        What it trains (its data's fingerprint, one round's DP-SGD) is what the coordinator's
        privacy ledger records for each round released with it.

        It waits out the coordinator's restarts up to ``timeout_s``. A coordinator that runs another
        run than the one joined (it lost its state) is warned about, and its run is taken.
        """
        trainer = self.ledger.trainer
        registration = ClientRegistration(
            name=self.name,
            num_examples=trainer.num_examples,
            num_params=self.num_params,
            signing_key=self.signer.public_key,
            enrolment_token=self.enrolment_token,
            epsilon=self.ledger.epsilon,
            delta=self.config.privacy.delta,
            data_source=self.ledger.data,
            noise_multiplier=trainer.noise_multiplier,
            sample_rate=trainer.sample_rate,
            steps_per_round=self._steps_per_round(),
        )
        reply = self.uplink.register(registration, retry_s=timeout_s)
        self.client_id = reply.client_id
        trainer.set_run(reply.run_id)
        if self.run_id and reply.run_id != self.run_id:  # a coordinator that lost its state
            _log.warning(
                "%s: the coordinator runs %s now, not %s", self.name, reply.run_id, self.run_id
            )
            self.run_id = reply.run_id
        return reply

    def _steps_per_round(self) -> int:
        """DP-SGD steps one round takes (example level; 0 otherwise: a global round is one).

        What the coordinator's privacy ledger records for each round released with us.
        """
        if self.config.privacy.level != "example":
            return 0
        trainer = self.ledger.trainer
        after = sum(n for _, _, n in trainer.history_after_next_round())
        return max(0, after - sum(n for _, _, n in trainer.history()))

    def poll_task(
        self, *, retry_s: float | None = None, wait_s: float = 0.0, committed_round: int = 0
    ) -> Assignment:
        """One ``GetTask`` call, carrying the spend recorded in the ledger.

        Retried while the coordinator is unavailable, up to ``retry_s``. ``wait_s``: while the
        answer would be WAIT, the coordinator may hold the call this long and answer as soon as
        the task changes (a long poll; :data:`LONG_POLL_S` for a client that only waits).
        ``committed_round``: the round we committed to and wait to push (0: none).
        """
        query = AssignmentQuery(
            self.client_id,
            self.ledger.epsilon,
            self.config.privacy.delta,
            wait_s=wait_s,
            committed_round=committed_round,
        )
        task = self.uplink.get_task(query, retry_s=retry_s)
        self.follow_ring(RingView.of(task))  # the coordinator's ring (it removes gone shards)
        return task

    def announce_spend(self) -> bool:
        """Tell the coordinator the recorded spend (every ``GetTask`` call carries it).

        False: it could not be told (counted, and after a pause), or it restarted without us (we
        registered again, which carries the spend).
        """
        try:
            self.poll_task(retry_s=self.peer_wait_s)
        except UnknownClientError:
            self.register(self.peer_wait_s)
            return False
        except FedPSError as exc:
            self.failures.failed(COORDINATOR, exc)
            time.sleep(PAUSE_S)
            return False
        return True

    def sit_out(self, round_: int, *, final: bool) -> None:
        """Rounds up to ``round_`` finished without us.

        At client level they count in our spend all the same (:meth:`PrivacyLedger.sit_out
        <clients.privacy_ledger.PrivacyLedger.sit_out>`). The next ``GetTask`` carries the spend to
        the coordinator, or (``final``: the run is done) one last call does.
        """
        if self.ledger.sit_out(round_) and final:
            try:
                self.poll_task()
            except FedPSError as exc:  # the ledger has it; a next registration carries it
                _log.info("%s: cannot tell the coordinator its final spend: %s", self.name, exc)

    def report(
        self,
        round_: int,
        *,
        pushed: int,
        weight: float,
        budget_exhausted: bool = False,
        metrics: dict[str, float] | None = None,
        phase_seconds: dict[str, float] | None = None,
    ) -> None:
        """Report a round to the coordinator.

        The report carries the update's weight, the recorded spend, the bytes the shards took
        (``pushed``), whether the budget is spent, the trainer's noise multiplier, with
        ``task.client_eval`` the ``metrics``, and the seconds of the round's phases
        (``phase_seconds``, :data:`fedps.round_timer.CLIENT_PHASES`). A refusal is counted.

        Raises
        ------
        UnknownClientError
            The coordinator restarted without us (the task loop registers again).
        """
        report = UpdateReport(
            client_id=self.client_id,
            round=round_,
            weight=weight,
            epsilon=self.ledger.epsilon,
            delta=self.config.privacy.delta,
            bytes_pushed=pushed,
            budget_exhausted=budget_exhausted,
            noise_multiplier=self.ledger.trainer.noise_multiplier,
            metrics=metrics or {},
            phase_seconds=phase_seconds or {},
        )
        try:
            self.uplink.report_update(report, retry_s=self.peer_wait_s)
        except UnknownClientError:
            raise
        except FedPSError as exc:
            self.failures.failed(COORDINATOR, exc)

    def next_train_task(self, round_: int, timeout_s: float = 60.0) -> Assignment | None:
        """The task of the next round (buffer) after ``round_`` that asks us to train.

        None if none comes within ``timeout_s``.
        """
        until = time.time() + timeout_s
        while time.time() < until:
            task = self.poll_task(retry_s=timeout_s, wait_s=LONG_POLL_S)
            if task.kind == "done":
                return None
            if task.kind == "train" and task.round > round_:
                return task
            pause(task)
        return None

    # ------------------------------------------------------------------ channels
    def connect(
        self,
        keyholder: str,
        shards: Mapping[str, str],
        *,
        virtual_nodes: int,
        ring: RingView | None = None,
    ) -> None:
        """Open channels to the key holder and the shards.

        The shards are ``{shard_id: address}``, every configured one; ``ring`` the shards on the
        hash ring with ``virtual_nodes`` points each, which assigns the blocks (None or a ring
        without shards: all of them, version 0).
        """
        self.disconnect()
        self._keyholder = KeyHolderStub(keyholder)
        self._params = ModelReader(dict(shards))
        if ring is None or not ring.carried:
            ring = RingView.configured(sorted(shards))
        self._ring = ring.ring(virtual_nodes)
        self.ring_view = ring

    def follow_ring(self, view: RingView) -> None:
        """Pull from and push to the shards of ``view`` from now on, if it is a newer ring."""
        if self._ring is None or not view.newer_than(self.ring_view):
            return
        self._ring, self.ring_view = view.ring(self._ring.virtual_nodes), view
        _log.info("%s: shard ring version %d: %s", self.name, view.version, ", ".join(view.nodes))

    @property
    def connected(self) -> bool:
        """Whether :meth:`connect` opened channels that :meth:`disconnect` has not closed."""
        return self._params is not None

    def join(self, *, run_id: str, client_id: str, timeout_s: float = 60.0) -> None:
        """Take part in run ``run_id`` as ``client_id``.

        Fetch, verify and adopt the key holder's public context (trusted on first use unless
        ``security.keyholder_key`` pins it), and count the trainer's rounds in that run. Call after
        :meth:`connect`.
        """
        self.client_id, self.run_id = client_id, run_id
        self.ledger.trainer.set_run(run_id)
        self.keyholder_key = b""
        self.fetch_context(timeout_s)
        self._layout = BlockLayout(self.num_params, self._values_per_block)

    def disconnect(self) -> None:
        """Close the channels :meth:`connect` opened.

        The public context, the encryptor and its encryptions of zero are kept (:meth:`connect`
        again to go on).
        """
        if self._params is not None:
            self._params.close()
        if self._keyholder is not None:
            self._keyholder.close()
        self._params, self._keyholder = None, None

    def shutdown(self) -> None:
        """:meth:`disconnect` and stop the encryption worker."""
        self.disconnect()
        if isinstance(self._encryptor, BlockEncryptor):
            self._encryptor.close()

    @property
    def keyholder(self) -> KeyHolderStub:
        """The key holder's channel (after :meth:`connect`)."""
        return _known(self._keyholder, "the key holder")

    @property
    def shards(self) -> ModelReader:
        """The shards' channels (after :meth:`connect`)."""
        return _known(self._params, "the shards")

    @property
    def ring(self) -> HashRing:
        """Which shard owns which block (after :meth:`connect`)."""
        return _known(self._ring, "the shards")

    @property
    def layout(self) -> BlockLayout:
        """The model's blocks under the run's context (after :meth:`join`)."""
        return _known(self._layout, "the block layout")

    @property
    def upload_layout(self) -> BlockLayout:
        """An update's blocks: the model's, or ``K`` values per coefficient (quantized packing)."""
        return upload_layout(self.layout, self._fields)

    @property
    def _fields(self) -> int:
        """Values per coefficient of an update."""
        return 1 if self.packing is None else self.packing.fields

    @property
    def encryptor(self) -> BlockEncryptor | PlainContext:
        """What encrypts an update under the current public context (after :meth:`join`)."""
        if self._encryptor is None:
            raise RuntimeError(_UNKNOWN.format("the public context"))
        return self._encryptor

    def pull(self, version: int) -> tuple[np.ndarray, int]:
        """The model of ``version`` (or later) from the shards: the flat vector and its version.

        Every block's signature is checked against the key holder's key.
        """
        return self.shards.pull(
            self.layout,
            min_version=version,
            verify=model_verifier(self.keyholder_key),
            only=self.ring_view.nodes,
        )

    # ------------------------------------------------------------------ the public context
    def adopt_context(self, context_id: str) -> bool:
        """Fetch the key holder's public context ``context_id`` if it is not ours.

        It is not ours when the key holder rotated its keys; an empty id changes nothing. False
        (counted and logged): the key holder's context could not be fetched, or was refused; ours is
        kept. Raises what the client's own configuration refuses (:meth:`fetch_context`).
        """
        if not context_id or context_id == self.context_id:
            return True
        try:
            self.fetch_context()
        except FedPSError as exc:
            if own_fault(exc):
                raise
            self.failures.failed(KEY_HOLDER, exc)
            return False
        return True

    def fetch_context(self, timeout_s: float = 60.0) -> None:
        """Fetch, verify and adopt the key holder's current public context.

        Nothing is adopted unless all of it verifies.

        Raises
        ------
        ConfigError
            The client's own configuration refuses the context: another key than the one
            ``security.keyholder_key`` pins, or no encryption while ``he.enabled`` is set.
        InvalidArgumentError
            A context that does not verify, or a signing key that changed during the run.
        FedPSError
            The key holder's answer (unreachable, refusing).
        """
        ctx = self.keyholder.get_public_context(retry_s=timeout_s)
        pinned = self.config.security.keyholder_key
        if pinned and bytes.fromhex(pinned) != ctx.signing_key:  # our configuration refuses it
            raise ConfigError(
                "the key holder's signing key does not match security.keyholder_key (pinned); "
                "refusing its public context"
            )
        if self.keyholder_key and ctx.signing_key != self.keyholder_key:
            raise InvalidArgumentError("the key holder's signing key changed during the run")
        key = verified_signing_key(  # trusted on first use only: a rotation keeps the key
            ctx,
            pinned=pinned or self.keyholder_key.hex(),
            refusing="its public context",
            who=f"{self.name}: key holder key",
        )
        encryptor = self._make_encryptor(ctx.context, ctx.context_id)
        if isinstance(self._encryptor, BlockEncryptor):
            self._encryptor.close()
        self.keyholder_key, self.context_id, self._encryptor = key, ctx.context_id, encryptor

    def precompute(self, *, background: bool) -> None:
        """Draw the encryptions of zero the next update needs (the offline half of encryption).

        Now or (``background``) in a low-priority process; nothing without encryption.
        """
        if isinstance(self._encryptor, BlockEncryptor):
            blocks = self._update_blocks(self.layout.num_blocks)
            if background:
                self._encryptor.precompute_in_background(blocks)
            else:
                self._encryptor.precompute(blocks)

    def _update_blocks(self, num_blocks: int) -> int:
        """The blocks an update of a model of ``num_blocks`` blocks sends (fewer, compressed)."""
        return sent_blocks(num_blocks, self.config.compression.density, self._fields)

    def _make_encryptor(self, context: bytes, context_id: str) -> BlockEncryptor | PlainContext:
        """An encryptor for the key holder's public context (plaintext only if we agreed)."""
        params = self.config.he
        if context_id == PLAINTEXT_CONTEXT_ID:
            if params.enabled:
                raise ConfigError(
                    "the key holder offers no encryption but he.enabled is set; refusing"
                )
            _log.warning("%s: encryption is OFF (insecure baseline)", self.name)
            self._values_per_block = ckks_params(self.config).values_per_block
            return PlainContext(self._values_per_block)
        public = PublicContext.from_bytes(context)
        if public.context_id != context_id:
            raise InvalidArgumentError("public context does not match its id")
        if self.packing is not None and public.params != self.packing.params:
            raise ConfigError(
                "the key holder's CKKS parameters are not those of compression.bits' packing; "
                "give every role the same [he] and [compression] sections"
            )
        self._values_per_block = public.params.values_per_block
        encryptor = BlockEncryptor(public)
        encryptor.precompute(self._update_blocks(-(-self.num_params // self._values_per_block)))
        return encryptor


def _known(value: _T | None, what: str) -> _T:
    """``value``, known once the client connected and joined a run.

    A programming error otherwise: call :meth:`ClientSession.connect` and :meth:`ClientSession.join`
    first.
    """
    if value is None:
        raise RuntimeError(_UNKNOWN.format(what))
    return value
