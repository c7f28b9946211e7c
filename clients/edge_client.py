"""The edge client (worker): register, pull, train with DP-SGD, encrypt, push, report.

One round as the client sees it:

1. ``GetTask`` from the coordinator says ``TRAIN`` round r on model version v.
2. Pull version v's blocks from the shards (:class:`fedps.parameter_client.ParameterClient`).
3. Record what the round will spend in the client's privacy ledger
   (:class:`clients.client_state.ClientState`) and tell the coordinator (a ``GetTask`` call
   carrying the epsilon), then train locally with DP-SGD
   (:class:`clients.dp_trainer.DPTrainer`), or with client-level DP
   (``privacy.level = "client"``, :class:`clients.dp_trainer.ClientLevelTrainer`: the update
   is clipped and noised); the trainer's accountant keeps everything spent on this data.
4. Weight the update (1 with ``security.weighting = "uniform"``, the default; otherwise
   ``num_examples / weight_scale``, the cohort's largest ``num_examples``, at least
   ``security.min_weight``), clip it to ``he.max_abs_value`` (the range the CKKS parameters
   were sized for), cut it into blocks and encrypt each block under the key holder's public
   context.
5. Commit at the key holder: the signed root of every encrypted block, and the sketch of every
   block under the round's secret challenge (:class:`crypto.sketch.Challenge`), before any
   ciphertext of the round reaches a shard.
6. Push each block to the shard that owns it (the shards open the round once the key holder
   froze the commitments), and report to the coordinator (epsilon spent, bytes pushed).

The client's state folder (``<cluster.state_dir>/clients/<identity>``, or ``state_dir``)
keeps its signing key and privacy ledger across restarts: a restarted client registers with
the same id and key, reports the epsilon it had spent, and resumes its budget from there; it
refuses to train past its target.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from clients.client_state import ClientState, data_fingerprint, default_state_dir
from clients.dp_trainer import PrivacySpend, create_trainer
from crypto import PLAINTEXT_CONTEXT_ID, BlockEncryptor, CkksParams, PlainContext, PublicContext
from crypto.enrolment import TOKEN_SUFFIX, read_token
from crypto.signing import context_digest, model_verifier, sign_update, verify_block
from crypto.sketch import Challenge
from fedps.blocks import BlockLayout, flatten_model
from fedps.config import FedPSConfig
from fedps.datasets import Dataset, load_dataset
from fedps.errors import (
    ConfigError,
    FedPSError,
    InvalidArgumentError,
    PeerUnavailableError,
    RoundClosedError,
    UnknownClientError,
)
from fedps.hash_ring import HashRing
from fedps.models import create_model
from fedps.parameter_client import ParameterClient
from fedps.partitioners import create_partitioner
from fedps.proto import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    keyholder_pb2,
    keyholder_pb2_grpc,
    shard_pb2,
)
from fedps.transport import batched, call, call_until, create_channel

__all__ = ["ClientSummary", "EdgeClient", "PreparedPush", "client_partition"]

_log = logging.getLogger("fedps")
_T = TypeVar("_T")
_PEER_WAIT_S = 90.0  # how long a push or a commitment waits for a restarting peer
# Every call has a deadline: one caught in a peer's restart fails and is retried, never hangs.
_CALL_S = 20.0
_PUSH_S = 60.0


@dataclass(frozen=True)
class PreparedPush:
    """A committed update's signed push messages, per shard (resent unchanged if asked)."""

    round: int
    version: int
    messages: dict[str, list[shard_pb2.PushRequest]]


@dataclass(frozen=True)
class ClientSummary:
    """What one client did over the run."""

    client_id: str
    rounds_trained: int
    epsilon: float
    delta: float
    bytes_pushed: int


def client_partition(config: FedPSConfig, index: int) -> Dataset:
    """The training partition of client ``index`` under the configured partitioner."""
    t = config.training
    if not 0 <= index < t.clients:
        raise InvalidArgumentError(f"client index {index} out of range [0, {t.clients})")
    train, _ = load_dataset(t.dataset, data_dir=t.data_dir)
    kwargs: dict[str, object] = {}
    if t.partition == "dirichlet":
        kwargs = {"alpha": t.dirichlet_alpha}
    elif t.partition == "shard":
        kwargs = {"num_shards_per_partition": t.shards_per_client}
    parts = create_partitioner(t.partition, **kwargs).partition(train.y, t.clients, t.seed)
    idx = parts[index]
    return Dataset(x=train.x[idx], y=train.y[idx], num_classes=train.num_classes, name=train.name)


