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

:meth:`EdgeClient.run` loops over the coordinator's tasks with :meth:`EdgeClient.run_task`;
steps 2 to 5 are :meth:`EdgeClient.train_round`, the part a Flower node runs too
(:mod:`clients.flower.flower_client`), and step 6 is :meth:`EdgeClient.send`. Mods
(:mod:`clients.train_step`) wrap the training from outside, as the simulated slow devices
and dropouts of :class:`clients.simulation.SimulatedDevice` do.

The client outlasts its peers: no answer of a shard, the coordinator or the key holder ends
it, whatever status or error class the answer names (a peer can name any class of
:mod:`fedps.errors`, :class:`~fedps.errors.ConfigError` or
:class:`~fedps.errors.QuarantinedError` included). A call a peer refused or failed (after
transient failures were retried for ``peer_wait_s``) is counted in
:attr:`EdgeClient.peer_failures`, shown in the round's :class:`RoundProgress` and logged as
a warning naming the peer and the reason; the client then goes on: a shard that refuses a
push costs that shard's blocks of the round (the others still get theirs, and the client
reports), a refused commitment costs the round, and any other refusal sends it back, after a
backoff, to asking the coordinator for its next task. A committed update is kept and pushed
when the coordinator asks for it, even after such a failure. A coordinator that refuses the
client's identity is asked again too (with a warning that names the enrolment token and the
certificate to check): a peer's word, or an impostor's, never stops the client. Only its own
faults do: its configuration, its identity and data as it loads them, its state folder, and
its configuration refusing the key holder it was pointed at (a signing key other than the
one ``security.keyholder_key`` pins, no encryption while ``he.enabled`` is set): each a
:class:`~fedps.errors.ConfigError` or :class:`~fedps.errors.CorruptStateError` the client
raises itself (never one a peer names), or an error that is not fedps's, such as a full disk.

The client's state folder (``<cluster.state_dir>/clients/<identity>``, or ``state_dir``)
keeps its signing key and privacy ledger across restarts: a restarted client registers with
the same id and key, reports the epsilon it had spent, and resumes its budget from there; it
refuses to train past its target.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import grpc
import numpy as np

from clients.client_state import ClientState, data_fingerprint, default_state_dir
from clients.dp_trainer import PrivacySpend, Trainer, create_trainer
from clients.train_step import TrainMod, TrainStep, chain
from crypto import PLAINTEXT_CONTEXT_ID, BlockEncryptor, PlainContext, PublicContext
from crypto.enrolment import TOKEN_SUFFIX, read_token
from crypto.signed_update import SignedUpdate
from crypto.signing import BlockSigner, model_verifier
from crypto.sketch import Challenge
from fedps.blocks import BlockLayout, flatten_model, load_flat
from fedps.ckks_params import ckks_params
from fedps.config import FedPSConfig
from fedps.coordinator_client import CoordinatorClient
from fedps.coordinator_messages import (
    ClientRegistration,
    RegistrationReply,
    Task,
    TaskQuery,
    UpdateReport,
)
from fedps.datasets import Dataset
from fedps.errors import (
    ConfigError,
    CorruptStateError,
    FedPSError,
    InvalidArgumentError,
    PeerUnavailableError,
    PolicyError,
    PrivacyBudgetExceededError,
    RoundClosedError,
    UnauthenticatedError,
    UnknownClientError,
    error_reason,
)
from fedps.hash_ring import HashRing
from fedps.keyholder_client import KeyHolderClient, verified_signing_key
from fedps.keyholder_messages import UpdateCommitment
from fedps.parameter_client import ParameterClient
from fedps.shard_messages import PushBatch
from fedps.tasks import ClientData, evaluate_model, load_task
from fedps.tasks import Task as UserTask
from fedps.transport import Backoff, batched

__all__ = [
    "EXTERNAL_DATA",
    "ClientSummary",
    "EdgeClient",
    "PreparedPush",
    "RoundOutcome",
    "RoundProgress",
    "Uplink",
    "client_partition",
]

#: The ledger's key (a fingerprint's format) for the spend of a given trainer, whose data
#: fedps never sees.
EXTERNAL_DATA = hashlib.sha256(b"fedps-data-v1/external").hexdigest()

_log = logging.getLogger("fedps")
_T = TypeVar("_T")
_PEER_WAIT_S = 90.0  # how long a call waits out a restarting peer (EdgeClient's peer_wait_s)
# The pauses of the task loop after a failed step: 0.5 s growing to 10 s, full jitter.
_LOOP_BACKOFF = {"first_s": 0.5, "cap_s": 10.0}
_PAUSE_S = 0.2  # after a step that failed before training, before the task is asked again
_REFUSALS_SHOWN = 32  # the most refusals one RoundProgress names
# The peers as counted and logged (a shard by its id).
_COORDINATOR, _KEY_HOLDER, _SHARDS = "coordinator", "key holder", "shards"
_UNKNOWN = "{}: not known before EdgeClient.connect and join"


class Uplink(Protocol):
    """What an :class:`EdgeClient` asks of whoever runs the rounds: its registration, its
    next task, and its report of a round. The default is the coordinator over gRPC
    (:class:`fedps.coordinator_client.CoordinatorClient`). ``retry_s``: how long a transient
    failure is retried (``None``: fail at once).

    :meth:`EdgeClient.run` and :meth:`EdgeClient.run_task` use it, and
    :meth:`EdgeClient.train_round` to announce the round's spend (``announce=True``). A caller
    that drives the rounds itself (a Flower node, whose strategy's messages carry each step)
    calls ``train_round(..., announce=False)`` and :meth:`EdgeClient.send`, and carries the
    spend and the report in its own replies.
    """

    def register(
        self, registration: ClientRegistration, *, retry_s: float | None = None
    ) -> RegistrationReply: ...

    def get_task(self, query: TaskQuery, *, retry_s: float | None = None) -> Task: ...

    def report_update(self, report: UpdateReport, *, retry_s: float | None = None) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class PreparedPush:
    """A committed update's signed push messages, per shard (resent unchanged if asked)."""

    round: int
    version: int
    messages: dict[str, list[PushBatch]]


