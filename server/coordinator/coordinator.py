"""The coordinator (chief): registration, synchronous rounds, evaluation and checkpoints.

One round, in two phases:

1. **Commit.** Draw a cohort of live clients (:class:`~.cohort_sampler.CohortSampler`:
   Poisson at client level, so a round can be skipped for a cohort smaller than
   ``min_quorum``), open the round's commit phase at the key holder
   with the current model version, and hand ``TRAIN`` tasks to the cohort. Each client trains,
   encrypts and commits its signed update (and its ciphertexts' sketches) at the key holder.
   When every member has committed (or said it has nothing to send), or the deadline passes
   (async: once ``buffer_size`` updates are committed), the commitments are frozen.
2. **Push.** Only then is the round opened on every shard, for exactly the committed clients
   and their commitments; they push their ciphertexts and report. The round closes when all of
   them reported or the push deadline passes. Shards report which clients pushed all their
   blocks; if at least ``min_quorum`` did, the key holder checks and decrypts the aggregate of
   exactly those clients, applies it and publishes the next version; otherwise the round is
   abandoned and its sums are discarded, never decrypted.

No client's ciphertext can thus depend on another's of the same round (docs/security.md).
Each client's privacy spend (epsilon at delta) arrives with its registration, with every
``GetTask`` call (a client records what a round will spend, and says so, before it trains)
and with its report; the coordinator keeps the largest it was told, so the maximum over
clients it reports never goes down and counts rounds whose update never arrived.
Every ``eval_every`` rounds the published model is pulled from the shards and evaluated on the
held-out split. The state is written atomically when a round opens (with its cohort and
deadline), when it starts closing, every ``checkpoint_every`` rounds and at the end, so a
restarted coordinator continues the round it was in instead of starting over.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np

from crypto import CkksParams
from crypto.enrolment import ENROLMENT_KEY_FILE, load_enrolment_key, verify_token
from crypto.signing import is_weak_key, model_verifier
from fedps.blocks import BlockLayout
from fedps.config import FedPSConfig
from fedps.errors import (
    FedPSError,
    InvalidArgumentError,
    PeerUnavailableError,
    QuarantinedError,
    UnauthenticatedError,
    UnknownClientError,
)
from fedps.parameter_client import ParameterClient
from fedps.proto import common_pb2, keyholder_pb2, keyholder_pb2_grpc, shard_pb2
from fedps.transport import call, call_until, create_channel
from server.coordinator.cohort_sampler import CohortSampler
from server.coordinator.evaluator import Evaluator

__all__ = ["Coordinator", "RoundRecord", "Task"]

_log = logging.getLogger("fedps")

CHECKPOINT_FILE = "coordinator-checkpoint.npz"
_WAIT_S = 0.2
# Every call has a deadline: a call caught in a peer's restart fails and is retried, never hangs.
_CALL_S = 20.0
_LONG_CALL_S = 300.0  # applying a round decrypts and publishes the whole model
_MAX_REPORTED_BYTES = 1 << 40  # per report; keeps totals far from uint64 overflow
_T = TypeVar("_T")


@dataclass
class RoundRecord:
    """The outcome of one round."""

    round: int
    version: int
    contributors: int
    accuracy: float = -1.0
    loss: float = -1.0
    max_epsilon: float = 0.0
    bytes_pushed: int = 0
    seconds: float = 0.0
    abandoned: bool = False
    push_seconds: float = 0.0  # from the freeze of the commitments to the close
    #: client level: the noise multiplier the released model carries (0: example level)
    noise_multiplier: float = 0.0
    cohort: int = 0  # clients drawn for the round


@dataclass(frozen=True)
class Task:
    """What a client should do next."""

    kind: str  # "wait" | "train" | "push" | "done"
    round: int = 0
    version: int = 0
    deadline_unix: float = 0.0
    retry_after: float = _WAIT_S
    weight_scale: float = 1.0
    context_id: str = ""


@dataclass
class _Client:
    name: str
    num_examples: int
    signing_key: str = ""  # Ed25519 public key, hex
    credential_hash: str = ""  # SHA-256 of the credential issued at registration, hex
    last_seen: float = field(default_factory=time.time)
    epsilon: float = 0.0
    delta: float = 0.0
    bytes_pushed: int = 0
    exhausted: bool = False
    noise_multiplier: float | None = None  # as the client last reported it

    def spent(self, epsilon: float, delta: float) -> None:
        """The client says it has spent ``epsilon`` (at ``delta``): keep the largest."""
        self.epsilon = max(self.epsilon, epsilon)
        if delta:
            self.delta = delta


def _check_spend(epsilon: float, delta: float) -> None:
    """A reported privacy spend is a number the coordinator can keep."""
    # +inf is honest: a client training without DP noise has no finite epsilon.
    if math.isnan(epsilon) or epsilon < 0 or not 0 <= delta < 1:
        raise InvalidArgumentError("epsilon must be >= 0 (inf: no DP), delta in [0, 1)")


@dataclass
class _OpenRound:
    round: int
    version: int
    deadline: float
    cohort: frozenset[str]
    reported: set[str] = field(default_factory=set)
    closing: bool = False  # the shards may have closed it: do not wait for reports again
    pushing: bool = False  # the commitments are frozen and the shards take pushes
    committed: frozenset[str] = frozenset()  # so far (commit phase), then the frozen set

    def to_json(self) -> dict[str, object]:
        return {
            "round": self.round,
            "version": self.version,
            "deadline": self.deadline,
            "cohort": sorted(self.cohort),
            "closing": self.closing,
            "pushing": self.pushing,
        }


class Coordinator:
    """The chief of a fedps cluster.

    Parameters
    ----------
    config
        The cluster configuration.
    state_dir
        Where checkpoints are written.

    Raises
    ------
    ConfigError
        Without TLS (``tls.insecure``) and without an enrolment key in ``tls.directory``:
        no client could prove an identity.
    """

    def __init__(self, config: FedPSConfig, *, state_dir: Path) -> None:
        self.config = config
        # Checks the enrolment tokens of clients that have no certificate (TLS off, Flower).
        self._enrolment_key = self._load_enrolment_key(config)
        self._training = config.training
        self._dir = state_dir
        self._dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._stop = threading.Event()
        self.run_id = secrets.token_hex(8)
        self.clients: dict[str, _Client] = {}
        self.round = 0
        self.version = 0
        self.history: list[RoundRecord] = []
        self.finished = False
        self.last_checkpoint = 0.0
        self._open: _OpenRound | None = None
        self._resume: _OpenRound | None = None  # the round a restarted coordinator continues
        self._keyholder_key: bytes | None = None  # verifies published blocks
        self._sampler = CohortSampler(self._training, config.privacy)
        self.evaluator = Evaluator(self._training)
        self._vector: np.ndarray = self.evaluator.initial_vector()
        self._shard_ids = config.cluster.shard_ids
        shards = dict(zip(self._shard_ids, config.cluster.shards, strict=True))
        self._params = ParameterClient(shards)
        self._keyholder = keyholder_pb2_grpc.KeyHolderStub(create_channel(config.cluster.keyholder))
        self.layout = BlockLayout(
            self._vector.size,
            CkksParams.for_config(config).values_per_block,
        )
        self._restore()

    # ------------------------------------------------------------------ client-facing
    def register(
        self,
        name: str,
        num_examples: int,
        num_params: int,
        signing_key: bytes = b"",
        *,
        identity: str | None = None,
        enrolment_token: str = "",
        epsilon: float = 0.0,
        delta: float = 0.0,
    ) -> tuple[str, bytes]:
        """Register a client; returns its client id and a fresh credential.

        The client id is the client's provisioned identity: ``identity``, the common name of
        the caller's verified certificate under mutual TLS (the servicer passes it), or else
        the name that ``enrolment_token`` proves (:mod:`crypto.enrolment`). Registering an
        identity again (a restarted client) returns the same id with a new credential, and
        ``signing_key`` (the client's Ed25519 public key) replaces the one registered before.
        ``epsilon`` (at ``delta``) is what the client's ledger says it has spent already.

        Raises
        ------
        UnauthenticatedError
            Neither a certificate identity nor a valid enrolment token.
        InvalidArgumentError
            A weak signing key, another model size, no training examples, or an epsilon or
            delta out of range.
        """
        _check_spend(epsilon, delta)
        if is_weak_key(signing_key):
            raise InvalidArgumentError("registration needs a valid 32-byte Ed25519 signing key")
        if num_params != self.layout.num_params:
            raise InvalidArgumentError(
                f"client model has {num_params} parameters, the run's model has "
                f"{self.layout.num_params}"
            )
        if num_examples < 1:
            raise InvalidArgumentError("a client needs at least one training example")
        client_id, how = self._identify(identity, enrolment_token)
        issued = secrets.token_bytes(32)
        with self._changed:
            known = self.clients.get(client_id)
            if known is not None:
                known.name = name or client_id
                known.num_examples = num_examples
                known.signing_key = signing_key.hex()
                known.credential_hash = hashlib.sha256(issued).hexdigest()
                known.last_seen = time.time()
            else:
                self.clients[client_id] = _Client(
                    name=name or client_id,
                    num_examples=num_examples,
                    signing_key=signing_key.hex(),
                    credential_hash=hashlib.sha256(issued).hexdigest(),
                )
            self.clients[client_id].spent(epsilon, delta)
            self._changed.notify_all()
        _log.info(
            "%s %s by %s (%s, %d examples)",
            "re-registered" if known is not None else "registered",
            client_id,
            how,
            name,
            num_examples,
        )
        return client_id, issued

    def _identify(self, identity: str | None, enrolment_token: str) -> tuple[str, str]:
        """The client id of a registration and how it was proven (certificate or token)."""
        if identity:
            return identity, "certificate"
        if not enrolment_token:
            raise UnauthenticatedError(
                "registration refused: present a client certificate of the deployment (mutual "
                "TLS) or, without TLS, the enrolment token from `fedps certs`"
            )
        if self._enrolment_key is None:
            raise UnauthenticatedError(
                "registration refused: this coordinator has no enrolment key to check tokens "
                f"({self.config.tls.directory / ENROLMENT_KEY_FILE}; `fedps certs` makes it)"
            )
        return verify_token(self._enrolment_key, enrolment_token), "enrolment token"

    @staticmethod
    def _load_enrolment_key(config: FedPSConfig) -> bytes | None:
        directory = config.tls.directory
        if config.tls.insecure or (directory / ENROLMENT_KEY_FILE).exists():
            return load_enrolment_key(directory)  # required without TLS: a clear error if absent
        return None

    def get_task(
        self, client_id: str, credential: bytes = b"", *, epsilon: float = 0.0, delta: float = 0.0
    ) -> Task:
        """The next task for ``client_id`` (authenticated by its credential), which says it
        has spent ``epsilon`` (at ``delta``) so far.

        Raises
        ------
        InvalidArgumentError
            An epsilon or delta out of range.
        """
        _check_spend(epsilon, delta)
        with self._lock:
            client = self._known(client_id)
            self._check_credential(client, client_id, credential)
            client.last_seen = time.time()
            client.spent(epsilon, delta)
            # WAIT and DONE carry the last finished round: at client level every global round
            # counts in a client's spend, the rounds it was not drawn for too.
            if self.finished:
                return Task("done", self.round)
            current = self._open
            if (
                current is not None
                and current.pushing
                and client_id in current.committed
                and client_id not in current.reported
                and time.time() < current.deadline
            ):
                return Task("push", current.round, current.version, current.deadline)
            if (
                current is not None
                and not current.pushing
                and client_id in current.cohort
                and client_id not in current.reported
                and time.time() < current.deadline
            ):
                scale = max(
                    self.clients[c].num_examples for c in current.cohort if c in self.clients
                )
                return Task(
                    "train",
                    current.round,
                    current.version,
                    current.deadline,
                    weight_scale=float(scale),
                    context_id=self._context_id,
                )
            return Task("wait", self.round)

    def report(
        self,
        client_id: str,
        round_: int,
        *,
        epsilon: float,
        delta: float,
        bytes_pushed: int,
        budget_exhausted: bool,
        credential: bytes = b"",
        noise_multiplier: float | None = None,
    ) -> None:
        """A client says it pushed its update for ``round_`` (or ran out of budget); it trains
        with DP noise multiplier ``noise_multiplier`` (``None``: not said)."""
        _check_spend(epsilon, delta)
        if noise_multiplier is not None and not noise_multiplier >= 0:
            raise InvalidArgumentError("noise_multiplier must be >= 0 (0: no DP noise)")
        if not 0 <= bytes_pushed <= _MAX_REPORTED_BYTES:
            raise InvalidArgumentError(f"bytes_pushed must be in [0, {_MAX_REPORTED_BYTES}]")
        with self._changed:
            client = self._known(client_id)
            self._check_credential(client, client_id, credential)
            client.spent(epsilon, delta)
            if noise_multiplier is not None:
                client.noise_multiplier = noise_multiplier
            client.bytes_pushed += bytes_pushed
            client.exhausted = client.exhausted or budget_exhausted
            if self._open is not None and self._open.round == round_:
                self._open.reported.add(client_id)
            self._changed.notify_all()

    @staticmethod
    def _check_credential(client: _Client, client_id: str, credential: bytes) -> None:
        digest = hashlib.sha256(credential).hexdigest()
        if not credential or not hmac.compare_digest(digest, client.credential_hash):
            raise UnauthenticatedError(f"missing or wrong credential for {client_id!r}")

    def _known(self, client_id: str) -> _Client:
        client = self.clients.get(client_id)
        if client is None:
            raise UnknownClientError(f"unknown client {client_id!r}; register first")
        return client

    @property
    def max_epsilon(self) -> tuple[float, float]:
        """The largest epsilon any client reported, with its delta."""
        with self._lock:
            worst = max(self.clients.values(), key=lambda c: c.epsilon, default=None)
            return (worst.epsilon, worst.delta) if worst else (0.0, 0.0)

    @property
    def client_epsilons(self) -> dict[str, float]:
        """The largest epsilon each registered client reported, by client id."""
        with self._lock:
            return {cid: c.epsilon for cid, c in self.clients.items()}

    @property
    def client_noise_multipliers(self) -> dict[str, float]:
        """The noise multiplier each client last reported, by client id."""
        with self._lock:
            return {
                cid: c.noise_multiplier
                for cid, c in self.clients.items()
                if c.noise_multiplier is not None
            }

    def wait_until_pushing(self, round_: int, timeout_s: float) -> bool:
        """Wait until ``round_``'s commitments are frozen and its shards take pushes; False
        when the round ended first (too few commitments) or ``timeout_s`` passed."""
        until = time.time() + timeout_s
        with self._changed:
            while time.time() < until and not self._stop.is_set():
                current = self._open
                if current is not None and current.round == round_ and current.pushing:
                    return True
                if self.round >= round_:
                    return False
                self._changed.wait(timeout=_WAIT_S)
        return False

    def reported_in_open_round(self) -> int:
        """Updates reported so far in the open round or buffer (0 between rounds)."""
        current = self._open
        return len(current.reported) if current is not None else 0

    @property
    def bytes_pushed(self) -> int:
        """Bytes of encrypted updates the clients report having pushed."""
        with self._lock:
            return sum(c.bytes_pushed for c in self.clients.values())

    # ------------------------------------------------------------------ the round loop
    def stop(self) -> None:
        """Ask :meth:`run` to return soon."""
        self._stop.set()
        with self._changed:
            self._changed.notify_all()

    def run(self) -> None:
        """Run rounds until ``training.rounds`` are done or :meth:`stop` is called."""
        try:
            self._run()
        except FedPSError:
            if not self._stop.is_set():
                _log.exception("the round loop stopped")
                raise

    def _run(self) -> None:
        self._bootstrap()
        resume, self._resume = self._resume, None
        if resume is not None and resume.round > self.round and resume.version == self.version:
            # Restarted mid-round: continue it, so pushes the shards acknowledged still count.
            _log.info("continuing round %d after a restart", resume.round)
            self._run_round(resume.round, resume.cohort, resume=resume)
        while self.round < self._training.rounds and not self._stop.is_set():
            cohort = self._wait_for_cohort()
            if cohort is None:
                break
            self._run_round(self.round + 1, cohort)
        with self._lock:
            self.finished = not self._stop.is_set()
        if self.finished:
            self._checkpoint()
            _log.info("training finished after %d rounds", self.round)

    def _bootstrap(self) -> None:
        """Wait for the key holder and give it the initial model (the chief's job)."""
        state = self._retry(
            lambda: self._keyholder.GetModelState(common_pb2.Empty(), timeout=_CALL_S),
            "key holder state",
        )
        if state.initialized and state.version >= self.version:
            self.version = state.version
            self.round = max(self.round, state.last_round)
            if state.num_params != self.layout.num_params:
                raise FedPSError("the key holder's model does not match the configured model")
            # Republish: shards may have restarted empty.
            self._initialize(force=False)
        else:
            self._initialize(force=True)
        context = self._retry(
            lambda: self._keyholder.GetPublicContext(common_pb2.Empty(), timeout=_CALL_S),
            "public context",
        )
        self._context_id = context.context_id
        self._keyholder_key = bytes(context.signing_key)

    def _initialize(self, *, force: bool) -> None:
        layout = self.layout
        blocks = [
            common_pb2.ParameterBlock(
                block=b,
                version=self.version,
                values=layout.block_of(self._vector, b).astype("<f4").tobytes(),
            )
            for b in range(layout.num_blocks)
        ]
        request = keyholder_pb2.InitializeRequest(
            num_params=layout.num_params, blocks=blocks, force=force, version=self.version
        )
        state = self._retry(
            lambda: self._keyholder.InitializeModel(iter([request]), timeout=_LONG_CALL_S),
            "initialise model",
        )
        self.version = state.version

    def _retry(
        self,
        fn: Callable[[], _T],
        what: str,
        retry_on: type[FedPSError] = FedPSError,
    ) -> _T:
        """Call until it succeeds (or :meth:`stop`), retrying errors of kind ``retry_on``."""
        return call_until(fn, what, retry_on=retry_on, stop=self._stop)

    def _wait_for_cohort(self) -> frozenset[str] | None:
        expected = self._training.clients
        grace_until = time.time() + self._training.deadline_s
        with self._changed:
            while not self._stop.is_set():
                live = [cid for cid, c in self.clients.items() if self._is_live(c)]
                if len(live) >= expected or (
                    len(live) >= self._training.min_quorum and time.time() > grace_until
                ):
                    return self._sampler.draw(live)
                usable = [c for c in self.clients.values() if not c.exhausted]
                if len(self.clients) >= expected and len(usable) < self._training.min_quorum:
                    _log.warning("fewer than min_quorum clients have privacy budget left")
                    self._stop.set()
                    return None
                self._changed.wait(timeout=_WAIT_S)
        return None

    def _is_live(self, client: _Client) -> bool:
        timeout = max(30.0, 3 * self._training.deadline_s)
        return not client.exhausted and time.time() - client.last_seen < timeout

    def _run_round(
        self, round_: int, cohort: frozenset[str], *, resume: _OpenRound | None = None
    ) -> None:
        started = time.time()
        if resume is None and not self._cohort_fits(round_, cohort):
            record = RoundRecord(
                round=round_,
                version=self.version,
                contributors=0,
                abandoned=True,
                cohort=len(cohort),
            )
            self._finish_round(record, started, self.bytes_pushed)
            return
        self._context_id = self._retry(
            lambda: self._keyholder.GetPublicContext(common_pb2.Empty(), timeout=_CALL_S),
            "public context",
        ).context_id  # it changes when the key holder rotates keys
        bytes_before = self.bytes_pushed
        version = self.version
        asynchronous = self._training.mode == "async"
        # Async buffers have no commit deadline: they freeze once buffer_size are committed.
        deadline = started + (1e9 if asynchronous else self._training.deadline_s)
        opened = _OpenRound(round_, version, deadline, cohort)
        if resume is not None:
            opened.deadline, opened.pushing = resume.deadline, resume.pushing
        if not opened.pushing:
            self._checkpoint(opened)  # the cohort and deadline survive a restart
            request = keyholder_pb2.OpenCommitsRequest(
                round=round_,
                version=version,
                run_id=self.run_id,
                context_id=self._context_id,
                members=self._members(cohort),
            )
            try:
                self._retry(
                    lambda: self._keyholder.OpenCommits(request, timeout=_CALL_S),
                    f"open commitments of round {round_}",
                    retry_on=PeerUnavailableError,
                )
            except FedPSError as exc:
                if self._stop.is_set():
                    return
                # e.g. the key holder froze this round number for another cohort before a
                # restart lost our checkpoint: it can never take commitments again
                _log.warning("round %d cannot open: %s; abandoned", round_, exc)
                record = RoundRecord(round=round_, version=version, contributors=0, abandoned=True)
                self._finish_round(record, started, bytes_before)
                return
            self._collect_commitments(opened, asynchronous)
        if self._stop.is_set():
            return
        commit_set = self._freeze_commitments(round_)
        committed = frozenset(commit_set.client_ids) & cohort
        record = RoundRecord(round=round_, version=version, contributors=0, cohort=len(cohort))
        quorum = self._training.min_quorum
        if asynchronous:
            quorum = max(quorum, self._training.buffer_size)
        accepted: set[str] = set()
        if len(committed) >= quorum:
            opened.committed, opened.pushing = committed, True
            if resume is None or not resume.pushing:
                opened.deadline = time.time() + self._training.deadline_s
            self._checkpoint(opened)
            updates = [u for u in commit_set.updates if u.client_id in committed]
            frozen_at = time.time()
            self._open_on_shards(round_, version, committed, updates)
            self._wait_for_pushes(opened, resume)
            if self._stop.is_set():
                return
            opened.closing = True
            self._checkpoint(opened)
            accepted = self._close_on_shards(round_, committed)
            record.push_seconds = time.time() - frozen_at
        record.contributors = len(accepted)
        if len(accepted) < quorum:
            _log.warning(
                "round %d abandoned: %d of %d clients committed, %d complete, quorum is %d",
                round_,
                len(committed),
                len(cohort),
                len(accepted),
                quorum,
            )
            if opened.pushing:
                self._discard(round_)
            record.abandoned = True
        else:
            try:
                reply = self._apply_round(round_, version, frozenset(accepted))
            except FedPSError as exc:  # a policy refusal, or an aggregate that cannot decrypt
                if self._stop.is_set():
                    return  # stopping, not refused: a restart continues the round
                _log.warning("round %d refused by the key holder: %s", round_, exc)
                self._discard(round_)
                record.abandoned = True
                if isinstance(exc, QuarantinedError):
                    _log.error("the run stops: %s", exc)
                    self._stop.set()  # no round can be applied any more
            else:
                self.version = reply.version
                record.version = reply.version
                record.noise_multiplier = reply.noise_multiplier
        self._finish_round(record, started, bytes_before)

    def _cohort_fits(self, round_: int, cohort: frozenset[str]) -> bool:
        """Whether a round can run with the drawn ``cohort``: at least ``min_quorum`` and at
        most ``he.max_clients`` clients (a Poisson draw can miss either; the round is then
        skipped before anything opens, and still counts as a global round)."""
        low, high = self._training.min_quorum, self.config.he.max_clients
        if low <= len(cohort) <= high:
            return True
        _log.warning(
            "round %d skipped: %d clients drawn (Poisson, rate %.4g), the round needs %d to %d; "
            "nothing is opened or released, and the clients' accountants count the round",
            round_,
            len(cohort),
            self._sampler.rate,
            low,
            high,
        )
        return False

    def _collect_commitments(self, opened: _OpenRound, asynchronous: bool) -> None:
        """Hand out TRAIN tasks and wait until every cohort member committed or said it has
        nothing to send (sync), ``buffer_size`` committed (async), or the deadline."""
        with self._changed:
            self._open = opened
            self._changed.notify_all()
        try:
            while not self._stop.is_set() and time.time() < opened.deadline:
                reply = self._retry(
                    lambda: self._keyholder.CloseCommits(
                        keyholder_pb2.CloseCommitsRequest(round=opened.round, freeze=False),
                        timeout=_CALL_S,
                    ),
                    f"commitments of round {opened.round}",
                )
                with self._changed:
                    opened.committed = frozenset(reply.client_ids)
                    if reply.frozen:  # frozen before a restart
                        break
                    if asynchronous and len(opened.committed) >= self._training.buffer_size:
                        break
                    if not asynchronous and opened.cohort <= opened.committed | opened.reported:
                        break
                    self._changed.wait(
                        timeout=min(_WAIT_S, max(0.0, opened.deadline - time.time()))
                    )
        finally:
            with self._changed:
                self._open = None

    def _freeze_commitments(self, round_: int) -> keyholder_pb2.CommitSet:
        """Accept no commitment to ``round_`` from now on; returns who committed."""
        reply: keyholder_pb2.CommitSet = self._retry(
            lambda: self._keyholder.CloseCommits(
                keyholder_pb2.CloseCommitsRequest(round=round_, freeze=True), timeout=_CALL_S
            ),
            f"freeze commitments of round {round_}",
        )
        return reply

    def _open_on_shards(
        self,
        round_: int,
        version: int,
        committed: frozenset[str],
        updates: list[common_pb2.SignedUpdate],
    ) -> None:
        request = shard_pb2.OpenRoundRequest(
            round=round_,
            version=version,
            members=self._members(committed),
            context_id=self._context_id,
            run_id=self.run_id,
            commitments=updates,
        )
        for sid, stub in self._params.stubs.items():
            self._retry(lambda: stub.OpenRound(request, timeout=_CALL_S), f"open round on {sid}")  # noqa: B023

    def _wait_for_pushes(self, opened: _OpenRound, resume: _OpenRound | None) -> None:
        """Wait until every committed client reported its push, or the push deadline."""
        with self._changed:
            self._open = opened
            self._changed.notify_all()
            while (
                not self._stop.is_set()
                and time.time() < opened.deadline
                and not (resume is not None and resume.closing)
                and not opened.committed <= opened.reported
            ):
                self._changed.wait(timeout=min(_WAIT_S, max(0.0, opened.deadline - time.time())))
            self._open = None

    def _finish_round(self, record: RoundRecord, started: float, bytes_before: int) -> None:
        round_ = record.round
        self.round = round_
        if not record.abandoned and (
            round_ % self._training.eval_every == 0 or round_ == self._training.rounds
        ):
            self._vector, _ = self._retry(self._pull_model, "pull model")
            record.accuracy, record.loss = self.evaluator.evaluate(self._vector)
        record.max_epsilon = self.max_epsilon[0]
        record.bytes_pushed = self.bytes_pushed - bytes_before
        record.seconds = time.time() - started
        with self._lock:
            self.history.append(record)
        _log.info("round %d: %s", round_, record)
        if round_ % self._training.checkpoint_every == 0 or record.abandoned:
            self._checkpoint()

    def _members(self, cohort: frozenset[str]) -> list[common_pb2.CohortMember]:
        return [
            common_pb2.CohortMember(
                client_id=c, signing_key=bytes.fromhex(self.clients[c].signing_key)
            )
            for c in sorted(cohort)
        ]

    def _apply_round(
        self, round_: int, version: int, contributors: frozenset[str]
    ) -> keyholder_pb2.ApplyRoundReply:
        """Ask the key holder to check, decrypt and apply exactly ``contributors``' sum."""
        request = keyholder_pb2.ApplyRoundRequest(
            round=round_, version=version, run_id=self.run_id, members=self._members(contributors)
        )
        # A key holder or shard that is restarting delays the round; a refusal ends it.
        reply: keyholder_pb2.ApplyRoundReply = self._retry(
            lambda: self._keyholder.ApplyRound(request, timeout=_LONG_CALL_S),
            f"apply round {round_}",
            retry_on=PeerUnavailableError,
        )
        return reply

    def _pull_model(self) -> tuple[np.ndarray, int]:
        """The published model, every block's key-holder signature checked."""
        key = self._keyholder_key
        verify = model_verifier(key) if key is not None else None
        return self._params.pull(self.layout, self.version, verify=verify)

    def _close_on_shards(self, round_: int, cohort: frozenset[str]) -> set[str]:
        accepted = set(cohort)
        for sid, stub in self._params.stubs.items():
            request = shard_pb2.CloseRoundRequest(round=round_)
            reply = self._retry(
                lambda: stub.CloseRound(request, timeout=_CALL_S),  # noqa: B023
                f"close round on {sid}",
            )
            if reply.blocks:
                accepted &= set(reply.complete_clients)
        return accepted

    def _discard(self, round_: int) -> None:
        for sid, stub in self._params.stubs.items():
            request = shard_pb2.CloseRoundRequest(round=round_)
            try:
                call(lambda: stub.DiscardRound(request, timeout=_CALL_S), f"discard round on {sid}")  # noqa: B023
            except FedPSError as exc:
                _log.warning("could not discard round %d on %s: %s", round_, sid, exc)

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint(self, open_round: _OpenRound | None = None) -> None:
        """Write the state atomically; ``open_round``: the round in progress, if any."""
        if open_round is None and self.version and self.history and self.history[-1].accuracy < 0:
            try:
                self._vector, _ = call(self._pull_model, "pull model")
            except FedPSError as exc:
                _log.warning("checkpoint without a fresh model: %s", exc)
        meta = {
            "run_id": self.run_id,
            "round": self.round,
            "version": self.version,
            "history": [asdict(r) for r in self.history],
            "clients": {cid: asdict(c) for cid, c in self.clients.items()},
            "open": open_round.to_json() if open_round is not None else None,
        }
        path = self._dir / CHECKPOINT_FILE
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as fh:
            np.savez(
                fh,
                model=self._vector,
                meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
            )
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        self.last_checkpoint = time.time()
        _log.info("checkpoint at round %d (version %d)", self.round, self.version)

    def _restore(self) -> None:
        path = self._dir / CHECKPOINT_FILE
        if not path.exists():
            return
        with np.load(path) as data:
            meta = json.loads(bytes(data["meta"]).decode())
            vector = data["model"]
        if vector.shape != self._vector.shape:
            raise FedPSError(f"checkpoint {path} is for another model")
        self._vector = vector
        self.run_id = meta["run_id"]
        self.round = int(meta["round"])
        self.version = int(meta["version"])
        self.history = [RoundRecord(**r) for r in meta["history"]]
        self.clients = {cid: _Client(**c) for cid, c in meta["clients"].items()}
        for client in self.clients.values():
            client.last_seen = time.time()
        if meta.get("open"):
            o = meta["open"]
            self._resume = _OpenRound(
                int(o["round"]),
                int(o["version"]),
                float(o["deadline"]),
                frozenset(o["cohort"]),
                closing=bool(o["closing"]),
                pushing=bool(o.get("pushing", False)),
            )
        self.last_checkpoint = path.stat().st_mtime
        _log.info("resumed from checkpoint: round %d, version %d", self.round, self.version)