class EdgeClient:
    """A federated worker.

    Parameters
    ----------
    config
        The cluster configuration (the coordinator's address and training settings).
    index
        Which data partition this client holds.
    name
        A display name.
    state_dir
        The folder of its signing key and privacy ledger
        (default ``<cluster.state_dir>/clients/<identity>``).

    Its identity is ``tls.name`` or ``client-INDEX``: the certificate it presents under mutual
    TLS, or, without TLS, the enrolment token ``tls.directory/NAME.token`` it registers with.

    Raises
    ------
    ConfigError
        Without TLS (``tls.insecure``) and without a readable enrolment token; or a state
        folder in use by another process, of another identity, or with a corrupt ledger.
    """

    def __init__(
        self, config: FedPSConfig, *, index: int, name: str = "", state_dir: Path | None = None
    ) -> None:
        self.config = config
        self.name = name or f"edge-{index}"
        self.identity = config.tls.name or f"client-{index}"
        self._enrolment_token = self._load_token(required=config.tls.insecure)
        self.state = self._open_state(state_dir)
        data = client_partition(config, index)
        model = create_model(
            config.training.model,
            num_features=data.num_features,
            num_classes=data.num_classes,
            seed=config.training.seed,
        )
        self.num_params = flatten_model(model).size
        self.trainer = create_trainer(
            model,
            data,
            training=config.training,
            privacy=config.privacy,
            seed=config.training.seed * 1000 + index + 1,
        )
        self._data = data_fingerprint(data)
        self.recorded = self._restore_spend()  # the spend the ledger holds
        self._coordinator = coordinator_pb2_grpc.CoordinatorStub(
            create_channel(config.cluster.coordinator)
        )
        self.client_id = ""
        self.bytes_pushed = 0
        self.rounds_trained = 0
        self.weight = 1.0  # num_examples / the round's weight_scale
        self._signer = self.state.signer
        self._credential = b""
        self._round = 0
        self._sent: PreparedPush | None = None  # the last signed update pushed, for a resend
        t = config.training
        slow = index < round(t.slow_fraction * t.clients)
        self.slowdown = t.slow_factor if slow else 1.0
        self._dropouts = random.Random(t.seed * 7919 + index)  # simulated mid-round deaths
        self.run_id = ""

    def run(self, *, timeout_s: float = 3600.0) -> ClientSummary:
        """Take part in training until the coordinator says done."""
        reply = self._register(timeout_s)
        shards = {s.shard_id: s.address for s in reply.shards}
        keyholder = keyholder_pb2_grpc.KeyHolderStub(create_channel(reply.keyholder))
        self._keyholder = keyholder
        self.run_id = reply.run_id
        self._keyholder_key = b""
        self._fetch_context(timeout_s)
        self._ring = HashRing(sorted(shards), virtual_nodes=reply.virtual_nodes)
        self._layout = BlockLayout(self.num_params, self._values_per_block)
        self._params = ParameterClient(shards)
        _log.info("%s registered as %s", self.name, self.client_id)
        deadline = time.time() + timeout_s
        try:
            while time.time() < deadline:
                try:
                    task = self._get_task(timeout_s)
                except UnknownClientError:  # the coordinator restarted without us
                    self._register(timeout_s)
                    continue
                if task.kind in (coordinator_pb2.Task.WAIT, coordinator_pb2.Task.DONE):
                    self._sit_out(task.round, final=task.kind == coordinator_pb2.Task.DONE)
                if task.kind == coordinator_pb2.Task.DONE:
                    break
                if task.kind == coordinator_pb2.Task.TRAIN:
                    if not self._train(task):
                        break
                elif task.kind == coordinator_pb2.Task.PUSH:
                    self._resend(task)
                else:
                    time.sleep(max(0.05, task.retry_after))
        finally:
            self._params.close()
            if isinstance(self._encryptor, BlockEncryptor):
                self._encryptor.close()
        return ClientSummary(
            self.client_id,
            self.rounds_trained,
            self.recorded.epsilon,
            self.config.privacy.delta,
            self.bytes_pushed,
        )

    def close(self) -> None:
        """Release the state folder (another process may then use it)."""
        self.state.close()

    # ------------------------------------------------------------------ privacy state
    def _open_state(self, state_dir: Path | None) -> ClientState:
        """This client's state folder, locked for this process."""
        directory = state_dir or default_state_dir(self.config, self.identity)
        return ClientState.open(directory, identity=self.identity)

    def _restore_spend(self) -> PrivacySpend:
        """Resume the trainer's accountant from the ledger; returns the spend restored."""
        entry = self.state.spent(self._data, self.config.privacy.level)
        if entry is not None:
            self.trainer.restore(entry.history, run_id=entry.run_id)
            _log.info(
                "%s: resumes its privacy budget from %s: epsilon %.3f spent (delta %g)",
                self.name,
                self.state.ledger_path,
                self.trainer.epsilon(),
                self.config.privacy.delta,
            )
        return self.trainer.spend()

    def _record_spend(self) -> bool:
        """Before training: record what the round will have spent in the ledger (durable),
        then tell the coordinator. Whatever happens afterwards (a crash while training, a
        push that never lands), neither reports less than was spent; killed before it trains,
        the client has recorded one round too many. Returns False when the round must not be
        trained: the coordinator could not be told, or it restarted without us (we register
        again, which carries the spend, and wait for a fresh task)."""
        self._record(self.trainer.spend_after_next_round())
        try:
            try:
                self._announce_spend()
            except UnknownClientError:
                self._register(_PEER_WAIT_S)
                return False
        except PeerUnavailableError as exc:
            _log.warning("%s: cannot tell the coordinator its spend: %s", self.name, exc)
            return False
        return True

    def _sit_out(self, round_: int, *, final: bool) -> None:
        """Rounds up to ``round_`` finished without us: at client level they count in our
        spend all the same (amplification by sampling counts every global round). Record it;
        the next ``GetTask`` carries it to the coordinator, or (``final``: the run is done)
        one last call does."""
        if not self.trainer.sit_out(round_):
            return
        self._record(self.trainer.spend())
        if final:
            try:
                call(self._poll_task, "final spend")
            except FedPSError as exc:  # the ledger has it; a next registration carries it
                _log.info("%s: cannot tell the coordinator its final spend: %s", self.name, exc)

    def _record(self, spend: PrivacySpend) -> None:
        """Write ``spend`` to the ledger (durable), then carry it in every later call."""
        self.state.record(self._data, spend, privacy=self.config.privacy)
        self.recorded = spend

    def _announce_spend(self) -> None:
        """Tell the coordinator the recorded spend (every ``GetTask`` call carries it)."""
        self._get_task(_PEER_WAIT_S)

    def _fetch_context(self, timeout_s: float = 60.0) -> None:
        """Fetch, verify and adopt the key holder's current public context."""
        ctx = self._retry(
            lambda: self._keyholder.GetPublicContext(common_pb2.Empty(), timeout=_CALL_S),
            "public context",
            timeout_s,
        )
        key = self._check_keyholder(ctx)
        if self._keyholder_key and key != self._keyholder_key:
            raise InvalidArgumentError("the key holder's signing key changed during the run")
        self._keyholder_key = key
        self._context_id = ctx.context_id
        old = getattr(self, "_encryptor", None)
        if isinstance(old, BlockEncryptor):
            old.close()
        self._encryptor = self._make_encryptor(ctx.context, ctx.context_id)

    def _check_keyholder(self, ctx: keyholder_pb2.PublicContextReply) -> bytes:
        """Verify the key holder's signature on its public context, against the pinned key."""
        pinned = self.config.security.keyholder_key
        if pinned and bytes.fromhex(pinned) != ctx.signing_key:
            raise InvalidArgumentError(
                "the key holder's signing key does not match security.keyholder_key (pinned)"
            )
        if not pinned:
            _log.warning(
                "%s: key holder key not pinned (security.keyholder_key); trusting %s on first use",
                self.name,
                ctx.signing_key.hex()[:16],
            )
        digest = context_digest(ctx.context, ctx.context_id)
        if not verify_block(ctx.signing_key, digest, ctx.signature):
            raise InvalidArgumentError("the public context's signature does not verify")
        return bytes(ctx.signing_key)

    def _make_encryptor(self, context: bytes, context_id: str) -> BlockEncryptor | PlainContext:
        """An encryptor for the key holder's public context (plaintext only if we agreed)."""
        params = self.config.he
        if context_id == PLAINTEXT_CONTEXT_ID:
            if params.enabled:
                raise InvalidArgumentError("the key holder offers no encryption; refusing")
            _log.warning("%s: encryption is OFF (insecure baseline)", self.name)
            self._values_per_block = CkksParams.for_config(self.config).values_per_block
            return PlainContext(self._values_per_block)
        public = PublicContext.from_bytes(context)
        if public.context_id != context_id:
            raise InvalidArgumentError("public context does not match its id")
        self._values_per_block = public.params.values_per_block
        encryptor = BlockEncryptor(public)
        encryptor.precompute(-(-self.num_params // self._values_per_block))
        return encryptor

    def _load_token(self, *, required: bool) -> str:
        """This client's enrolment token (empty if there is none and none is ``required``)."""
        token = read_token(self.config.tls.directory, self.identity)
        if token is None and required:
            path = self.config.tls.directory / f"{self.identity}{TOKEN_SUFFIX}"
            raise ConfigError(
                f"without TLS a client needs its enrolment token: {path} not found; "
                "create it with `fedps certs`"
            )
        return token or ""

    def _register(self, timeout_s: float) -> coordinator_pb2.RegisterReply:
        request = coordinator_pb2.RegisterRequest(
            name=self.name,
            num_examples=self.trainer.num_examples,
            num_params=self.num_params,
            signing_key=self._signer.public_key,
            enrolment_token=self._enrolment_token,
            epsilon=self.recorded.epsilon,
            delta=self.config.privacy.delta,
        )
        reply = self._retry(
            lambda: self._coordinator.Register(request, timeout=_CALL_S),
            "register",
            timeout_s,
        )
        self.client_id = reply.client_id
        self.trainer.set_run(reply.run_id)
        if reply.credential:
            self._credential = reply.credential
        return reply

    def _train(self, task: coordinator_pb2.Task) -> bool:
        """Train and push one round; returns False when the privacy budget is spent."""
        if task.context_id and task.context_id != self._context_id:
            self._fetch_context()  # the key holder rotated its keys
        sent = self._sent
        if sent is not None and (sent.round, sent.version) == (task.round, task.version):
            self._resend(task)  # never train twice for a round
            return True
        self.trainer.set_round(task.round)
        if not self.trainer.can_train_round():
            _log.info("%s: privacy budget spent (epsilon %.3f)", self.name, self.recorded.epsilon)
            self._report(task.round, 0, budget_exhausted=True)
            return False
        try:
            vector, version = self._params.pull(
                self._layout, min_version=task.version, verify=model_verifier(self._keyholder_key)
            )
        except FedPSError as exc:
            _log.info("%s: cannot pull version %d: %s", self.name, task.version, exc)
            time.sleep(0.2)
            return True
        if version != task.version:
            _log.info("%s: shards moved to version %d; skipping round", self.name, version)
            return True
        if not self._record_spend():
            return True
        started = time.perf_counter()
        delta = self.trainer.train_round(vector)
        if self.slowdown > 1:  # simulated slow device
            time.sleep((self.slowdown - 1) * (time.perf_counter() - started))
        if self._dropouts.random() < self.config.training.dropout:
            _log.info("%s: dropping out of round %d (simulated)", self.name, task.round)
            gone = min(task.deadline_unix - time.time(), self.config.training.deadline_s)
            time.sleep(max(0.0, gone))  # away until the round closes
            return True
        security = self.config.security
        if self.config.privacy.level == "client" or security.weighting == "uniform":
            self.weight = 1.0  # every client weighs the same (the key holder insists)
        else:
            share = self.trainer.num_examples / max(task.weight_scale, 1.0)
            self.weight = min(1.0, max(security.min_weight, share))
        self._round = task.round
        pushed = self.push(task.round, task.version, delta)
        self.rounds_trained += 1
        self._report(self._round, pushed, budget_exhausted=False)
        if isinstance(self._encryptor, BlockEncryptor):
            # Offline half of encryption, at low priority while we wait for the next round.
            self._encryptor.precompute_in_background(self._layout.num_blocks)
        return True

    def push(self, round_: int, version: int, delta: np.ndarray) -> int:
        """Weight, clip, encrypt, commit and push an update; returns bytes pushed (0 when
        the update missed its round)."""
        prepared = self.prepare(round_, version, delta)
        return 0 if prepared is None else self.send(prepared)

    def prepare(self, round_: int, version: int, delta: np.ndarray) -> PreparedPush | None:
        """Weight, clip, encrypt and commit an update; returns the signed push messages per
        shard (None when the round's commitments had closed)."""
        he = self.config.he
        weight = self.weight
        weighted = delta * weight
        clipped = np.clip(weighted, -he.max_abs_value, he.max_abs_value)
        if not np.array_equal(clipped, weighted):
            _log.warning("%s: update clipped to +-%g for encryption", self.name, he.max_abs_value)
        encrypted, coefficients = self._encryptor.encrypt_with_coefficients(clipped)
        committed = self._commit(round_, version, weight, coefficients)
        if committed is None:
            return None
        round_, update = committed
        self._round = round_
        by_shard: dict[str, list[shard_pb2.EncryptedBlock]] = {}
        for block, data in encrypted.items():
            owner = self._ring.owner(block)
            by_shard.setdefault(owner, []).append(
                shard_pb2.EncryptedBlock(block=block, ciphertext=data)
            )
        messages = {
            sid: [
                shard_pb2.PushRequest(
                    client_id=self.client_id,
                    round=round_,
                    version=version,
                    weight=weight,
                    context_id=self._context_id,
                    blocks=batch,
                    nonce=update.nonce,
                    signature=update.signature,
                    roots=update.roots,
                )
                for batch in batched(blocks, lambda b: len(b.ciphertext))
            ]
            for sid, blocks in by_shard.items()
        }
        return PreparedPush(round_, version, messages)

    def send(self, prepared: PreparedPush) -> int:
        """Push committed messages to their shards once the round's commitments are frozen
        and the shards opened it; returns bytes pushed (0: the round ended first)."""
        wait_s = self.config.training.deadline_s + _PEER_WAIT_S
        if not self._wait_for_push_phase(prepared.round, wait_s):
            _log.info("%s: round %d ended before its push phase", self.name, prepared.round)
            return 0
        total = 0
        for sid, messages in prepared.messages.items():
            try:
                self._push_to(sid, messages)
            except (RoundClosedError, PeerUnavailableError) as exc:
                _log.info("%s: push refused: %s", self.name, exc)
                continue
            total += sum(m.ByteSize() for m in messages)
        self._sent = prepared
        self.bytes_pushed += total
        return total

    def _resend(self, task: coordinator_pb2.Task) -> None:
        """Asked again for a round we pushed (the coordinator restarted before it saw our
        report): push the same signed messages again (the shards acknowledge them as
        duplicates and count them once) and report again."""
        sent = self._sent
        if sent is None or sent.round != task.round:
            time.sleep(max(0.05, task.retry_after))  # nothing of ours in that round
            return
        for sid, messages in sent.messages.items():
            try:
                self._push_to(sid, messages)
            except (RoundClosedError, PeerUnavailableError) as exc:
                _log.info("%s: resend refused: %s", self.name, exc)
        self._report(task.round, 0, budget_exhausted=False)

    def _get_task(self, timeout_s: float) -> coordinator_pb2.Task:
        """The coordinator's next task for us (waiting out its restarts up to ``timeout_s``)."""
        return self._retry(self._poll_task, "get task", timeout_s)

    def _poll_task(self) -> coordinator_pb2.Task:
        """One ``GetTask`` call, carrying the spend recorded in the ledger."""
        request = coordinator_pb2.TaskRequest(
            client_id=self.client_id,
            epsilon=self.recorded.epsilon,
            delta=self.config.privacy.delta,
        )
        task: coordinator_pb2.Task = self._coordinator.GetTask(
            request, metadata=self._metadata(), timeout=_CALL_S
        )
        return task

    def _wait_for_push_phase(self, round_: int, timeout_s: float) -> bool:
        """After committing to ``round_``: wait until the coordinator says the round's
        commitments are frozen and the shards take pushes (False: the round ended without
        a push phase, e.g. too few clients committed)."""
        until = time.time() + timeout_s
        while time.time() < until:
            task = self._get_task(timeout_s)
            if task.kind == coordinator_pb2.Task.PUSH and task.round == round_:
                return True
            if task.kind == coordinator_pb2.Task.DONE or task.round > round_:
                return False
            time.sleep(max(0.05, min(task.retry_after, 0.2)))
        return False

    def _commit(
        self, round_: int, version: int, weight: float, coefficients: np.ndarray
    ) -> tuple[int, common_pb2.SignedUpdate] | None:
        """Commit to the encrypted update at the key holder: its signed block roots and the
        sketches of its blocks under the round's challenge. Returns the round it committed
        to and the signed update, or None when the round's commitments had closed (async:
        after trying the next buffers too, as a stale update)."""
        attempts = 3 if self.config.training.mode == "async" else 1
        for attempt in range(attempts):
            nonce, signature, roots = sign_update(
                self._signer,
                coefficients,
                run_id=self.run_id,
                round_=round_,
                client_id=self.client_id,
                context_id=self._context_id,
                weight=weight,
                version=version,
            )
            update = common_pb2.SignedUpdate(
                client_id=self.client_id,
                weight=weight,
                nonce=nonce,
                signature=signature,
                roots=roots,
                version=version,
            )
            request = keyholder_pb2.CommitRequest(
                round=round_, update=update, sketches=self._sketches(round_, coefficients)
            )
            try:
                self._retry(
                    lambda: self._keyholder.Commit(request, timeout=_CALL_S),  # noqa: B023
                    "commit",
                    _PEER_WAIT_S,
                )
                return round_, update
            except RoundClosedError as exc:
                _log.info("%s: commitment refused: %s", self.name, exc)
                if attempt == attempts - 1:
                    return None
            except (InvalidArgumentError, UnknownClientError) as exc:
                # e.g. we restarted mid-round with a new key: sit this round out
                _log.warning("%s: commitment refused: %s", self.name, exc)
                return None
            # Async: the buffer froze before we committed; the update joins the next one.
            following = self._next_round(round_)
            if following is None:
                return None
            round_ = following
        return None

    def _sketches(self, round_: int, coefficients: np.ndarray) -> bytes:
        """The round's sketches of every encrypted block (none without encryption)."""
        if not isinstance(self._encryptor, BlockEncryptor):
            return b""
        reply = self._retry(
            lambda: self._keyholder.GetChallenge(
                keyholder_pb2.ChallengeRequest(round=round_, client_id=self.client_id),
                timeout=_CALL_S,
            ),
            "challenge",
            _PEER_WAIT_S,
        )
        public = self._encryptor.public
        challenge = Challenge(
            reply.seed, modulus=public.modulus, coeffs_per_block=public.coeffs_per_block
        )
        return challenge.sketch(coefficients).astype("<u8").tobytes()

    def _next_round(self, round_: int, timeout_s: float = 60.0) -> int | None:
        """The next round (buffer) after ``round_`` that asks us to train, if one comes."""
        until = time.time() + timeout_s
        while time.time() < until:
            task = self._get_task(timeout_s)
            if task.kind == coordinator_pb2.Task.DONE:
                return None
            if task.kind == coordinator_pb2.Task.TRAIN and task.round > round_:
                return int(task.round)
            time.sleep(max(0.05, task.retry_after))
        return None

    def _push_to(self, sid: str, messages: list[shard_pb2.PushRequest]) -> None:
        """Push messages to one shard, waiting out a restart (the shard's log keeps what it
        acknowledged, so a retry after a lost acknowledgement is counted once)."""
        stub = self._params.stubs[sid]
        self._retry(
            lambda: stub.PushBlocks(iter(messages), timeout=_PUSH_S), f"push to {sid}", _PEER_WAIT_S
        )

    def _report(self, round_: int, pushed: int, *, budget_exhausted: bool) -> None:
        report = coordinator_pb2.UpdateReport(
            client_id=self.client_id,
            round=round_,
            weight=self.weight,
            epsilon=self.recorded.epsilon,
            delta=self.config.privacy.delta,
            bytes_pushed=pushed,
            budget_exhausted=budget_exhausted,
            noise_multiplier=self.trainer.noise_multiplier,
        )
        self._retry(
            lambda: self._coordinator.ReportUpdate(
                report, metadata=self._metadata(), timeout=_CALL_S
            ),
            "report",
            60.0,
        )

    def _metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        """The credential the coordinator issued us, as call metadata."""
        return (("x-fedps-credential", self._credential.hex()),) if self._credential else ()

    def _retry(self, fn: Callable[[], _T], what: str, timeout_s: float) -> _T:
        """Call ``fn``, retrying while the peer is unavailable (restarts, slow starts)."""
        return call_until(fn, what, timeout_s=timeout_s)