@dataclass(frozen=True)
class RoundOutcome:
    """What :meth:`EdgeClient.train_round` did.

    Attributes
    ----------
    round
        The round the update was committed to (async: a later buffer than asked, when the
        asked one had frozen); the round asked for otherwise.
    trained
        Whether the client trained (False: it skipped the round: no model of that version,
        the coordinator could not be told the spend, or a mod kept the update back).
    prepared
        The committed update's push messages (None: not trained, or the round's commitments
        had closed).
    budget_exhausted
        The privacy budget is spent: nothing trained, and nothing will be.
    """

    round: int
    trained: bool = False
    prepared: PreparedPush | None = None
    budget_exhausted: bool = False


@dataclass(frozen=True)
class RoundProgress:
    """What a client did in one round it took part in (:class:`EdgeClient`'s ``on_round``).

    Attributes
    ----------
    client_id, round, rounds
        Who, which round, of how many (``training.rounds``).
    samples
        The client's training examples.
    loss
        The mean loss of its local batches (NaN: not known, such as a wrapped trainer's).
    epsilon, delta
        Its privacy spend so far.
    bytes_pushed, push_seconds
        What its push took (0 bytes: the round ended before the push, or the shards refused
        it).
    refused
        The calls peers refused or failed since the previous line (the last 32), as
        ``peer (reason)`` (``shard-1 (invalid_argument)``): this round's push, commitment or
        report, and the task requests before them.
    failures
        The client's calls that peers refused or failed so far (:attr:`EdgeClient.failures`).
    """

    client_id: str
    round: int
    rounds: int
    samples: int
    loss: float
    epsilon: float
    delta: float
    bytes_pushed: int
    push_seconds: float
    refused: tuple[str, ...] = ()
    failures: int = 0

    def line(self) -> str:
        """One readable line, such as ``client-0 round 3/20: 412 samples, loss 0.41,
        epsilon 1.84 (delta 1e-05), pushed 1.2 MB in 0.8 s``, ending ``; refused by
        shard-1 (invalid_argument), 1 peer failure so far`` when a peer refused a call."""
        parts = [f"{self.samples} samples"]
        if not math.isnan(self.loss):
            parts.append(f"loss {self.loss:.3g}")
        parts.append(f"epsilon {self.epsilon:.2f} (delta {self.delta:g})")
        if self.bytes_pushed:
            parts.append(f"pushed {self.bytes_pushed / 1e6:.1f} MB in {self.push_seconds:.1f} s")
        elif self.refused:
            parts.append("nothing pushed")
        else:
            parts.append("nothing pushed (the round ended first)")
        line = f"{self.client_id} round {self.round}/{self.rounds}: " + ", ".join(parts)
        if self.refused:
            line += f"; refused by {', '.join(self.refused)}"
        if self.failures:
            line += f"{';' if not self.refused else ','} {_failures(self.failures)} so far"
        return line


@dataclass(frozen=True)
class ClientSummary:
    """What one client did over the run."""

    client_id: str
    rounds_trained: int
    epsilon: float
    delta: float
    bytes_pushed: int
    failures: int = 0  # calls its peers refused or failed (EdgeClient.failures)


def client_partition(
    config: FedPSConfig, index: int, *, data: Path | None = None, task: UserTask | None = None
) -> Dataset:
    """Client ``index``'s own training data: ``task``'s (default: the configured task's)
    ``load_data`` for the file or folder ``data``; for a built-in dataset, partition ``index``
    under the configured partitioner."""
    t = config.training
    if not 0 <= index < t.clients:
        raise InvalidArgumentError(f"client index {index} out of range [0, {t.clients})")
    task = task or load_task(config)
    return task.client_data(ClientData(data, index=index, num_clients=t.clients, seed=t.seed))


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
    signer
        The client's signing key when it is kept elsewhere (a Flower node keeps it in its
        ``Context.state``): the client then keeps no state folder, and its ledger lives in
        memory. Default: the key in the state folder.
    token_required
        Insist on the enrolment token even under mutual TLS (a Flower node is registered by
        its token whatever the transport).
    mods
        Wrap every round's training (:data:`clients.train_step.TrainMod`), the first
        outermost; for example :class:`clients.simulation.SimulatedDevice`.
    data
        The client's own data, passed to the task's ``load_data`` (``fedps client --data``).
    task
        The task to train (default: the configured one, :func:`fedps.tasks.load_task`).
    on_round
        Called with a :class:`RoundProgress` after each round the client took part in (the
        CLI prints its line).
    uplink
        Where it registers, asks for tasks and reports (default: the coordinator of
        ``config.cluster`` over gRPC); closed by :meth:`close`.
    trainer
        A trainer the caller built, for a training fedps does not run itself (a Flower node
        that wraps the user's own ``train``:
        :class:`clients.flower.wrapped_trainer.WrappedTrainer`); no data is loaded then, and
        the ledger keeps its spend under :data:`EXTERNAL_DATA`.
        Default: the task's trainer for ``privacy.level`` on the client's own data.
    peer_wait_s
        How long a call to a peer retries its transient failures (a peer restarting,
        unreachable or overloaded) before the call counts as failed.

    Its identity is ``tls.name`` or ``client-INDEX``: the certificate it presents under mutual
    TLS, or, without TLS, the enrolment token ``tls.directory/NAME.token`` it registers with.

    Raises
    ------
    ConfigError
        Without TLS (``tls.insecure``) and without a readable enrolment token; or a state
        folder in use by another process, of another identity, or with a corrupt ledger.
    InvalidArgumentError
        Both ``state_dir`` and ``signer`` given, or both ``data`` and ``trainer``.

    Attributes
    ----------
    peer_failures
        The calls peers refused or failed, counted by ``"peer: reason"`` (``"shard-1:
        invalid_argument"``, ``"coordinator: unauthenticated"``); :attr:`failures` is their
        total.
    """

    def __init__(
        self,
        config: FedPSConfig,
        *,
        index: int,
        name: str = "",
        state_dir: Path | None = None,
        signer: BlockSigner | None = None,
        token_required: bool = False,
        mods: Sequence[TrainMod] = (),
        data: Path | None = None,
        task: UserTask | None = None,
        trainer: Trainer | None = None,
        on_round: Callable[[RoundProgress], None] | None = None,
        uplink: Uplink | None = None,
        peer_wait_s: float = _PEER_WAIT_S,
    ) -> None:
        if state_dir is not None and signer is not None:
            raise InvalidArgumentError("a client keeps its key in state_dir or is given one")
        if data is not None and trainer is not None:
            raise InvalidArgumentError("a given trainer holds the client's data; no data then")
        self.config = config
        self.name = name or f"edge-{index}"
        self.identity = config.tls.name or f"client-{index}"
        self.mods = tuple(mods)
        self.on_round = on_round
        self.peer_wait_s = peer_wait_s
        self._enrolment_token = self._load_token(required=token_required or config.tls.insecure)
        self.state = (
            self._open_state(state_dir)
            if signer is None
            else ClientState(self.identity, signer)  # in memory
        )
        if trainer is None:
            self.task = task or load_task(config)
            own = client_partition(config, index, data=data, task=self.task)
            model = self.task.create_model(config.training.seed)
            self.task.check_fit(model, own)
            trainer = create_trainer(
                model,
                own,
                training=config.training,
                privacy=config.privacy,
                seed=config.training.seed * 1000 + index + 1,
                task=self.task,
            )
            self._data = data_fingerprint(own)
        else:
            self.task = task or trainer.task
            self._data = EXTERNAL_DATA
            own = None
        self.trainer = trainer
        self.num_params = flatten_model(trainer.model).size
        # task.client_eval: the metrics of each round's starting model on the client's data,
        # only for a task without the operator's evaluation data (else none would be used)
        client_eval = config.task.client_eval and self.task.load_eval_data is None
        self._eval_data = own if client_eval and own is not None else None
        self._metrics: dict[int, dict[str, float]] = {}  # by round, until reported
        if self._eval_data is not None:
            _log.warning(
                "%s: task.client_eval: the task's metrics on this client's own data go to the "
                "coordinator every round, outside the DP guarantee",
                self.name,
            )
        self.recorded = self._restore_spend()  # the spend the ledger holds
        # Every call has a deadline: one caught in a peer's restart fails and is retried.
        self.uplink: Uplink = (
            uplink if uplink is not None else CoordinatorClient(config.cluster.coordinator)
        )
        self.client_id = ""
        self.run_id = ""
        self.bytes_pushed = 0
        self.rounds_trained = 0
        self.peer_failures: Counter[str] = Counter()
        # "peer (reason)" since the last RoundProgress (the latest, where none is made)
        self._refused: deque[str] = deque(maxlen=_REFUSALS_SHOWN)
        self._push_seconds = 0.0  # what the last push took
        self.weight = 1.0  # num_examples / the round's weight_scale
        self._signer = self.state.signer
        # the last committed update (pushed or not), pushed when the coordinator asks for it
        self._committed: PreparedPush | None = None
        # Known once connected (connect) and joined to a run (join):
        self._keyholder: KeyHolderClient | None = None
        self._params: ParameterClient | None = None
        self._ring: HashRing | None = None
        self._keyholder_key = b""  # the key holder's signing key, once its context verified
        self._context_id = ""
        self._values_per_block = 0
        self._encryptor: BlockEncryptor | PlainContext | None = None
        self._layout: BlockLayout | None = None

    @property
    def signing_key(self) -> bytes:
        """The Ed25519 public key this client signs its updates with."""
        return self._signer.public_key

    @property
    def data_fingerprint(self) -> str:
        """What the privacy ledger keys this client's spend by: its data's fingerprint."""
        return self._data

    @property
    def enrolment_token(self) -> str:
        """The token that proves this client's identity (empty if it has none)."""
        return self._enrolment_token

    @property
    def failures(self) -> int:
        """How many of the client's calls peers refused or failed (:attr:`peer_failures`)."""
        return self.peer_failures.total()

    def run(self, *, timeout_s: float = 3600.0) -> ClientSummary:
        """Take part in training until the coordinator says done (or the budget is spent).

        No peer ends the client (see the module's docstring): a call a peer refused or
        failed is counted and logged, and the client goes on; after a failure that leaves
        it without a task it pauses (exponential backoff, full jitter) and asks the
        coordinator again, registering again with a coordinator that forgot it, or that
        refused its registration or credential. Only the client's own faults raise (see
        the module's docstring): a :class:`~fedps.errors.ConfigError` or
        :class:`~fedps.errors.CorruptStateError` it found itself (its configuration, its
        state folder, its configuration refusing the key holder), never a peer's answer
        naming them, and errors that are not fedps's, such as a full disk. ``timeout_s``
        bounds the whole run.
        """
        deadline = time.time() + timeout_s
        try:
            if self._start(deadline):
                _log.info("%s registered as %s", self.name, self.client_id)
                self._run_tasks(deadline)
        finally:
            self.shutdown()
        return ClientSummary(
            self.client_id,
            self.rounds_trained,
            self.recorded.epsilon,
            self.config.privacy.delta,
            self.bytes_pushed,
            self.failures,
        )

    def _start(self, deadline: float) -> bool:
        """Register, connect to the key holder and the shards the coordinator names, and
        join its run; whatever a peer answers is counted and asked again after a backoff,
        until ``deadline`` (``time.time()``). False: the deadline passed first. Raises
        what the client's own configuration refuses (:meth:`_fetch_context`)."""
        backoff = Backoff(**_LOOP_BACKOFF)
        while (left := deadline - time.time()) > 0:
            try:
                reply = self._register(left)
                self.connect(reply.keyholder, reply.shards, virtual_nodes=reply.virtual_nodes)
            except FedPSError as exc:
                self._failed(_COORDINATOR, exc)
            else:
                try:
                    self.join(run_id=reply.run_id, client_id=self.client_id, timeout_s=left)
                    return True
                except FedPSError as exc:  # its public context: unreachable, or refused
                    if _own_fault(exc):  # our configuration refuses that key holder
                        raise
                    self._failed(_KEY_HOLDER, exc)
            backoff.pause()
        _log.warning("%s: joined no run before its timeout", self.name)
        return False

    def _run_tasks(self, deadline: float) -> None:
        """Ask for tasks and carry them out until the run is over for us or ``deadline``
        (``time.time()``), surviving every answer of a peer.

        The steps that talk to the shards and the key holder count their peers' refusals
        themselves; what reaches this loop is the coordinator's (its tasks, a registration
        again) or the client's own."""
        backoff = Backoff(**_LOOP_BACKOFF)
        registered = True
        while (left := deadline - time.time()) > 0:
            try:
                if not registered:
                    self._register(left)
                    registered = True
                if not self.run_task(self._get_task(left)):
                    return
                backoff.reset()
                continue
            except FedPSError as exc:
                if not _from_peer(exc) and isinstance(exc, PrivacyBudgetExceededError):
                    _log.info("%s: %s; done", self.name, exc)  # our own accountant says so
                    return
                if _own_fault(exc):
                    raise
                if isinstance(exc, UnknownClientError):  # the coordinator restarted without us
                    _log.info("%s: %s; registering again", self.name, exc)
                    registered = False
                else:
                    self._failed(_COORDINATOR, exc)
                    # a credential refused: a registration again brings a fresh one
                    registered = registered and not isinstance(exc, UnauthenticatedError)
            backoff.pause()

    def run_task(self, task: Task) -> bool:
        """Carry out one task of the coordinator.

        ``TRAIN``: :meth:`train_round`, then push the update once the round's commitments
        are frozen and report to the coordinator. ``PUSH``: push again what was pushed for
        that round (the coordinator restarted before it saw the report). ``WAIT`` and
        ``DONE``: count the rounds that went on without this client (client-level DP), then
        wait ``task.retry_after`` or stop.

        Returns
        -------
        bool
            False when this client is done: the run is over or its privacy budget is spent.
        """
        if task.kind in ("wait", "done"):
            self._sit_out(task.round, final=task.kind == "done")
        if task.kind == "done":
            return False
        if task.kind == "train":
            return self._train(task)
        if task.kind == "push":
            self._resend(task)
        else:
            time.sleep(max(0.05, task.retry_after))
        return True

    def connect(self, keyholder: str, shards: Mapping[str, str], *, virtual_nodes: int) -> None:
        """Open channels to the key holder and the shards (``{shard_id: address}``, whose
        blocks the hash ring with ``virtual_nodes`` assigns)."""
        self.disconnect()
        self._keyholder = KeyHolderClient(keyholder)
        self._params = ParameterClient(dict(shards))
        self._ring = HashRing(sorted(shards), virtual_nodes=virtual_nodes)

    @property
    def connected(self) -> bool:
        """Whether :meth:`connect` opened channels that :meth:`disconnect` has not closed."""
        return self._params is not None

    def join(self, *, run_id: str, client_id: str, timeout_s: float = 60.0) -> None:
        """Take part in run ``run_id`` as ``client_id``: fetch, verify and adopt the key
        holder's public context (trusted on first use unless ``security.keyholder_key`` pins
        it), and count the trainer's rounds in that run. Call after :meth:`connect`."""
        self.client_id, self.run_id = client_id, run_id
        self.trainer.set_run(run_id)
        self._keyholder_key = b""
        self._fetch_context(timeout_s)
        self._layout = BlockLayout(self.num_params, self._values_per_block)

    def disconnect(self) -> None:
        """Close the channels :meth:`connect` opened; the public context, the encryptor and
        its encryptions of zero are kept (:meth:`connect` again to go on)."""
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

    def close(self) -> None:
        """Release the state folder (another process may then use it) and close the
        uplink."""
        self.state.close()
        self.uplink.close()

    # ------------------------------------------------------------------ privacy state
    def _open_state(self, state_dir: Path | None) -> ClientState:
        """This client's state folder, locked for this process."""
        directory = state_dir or default_state_dir(self.config, self.identity)
        return ClientState.open(directory, identity=self.identity)

    def _restore_spend(self) -> PrivacySpend:
        """Resume the trainer's accountant from the ledger; returns the spend restored.

        Data the ledger has not seen (a file that grew or changed, other preprocessing) may
        overlap the data this client trained on before: the spend recorded on other data is
        then composed with it, so the budget never starts again from zero.
        """
        level = self.config.privacy.level
        entry = self.state.spent(self._data, level)
        earlier = self.state.spent_on_other_data(self._data, level)
        if entry is None and earlier:
            self.trainer.restore([step for e in earlier for step in e.history])
            _log.warning(
                "%s: its data changed since it last trained; the spend recorded on the earlier "
                "data (%s) counts too, as the data may overlap: epsilon %.3f spent (delta %g)",
                self.name,
                self.state.ledger_path,
                self.trainer.epsilon(),
                self.config.privacy.delta,
            )
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

    def _record_spend(self, *, announce: bool) -> bool:
        """Before training: record what the round will have spent in the ledger (durable),
        then (``announce``) tell the coordinator. Whatever happens afterwards (a crash while
        training, a push that never lands), neither reports less than was spent; killed
        before it trains, the client has recorded one round too many. Returns False when the
        round must not be trained: the coordinator could not be told, or it restarted
        without us (we register again, which carries the spend, and wait for a fresh
        task)."""
        self._record(self.trainer.spend_after_next_round())
        if not announce:
            return True
        try:
            self._announce_spend()
        except UnknownClientError:
            self._register(self.peer_wait_s)
            return False
        except FedPSError as exc:  # not told: the round is not trained
            self._failed(_COORDINATOR, exc)
            time.sleep(_PAUSE_S)
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
                self._poll_task()
            except FedPSError as exc:  # the ledger has it; a next registration carries it
                _log.info("%s: cannot tell the coordinator its final spend: %s", self.name, exc)

    def _record(self, spend: PrivacySpend) -> None:
        """Write ``spend`` to the ledger (durable), then carry it in every later call."""
        self.state.record(self._data, spend, privacy=self.config.privacy)
        self.recorded = spend

    def _announce_spend(self) -> None:
        """Tell the coordinator the recorded spend (every ``GetTask`` call carries it)."""
        self._get_task(self.peer_wait_s)

    def _adopt_context(self, context_id: str) -> bool:
        """Fetch the key holder's public context ``context_id`` if it is not ours (the key
        holder rotated its keys); an empty id changes nothing. False (counted and logged):
        the key holder's context could not be fetched, or was refused; ours is kept. Raises
        what the client's own configuration refuses (:meth:`_fetch_context`)."""
        if not context_id or context_id == self._context_id:
            return True
        try:
            self._fetch_context()
        except FedPSError as exc:
            if _own_fault(exc):
                raise
            self._failed(_KEY_HOLDER, exc)
            return False
        return True

    def _fetch_context(self, timeout_s: float = 60.0) -> None:
        """Fetch, verify and adopt the key holder's current public context (nothing is
        adopted unless all of it verifies).

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
        keyholder = _known(self._keyholder, "the key holder")
        ctx = keyholder.get_public_context(retry_s=timeout_s)
        pinned = self.config.security.keyholder_key
        if pinned and bytes.fromhex(pinned) != ctx.signing_key:  # our configuration refuses it
            raise ConfigError(
                "the key holder's signing key does not match security.keyholder_key (pinned); "
                "refusing its public context"
            )
        if self._keyholder_key and ctx.signing_key != self._keyholder_key:
            raise InvalidArgumentError("the key holder's signing key changed during the run")
        key = verified_signing_key(  # trusted on first use only: a rotation keeps the key
            ctx,
            pinned=pinned or self._keyholder_key.hex(),
            refusing="its public context",
            who=f"{self.name}: key holder key",
        )
        encryptor = self._make_encryptor(ctx.context, ctx.context_id)
        if isinstance(self._encryptor, BlockEncryptor):
            self._encryptor.close()
        self._keyholder_key, self._context_id, self._encryptor = key, ctx.context_id, encryptor

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

    def _register(self, timeout_s: float) -> RegistrationReply:
        registration = ClientRegistration(
            name=self.name,
            num_examples=self.trainer.num_examples,
            num_params=self.num_params,
            signing_key=self._signer.public_key,
            enrolment_token=self._enrolment_token,
            epsilon=self.recorded.epsilon,
            delta=self.config.privacy.delta,
        )
        reply = self.uplink.register(registration, retry_s=timeout_s)
        self.client_id = reply.client_id
        self.trainer.set_run(reply.run_id)
        if self.run_id and reply.run_id != self.run_id:  # a coordinator that lost its state
            _log.warning(
                "%s: the coordinator runs %s now, not %s", self.name, reply.run_id, self.run_id
            )
            self.run_id, self._committed = reply.run_id, None
        return reply

    def _train(self, task: Task) -> bool:
        """Train, push and report one round; returns False when the privacy budget is spent."""
        if not self._adopt_context(task.context_id):
            time.sleep(_PAUSE_S)
            return True
        committed = self._committed
        if committed is not None and (committed.round, committed.version) == (
            task.round,
            task.version,
        ):
            self._deliver(committed)  # never train twice for a round
            return True
        outcome = self.train_round(
            task.round,
            task.version,
            weight_scale=task.weight_scale,
            deadline_unix=task.deadline_unix,
            context_id=task.context_id,
        )
        if outcome.budget_exhausted:
            self._report(task.round, 0, budget_exhausted=True)
            return False
        if not outcome.trained:
            return True
        if outcome.prepared is None:  # the round's commitments closed, or were refused
            self._conclude(outcome.round, 0)
        else:
            self._committed = outcome.prepared  # kept through a failure of what follows
            self._deliver(outcome.prepared)
        # Offline half of encryption, at low priority while we wait for the next round.
        self.precompute(background=True)
        return True

    def train_round(
        self,
        round_: int,
        version: int,
        *,
        weight_scale: float = 1.0,
        deadline_unix: float = 0.0,
        context_id: str = "",
        announce: bool = True,
    ) -> RoundOutcome:
        """Train one round and commit its update, ready to :meth:`send`.

        Pull version ``version`` from the shards, record what the round will spend in the
        ledger (and, with ``announce``, tell the coordinator), train with DP through the
        client's mods, weight the update (``weight_scale``: the cohort's largest
        ``num_examples``), encrypt it and commit it at the key holder. Nothing reaches a shard:
        :meth:`send` pushes the committed update once the round's commitments are frozen.

        Parameters
        ----------
        round_, version
            The round and the model version it trains on.
        weight_scale
            The cohort's largest ``num_examples`` (used with ``security.weighting =
            "examples"``).
        deadline_unix
            When the round closes (for the mods).
        context_id
            The key holder's current public context; another than ours is fetched first.
        announce
            Tell the coordinator the spend before training (False where the caller carries
            it, as a Flower reply does).

        Returns
        -------
        RoundOutcome
            Whether it trained, the committed update (None when the round's commitments had
            closed) and the round it committed to, or whether the budget is spent.
        """
        if not self._adopt_context(context_id):
            return RoundOutcome(round_)
        self.trainer.set_round(round_)
        if not self.trainer.can_train_round():
            _log.info("%s: privacy budget spent (epsilon %.3f)", self.name, self.recorded.epsilon)
            return RoundOutcome(round_, budget_exhausted=True)
        try:
            vector, pulled = _known(self._params, "the shards").pull(
                _known(self._layout, "the block layout"),
                min_version=version,
                verify=model_verifier(self._keyholder_key),
            )
        except FedPSError as exc:
            self._failed(_SHARDS, exc)
            time.sleep(_PAUSE_S)
            return RoundOutcome(round_)
        if pulled != version:
            _log.info("%s: shards moved to version %d; skipping round", self.name, pulled)
            return RoundOutcome(round_)
        if self._eval_data is not None:
            self._metrics = {round_: self._evaluate(vector)}
        if not self._record_spend(announce=announce):
            return RoundOutcome(round_)
        step = TrainStep(
            self.name, self.client_id, round_, version, deadline_unix, self._weight(weight_scale)
        )
        delta = chain(self.mods, self._train_step)(step, vector)
        if delta is None:  # a mod kept the update back
            return RoundOutcome(round_)
        self.weight = step.weight
        prepared = self.prepare(round_, version, delta)
        self.rounds_trained += 1
        committed = round_ if prepared is None else prepared.round
        return RoundOutcome(committed, trained=True, prepared=prepared)

    def _evaluate(self, vector: np.ndarray) -> dict[str, float]:
        """The task's metrics of ``vector`` on the client's own data (``task.client_eval``)."""
        assert self._eval_data is not None
        model = self.task.create_model(self.config.training.seed)
        load_flat(model, vector)
        return evaluate_model(self.task, model, self._eval_data)

    def _train_step(self, step: TrainStep, params: np.ndarray) -> np.ndarray:
        """Local DP training from ``params`` (the innermost step of the mods' chain)."""
        return self.trainer.train_round(params)

    def _weight(self, weight_scale: float) -> float:
        """The update's aggregation weight for a round of ``weight_scale``."""
        security = self.config.security
        if self.config.privacy.level == "client" or security.weighting == "uniform":
            return 1.0  # every client weighs the same (the key holder insists)
        share = self.trainer.num_examples / max(weight_scale, 1.0)
        return min(1.0, max(security.min_weight, share))

    def precompute(self, *, background: bool) -> None:
        """Draw the encryptions of zero the next update needs (the offline half of
        encryption), now or (``background``) in a low-priority process; nothing without
        encryption."""
        if isinstance(self._encryptor, BlockEncryptor):
            blocks = _known(self._layout, "the block layout").num_blocks
            if background:
                self._encryptor.precompute_in_background(blocks)
            else:
                self._encryptor.precompute(blocks)

    def prepare(self, round_: int, version: int, delta: np.ndarray) -> PreparedPush | None:
        """Weight, clip, encrypt and commit an update; returns the signed push messages per
        shard (None when the round's commitments had closed)."""
        he = self.config.he
        weight = self.weight
        weighted = delta * weight
        clipped = np.clip(weighted, -he.max_abs_value, he.max_abs_value)
        if not np.array_equal(clipped, weighted):
            _log.warning("%s: update clipped to +-%g for encryption", self.name, he.max_abs_value)
        committed = self._commit(round_, version, weight, clipped)
        if committed is None:
            return None
        round_, update, encrypted = committed
        ring = _known(self._ring, "the shards")
        by_shard: dict[str, list[tuple[int, bytes]]] = {}
        for block, data in encrypted.items():
            by_shard.setdefault(ring.owner(block), []).append((block, data))
        messages = {
            sid: [
                PushBatch.carrying(update, round_=round_, context_id=self._context_id, blocks=batch)
                for batch in batched(blocks, lambda b: len(b[1]))
            ]
            for sid, blocks in by_shard.items()
        }
        return PreparedPush(round_, version, messages)

    def _deliver(self, prepared: PreparedPush) -> None:
        """Push a committed update once its round's push phase opens, report it, and tell
        ``on_round``."""
        self._push_seconds = 0.0
        pushed = self._push_when_open(prepared)
        self._conclude(prepared.round, pushed)

    def _conclude(self, round_: int, pushed: int) -> None:
        """Report a round the client trained for (``pushed`` bytes) and tell ``on_round``."""
        try:
            self._report(round_, pushed, budget_exhausted=False)
        finally:
            refused = tuple(self._refused)
            self._refused.clear()
            if self.on_round is not None:
                self.on_round(
                    RoundProgress(
                        client_id=self.client_id or self.identity,
                        round=round_,
                        rounds=self.config.training.rounds,
                        samples=self.trainer.num_examples,
                        loss=self.trainer.last_loss,
                        epsilon=self.recorded.epsilon,
                        delta=self.config.privacy.delta,
                        bytes_pushed=pushed,
                        push_seconds=self._push_seconds if pushed else 0.0,
                        refused=refused,
                        failures=self.failures,
                    )
                )

    def _push_when_open(self, prepared: PreparedPush) -> int:
        """:meth:`send` once the coordinator says the round's commitments are frozen and the
        shards opened it; returns bytes pushed (0: the round ended first)."""
        wait_s = self.config.training.deadline_s + self.peer_wait_s
        if not self._wait_for_push_phase(prepared.round, wait_s):
            _log.info("%s: round %d ended before its push phase", self.name, prepared.round)
            return 0
        return self.send(prepared)

    def send(self, prepared: PreparedPush) -> int:
        """Push committed messages to their shards now (the round's commitments must be
        frozen and the shards have opened it); returns bytes pushed. A shard that refuses
        or keeps failing counts no bytes (and a failure, :attr:`peer_failures`)."""
        started = time.monotonic()
        total = self._push_all(prepared)
        self._push_seconds = time.monotonic() - started
        self._committed = prepared
        self.bytes_pushed += total
        return total

    def _push_all(self, prepared: PreparedPush) -> int:
        """Push to every shard that owns a block; returns the bytes the shards took. A shard
        that refuses, whatever it answers, or keeps failing is counted, logged and skipped:
        the others still get theirs, and the round's close decides."""
        total = 0
        for sid, messages in prepared.messages.items():
            try:
                total += self._push_to(sid, messages)
            except FedPSError as exc:
                self._failed(sid, exc)
        return total

    def _resend(self, task: Task) -> None:
        """Asked to push for a round we committed to: after a failure cut our wait for the
        push phase short, or again (the coordinator restarted before it saw our report).
        Push the same signed messages (shards acknowledge a repeat as a duplicate and count
        it once) and report."""
        committed = self._committed
        if committed is None or committed.round != task.round:
            time.sleep(max(0.05, task.retry_after))  # nothing of ours in that round
            return
        self._push_all(committed)
        self._report(task.round, 0, budget_exhausted=False)

    def _get_task(self, timeout_s: float) -> Task:
        """The coordinator's next task for us (waiting out its restarts up to ``timeout_s``)."""
        return self._poll_task(retry_s=timeout_s)

    def _poll_task(self, *, retry_s: float | None = None) -> Task:
        """One ``GetTask`` call (retried while the coordinator is unavailable, up to
        ``retry_s``), carrying the spend recorded in the ledger."""
        query = TaskQuery(self.client_id, self.recorded.epsilon, self.config.privacy.delta)
        return self.uplink.get_task(query, retry_s=retry_s)

    def _wait_for_push_phase(self, round_: int, timeout_s: float) -> bool:
        """After committing to ``round_``: wait until the coordinator says the round's
        commitments are frozen and the shards take pushes (False: the round ended without
        a push phase, e.g. too few clients committed)."""
        until = time.time() + timeout_s
        while time.time() < until:
            task = self._get_task(timeout_s)
            if task.kind == "push" and task.round == round_:
                return True
            if task.kind == "done" or task.round > round_:
                return False
            time.sleep(max(0.05, min(task.retry_after, 0.2)))
        return False

    def _commit(
        self, round_: int, version: int, weight: float, values: np.ndarray
    ) -> tuple[int, SignedUpdate, dict[int, bytes]] | None:
        """Encrypt the update's ``values`` and commit to them at the key holder: the signed
        block roots and the sketches of the blocks under the round's challenge. Returns the
        round it committed to, the signed update and the encrypted blocks, or None when the
        round's commitments had closed (async: after trying the next buffers too, as a stale
        update; a buffer under a new key, the key holder having rotated its keys since, gets
        the values encrypted again under it)."""
        keyholder = _known(self._keyholder, "the key holder")
        attempts = 3 if self.config.training.mode == "async" else 1
        encrypted, coefficients = self._encrypt(values)
        for attempt in range(attempts):
            update = SignedUpdate.sign(
                self._signer,
                coefficients,
                run_id=self.run_id,
                round_=round_,
                client_id=self.client_id,
                context_id=self._context_id,
                weight=weight,
                version=version,
            )
            try:
                sketches = self._sketches(round_, coefficients)
                keyholder.commit(
                    UpdateCommitment(round_, update, sketches), retry_s=self.peer_wait_s
                )
                return round_, update, encrypted
            except RoundClosedError as exc:
                if attempt == attempts - 1:
                    self._failed(_KEY_HOLDER, exc, expected=True)
                    return None
                _log.info("%s: commitment refused: %s", self.name, exc)
            except FedPSError as exc:
                # e.g. we restarted mid-round with a new key: sit this round out
                self._failed(_KEY_HOLDER, exc)
                return None
            # Async: the buffer froze before we committed; the update joins the next one.
            following = self._next_round(round_)
            if following is None:
                return None
            if following.context_id not in ("", self._context_id):  # the keys rotated
                if not self._adopt_context(following.context_id):
                    return None
                _log.info(
                    "%s: the key holder rotated its keys; encrypting the update again for round %d",
                    self.name,
                    following.round,
                )
                encrypted, coefficients = self._encrypt(values)
            round_ = following.round
        return None

    def _encrypt(self, values: np.ndarray) -> tuple[dict[int, bytes], np.ndarray]:
        """``values`` encrypted under the current public context: the packed blocks and
        their coefficients."""
        encryptor = self._encryptor
        if encryptor is None:
            raise RuntimeError(_UNKNOWN.format("the public context"))
        return encryptor.encrypt_with_coefficients(values)

    def _sketches(self, round_: int, coefficients: np.ndarray) -> bytes:
        """The round's sketches of every encrypted block (none without encryption)."""
        encryptor = self._encryptor
        if not isinstance(encryptor, BlockEncryptor):
            return b""
        keyholder = _known(self._keyholder, "the key holder")
        seed = keyholder.get_challenge(round_, self.client_id, retry_s=self.peer_wait_s)
        public = encryptor.public
        challenge = Challenge(
            seed, modulus=public.modulus, coeffs_per_block=public.coeffs_per_block
        )
        return challenge.sketch(coefficients).astype("<u8").tobytes()

    def _next_round(self, round_: int, timeout_s: float = 60.0) -> Task | None:
        """The task of the next round (buffer) after ``round_`` that asks us to train, if
        one comes."""
        until = time.time() + timeout_s
        while time.time() < until:
            task = self._get_task(timeout_s)
            if task.kind == "done":
                return None
            if task.kind == "train" and task.round > round_:
                return task
            time.sleep(max(0.05, task.retry_after))
        return None

    def _push_to(self, sid: str, messages: list[PushBatch]) -> int:
        """Push messages to one shard, waiting out a restart (the shard's log keeps what it
        acknowledged, so a retry after a lost acknowledgement is counted once); returns the
        bytes sent."""
        shard = _known(self._params, "the shards").shards[sid]
        return shard.push_blocks(messages, retry_s=self.peer_wait_s).sent_bytes

    def _report(self, round_: int, pushed: int, *, budget_exhausted: bool) -> None:
        report = UpdateReport(
            client_id=self.client_id,
            round=round_,
            weight=self.weight,
            epsilon=self.recorded.epsilon,
            delta=self.config.privacy.delta,
            bytes_pushed=pushed,
            budget_exhausted=budget_exhausted,
            noise_multiplier=self.trainer.noise_multiplier,
            metrics=self._metrics.pop(round_, {}),
        )
        try:
            self.uplink.report_update(report, retry_s=self.peer_wait_s)
        except UnknownClientError:
            raise  # the coordinator restarted without us: the task loop registers again
        except FedPSError as exc:
            self._failed(_COORDINATOR, exc)

    def _failed(self, peer: str, exc: FedPSError, *, expected: bool = False) -> None:
        """A call ``peer`` refused or failed, whatever it answered: count it
        (:attr:`peer_failures`, the next :class:`RoundProgress`) and log it, a warning
        unless ``expected`` (a commitment after its round closed: a slow client)."""
        reason = _reason(exc)
        self.peer_failures[f"{peer}: {reason}"] += 1
        self._refused.append(f"{peer} ({reason})")
        hint = ""
        if peer == _COORDINATOR and isinstance(exc, UnauthenticatedError | PolicyError):
            hint = (
                f"; if this lasts, check {self.identity}'s enrolment token "
                f"({self.config.tls.directory}) or certificate"
            )
        _log.log(
            logging.INFO if expected else logging.WARNING,
            "%s: %s refused or failed a call (%s): %s; going on, %s so far%s",
            self.name,
            peer,
            reason,
            exc,
            _failures(self.failures),
            hint,
        )


def _from_peer(exc: FedPSError) -> bool:
    """Whether ``exc`` is a peer's answer: a status received over gRPC
    (:func:`fedps.transport.call` raises its error from the :class:`grpc.RpcError`, whatever
    class the peer named) or a peer out of reach."""
    return isinstance(exc.__cause__, grpc.RpcError) or isinstance(exc, PeerUnavailableError)


def _own_fault(exc: FedPSError) -> bool:
    """Whether ``exc`` ends the client: its own configuration (refusing the key holder it
    was pointed at too) or state folder, found by the client itself (a peer that names these
    classes says nothing about this client's own files)."""
    return isinstance(exc, ConfigError | CorruptStateError) and not _from_peer(exc)


def _reason(exc: FedPSError) -> str:
    """``exc``'s kind, short (:func:`fedps.errors.error_reason`); for the root class, the
    status it came with (``unimplemented``)."""
    if type(exc) is not FedPSError:
        return error_reason(exc)
    cause = exc.__cause__
    return cause.code().name.lower() if isinstance(cause, grpc.Call) else "error"


def _failures(count: int) -> str:
    """``1 peer failure``, ``3 peer failures``."""
    return f"{count} peer failure{'' if count == 1 else 's'}"


def _known(value: _T | None, what: str) -> _T:
    """``value``, known once the client connected and joined a run (a programming error
    otherwise: call :meth:`EdgeClient.connect` and :meth:`EdgeClient.join` first)."""
    if value is None:
        raise RuntimeError(_UNKNOWN.format(what))
    return value
