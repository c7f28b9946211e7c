"""fedps inside a Flower ``ClientApp``: DP training, encrypted pushes, metadata-only replies.

A Flower app gains fedps's encrypted aggregation by using :func:`create_client_app` as its
``ClientApp`` (fedps trains, with DP-SGD) or by adding :class:`clients.flower.fedps_mod.FedPSMod`
to the ``mods`` of its own ``ClientApp`` (the app's ``train`` trains), with
:class:`server.flower.flower_strategy.FlowerStrategy` as its strategy. The Flower messages
replace the fedps coordinator's client protocol (register, get task, report); the update
itself never travels in a Flower message. Every fedps message is a Flower ``train`` message
whose ``"fedps"`` ConfigRecord names its stage (:mod:`fedps.rpc.flower_messages`), handled by a
:class:`FlowerNode`:

1. ``register``: the node answers with its Ed25519 public key, its number of training
   examples, the model size and its enrolment token (``tls.directory/client-N.token`` from
   ``fedps certs``); the strategy registers it with the coordinator as ``client-N``.
2. ``train``: the record also carries the coordinator's task (round, model version, client
   id, run id, context id, weight scale, deadline). The node runs the same round as
   :class:`clients.edge_client.EdgeClient`: it pulls the signed model of that version from the
   shards, trains with DP, weights, clips, encrypts, signs and commits the update at the key
   holder (the block roots and their sketches under the round's challenge), keeps the signed
   push messages in its ``Context.state`` and replies with metadata only (weight, epsilon),
   never the update.
3. ``push``: once every commitment of the round is fixed, the node pushes the messages it
   kept to the shards that own the blocks and replies with the bytes pushed.

Flower rebuilds the ``ClientApp`` for every message and may run a node's messages in
different processes. A node keeps its signing key and its privacy ledger in the same state
folder as an edge client (:class:`clients.client_state.ClientState`,
``<cluster.state_dir>/clients/<identity>``, the identity being ``tls.name`` or
``client-PARTITION``), on the SuperNode's disk: each message opens (and locks) the folder, and
the node's accountant resumes from the ledger before it does anything, so a SuperNode restarted
mid-run (its ``Context.state`` gone) signs with the same key and resumes its spend. Its
``Context.state`` keeps only the last round it trained and the push messages it committed,
until the push stage. The noise and Poisson sampling come from the CSPRNG
(:class:`crypto.randomness.SecureRandom`), fresh at every draw; only with
``privacy.insecure_reproducible`` are they seeded, from (``training.seed``, partition, round),
so that a rebuilt client never replays an earlier round's noise. Built clients are kept in a
small per-process cache purely as a speed-up; the ledger and the context are authoritative.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, closing, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, Protocol

from flwr.app import (
    ConfigRecord,
    ConfigRecordValues,
    Context,
    Message,
    MetricRecord,
    MetricRecordValues,
    RecordDict,
)
from flwr.clientapp import ClientApp

from clients.client_state import ClientState, default_state_dir
from clients.dp_trainer import Trainer
from clients.edge_client import EdgeClient, PreparedPush
from clients.flower.wrapped_trainer import LocalTrain, WrappedTrainer
from clients.simulation import SimulatedDevice
from clients.train_step import TrainMod
from crypto.randomness import SeededRandom
from crypto.signing import BlockSigner
from fedps.config import FedPSConfig, load_config
from fedps.errors import ConfigError, InvalidArgumentError
from fedps.provisioning import setup_tls
from fedps.rpc.coordinator_messages import (
    Assignment,
    AssignmentQuery,
    ClientRegistration,
    RegistrationReply,
    UpdateReport,
)
from fedps.rpc.flower_messages import (
    CONFIG_KEY,
    METRICS_KEY,
    PUSH_STAGE,
    RECORD_KEY,
    REGISTER_STAGE,
    FlowerTask,
    Registration,
    RoundReport,
    stage_of,
)
from fedps.rpc.shard_messages import PushBatch
from fedps.sharding.ring_view import RingView

__all__ = [
    "ClientFactory",
    "FlowerClient",
    "FlowerNode",
    "StrategyMessages",
    "create_client_app",
    "fedps_record",
]

_log = logging.getLogger("fedps")

_PARTITION_KEY = "partition-id"


class StrategyMessages:
    """A Flower node's uplink (:class:`~clients.client_session.Uplink`).

    The strategy's messages carry its registration and tasks and the replies its reports, so nothing
    is asked of a coordinator. :meth:`EdgeClient.run` and :meth:`EdgeClient.run_task`, which would
    ask, refuse with that; :class:`FlowerClient` runs the rounds through the public steps.
    """

    def _refuse(self) -> NoReturn:
        raise InvalidArgumentError(
            "a Flower node takes its tasks from the strategy's messages (FlowerClient), not "
            "from a coordinator: EdgeClient.run and run_task do not apply"
        )

    def register(
        self, registration: ClientRegistration, *, retry_s: float | None = None
    ) -> RegistrationReply:
        """Refused: the strategy's messages carry a node's registration."""
        self._refuse()

    def get_task(self, query: AssignmentQuery, *, retry_s: float | None = None) -> Assignment:
        """Refused: the strategy's messages carry a node's tasks."""
        self._refuse()

    def report_update(self, report: UpdateReport, *, retry_s: float | None = None) -> None:
        """Refused: a node's replies carry its reports."""
        self._refuse()

    def close(self) -> None:
        """Nothing to close: no channel of its own."""


class FlowerClient:
    """An edge client whose coordinator speaks through Flower messages.

    Pulls, DP training, encryption, signatures, commitments and pushes are those of the
    :class:`~clients.edge_client.EdgeClient` it holds (:attr:`edge`), through its public
    steps and its session (:class:`~clients.client_session.ClientSession`: the channels and
    the public context); only the task arrives in a Flower message and the report leaves in
    the reply.

    Parameters
    ----------
    config
        The fedps configuration (cluster addresses, training, privacy, HE).
    index
        The node's data partition (Flower's ``partition-id``).
    signer
        The node's Ed25519 key, from its state folder.
    mods
        Wrap the node's training (:data:`clients.train_step.TrainMod`), outside the
        simulated slow devices and dropouts of the configuration
        (:class:`clients.simulation.SimulatedDevice`), which every node applies.
    trainer
        The node's trainer when the caller builds it: a
        :class:`~clients.flower.wrapped_trainer.WrappedTrainer` for a node that trains with
        the app's own ``train`` (:class:`~clients.flower.fedps_mod.FedPSMod`). Default:
        DP-SGD on partition ``index`` of the configured task's data.

    Raises
    ------
    ConfigError
        Without ``trainer``, for ``privacy.level = "client"``: fedps's own training through
        Flower is example-level DP-SGD only. Or the node's enrolment token is missing.
    """

    def __init__(
        self,
        config: FedPSConfig,
        *,
        index: int,
        signer: BlockSigner,
        mods: Sequence[TrainMod] = (),
        trainer: Trainer | None = None,
    ) -> None:
        if trainer is None and config.privacy.level != "example":
            raise ConfigError(
                'Flower clients support privacy.level = "example" (DP-SGD) only; a node that '
                "wraps its own train function (FedPSMod) trains at client level"
            )
        # Before any channel exists, as `fedps client` does: certificate tls.name (or
        # client-INDEX) under mutual TLS; a process holds one certificate, so under TLS each
        # node runs in its own process.
        setup_tls(config.tls, f"client-{index}")
        self.config = config
        self.index = index
        device = SimulatedDevice(config.training, index=index)
        # Its ledger is in memory until a message opens the node's state folder (use_state).
        # The strategy registers the node by its token, whatever the transport.
        self.edge = EdgeClient.open(
            config,
            index=index,
            name=f"flower-{index}",
            signer=signer,
            token_required=True,
            mods=[*mods, device],
            trainer=trainer,
            uplink=StrategyMessages(),
        )
        self.pending: PreparedPush | None = None  # committed, not pushed yet
        self._attached = ("", "")

    @property
    def name(self) -> str:
        """The node's display name (``flower-INDEX``)."""
        return self.edge.name

    @property
    def signing_key(self) -> bytes:
        """The Ed25519 public key the strategy registers for this node."""
        return self.edge.signing_key

    @property
    def enrolment_token(self) -> str:
        """The token that proves this node's identity (``client-INDEX``) to the strategy."""
        return self.edge.enrolment_token

    def registration(self) -> Registration:
        """What the node answers to the ``register`` stage."""
        edge = self.edge
        return Registration(
            edge.signing_key,
            edge.name,
            edge.trainer.num_examples,
            edge.num_params,
            enrolment_token=edge.enrolment_token,
        )

    def attach(self, *, client_id: str, run_id: str, timeout_s: float = 60.0) -> None:
        """Connect to the key holder and shards of ``config.cluster`` for run ``run_id``.

        After :meth:`detach` this only reopens the channels: the public context, the
        encryptor and its encryptions of zero are kept for the same run and client id.
        """
        session = self.edge.session
        if session.connected and self._attached == (client_id, run_id):
            return
        cluster = self.config.cluster
        shards = dict(zip(cluster.shard_ids, cluster.shards, strict=True))
        session.connect(
            cluster.keyholder,
            shards,
            virtual_nodes=cluster.virtual_nodes,
            ring=RingView.configured(cluster.ring_ids),
        )
        if self._attached != (client_id, run_id):
            session.join(run_id=run_id, client_id=client_id, timeout_s=timeout_s)
            self._attached = (client_id, run_id)

    def detach(self) -> None:
        """Close the channels to the key holder and shards (:meth:`attach` reopens them)."""
        self.edge.session.disconnect()

    def shutdown(self) -> None:
        """Close the channels and stop any encryption worker."""
        self.edge.session.shutdown()

    # ------------------------------------------------------------------ privacy state
    def use_state(self, state: ClientState) -> None:
        """Keep the node's ledger in ``state`` and resume its accountant from it.

        ``state`` is the node's state folder, open (and locked) for one message.
        """
        self.edge.ledger.reopen(state)

    def accountant_history(self) -> list[tuple[float, float, int]]:
        """Every (noise multiplier, sample rate, steps or rounds) this node's DP has taken."""
        return list(self.edge.trainer.history())

    def reseed(self, round_: int) -> None:
        """Seed this round's DP noise and Poisson sampling from (seed, partition, round).

        With ``privacy.insecure_reproducible`` only. The secure default draws fresh from the CSPRNG
        and needs no seed.
        """
        source = self.edge.trainer.source
        if isinstance(source, SeededRandom):
            text = f"fedps-flower/{self.config.training.seed}/{self.index}/{round_}".encode()
            source.reseed(int.from_bytes(hashlib.sha256(text).digest()[:8], "little"))

    # ------------------------------------------------------------------ one round
    def train_task(
        self, task: FlowerTask, *, timeout_s: float = 60.0, local: LocalTrain | None = None
    ) -> RoundReport:
        """Train and commit one round, as :class:`EdgeClient` does for a coordinator task.

        Keep the push messages (:attr:`pending`) for the push stage, though: they may go out only
        once every commitment of the round is fixed. The reply carries the spend.

        ``local`` is the round's training for a node whose trainer is a
        :class:`~clients.flower.wrapped_trainer.WrappedTrainer` (and only for one).
        """
        self.attach(client_id=task.client_id, run_id=task.run_id, timeout_s=timeout_s)
        self.edge.trainer.set_run(task.run_id)  # the run the restored rounds count in
        self.pending = None
        self.reseed(task.round)
        with self._training_with(local):
            outcome = self.edge.train_round(
                task.round,
                task.version,
                weight_scale=task.weight_scale,
                deadline_unix=task.deadline_unix,
                context_id=task.context_id,
                announce=False,  # the train reply carries the epsilon to the strategy
            )
        self.pending = outcome.prepared
        if outcome.trained:
            # Refill the pool of encryptions of zero in this process: a node has no idle time
            # between Flower messages for a background worker.
            self.edge.session.precompute(background=False)
        if outcome.budget_exhausted:
            return self._summary(task.round, pushed=0, budget_exhausted=True, trained=False)
        if outcome.prepared is None:
            # No update this round (the model was not published, the version moved on, or
            # the round's commitments had closed)
            return self.idle_report(task.round)
        return self._summary(outcome.round, pushed=0, budget_exhausted=False, trained=True)

    def _training_with(self, local: LocalTrain | None) -> AbstractContextManager[object]:
        """The round's wrapped training in place, if it has one."""
        trainer = self.edge.trainer
        if isinstance(trainer, WrappedTrainer) and local is not None:
            return trainer.training_with(local)
        if isinstance(trainer, WrappedTrainer) or local is not None:
            raise InvalidArgumentError(
                "a wrapped train function goes with a WrappedTrainer, and only with one"
            )
        return nullcontext()

    def push_task(
        self, task: FlowerTask, prepared: PreparedPush, *, timeout_s: float = 60.0
    ) -> RoundReport:
        """Push the update committed for ``task``.

        The strategy's push stage is the signal that the round's commitments are frozen.
        """
        self.attach(client_id=task.client_id, run_id=task.run_id, timeout_s=timeout_s)
        pushed = self.edge.send(prepared)
        return self._summary(task.round, pushed=pushed, budget_exhausted=False, trained=True)

    def idle_report(self, round_: int) -> RoundReport:
        """The report of a round in which this node pushes nothing."""
        return self._summary(round_, pushed=0, budget_exhausted=False, trained=False)

    def _summary(
        self, round_: int, *, pushed: int, budget_exhausted: bool, trained: bool
    ) -> RoundReport:
        edge = self.edge
        return RoundReport(
            round=round_,
            trained=trained,
            bytes_pushed=pushed,
            budget_exhausted=budget_exhausted,
            weight=edge.weight,
            epsilon=edge.trainer.epsilon(),
            delta=self.config.privacy.delta,
            num_examples=edge.trainer.num_examples,
        )


class ClientFactory(Protocol):
    """Builds a node's client (a :class:`FlowerClient`, with mods of its own for example)."""

    def __call__(self, config: FedPSConfig, *, index: int, signer: BlockSigner) -> FlowerClient:
        """The client of the node of data partition ``index``, which signs with ``signer``."""


@dataclass
class _NodeState:
    """What a node keeps in ``Context.state["fedps"]`` between messages."""

    last_round: int = 0
    # The committed update's push messages, until the push stage (serialised PushBatches)
    pending_round: int = 0
    pending_version: int = 0
    pending_shards: tuple[str, ...] = ()
    pending_messages: tuple[bytes, ...] = ()

    def keep(self, prepared: PreparedPush | None) -> None:
        """Keep (or, None, forget) the push messages of a committed update."""
        items = [] if prepared is None else list(prepared.messages.items())
        self.pending_round = 0 if prepared is None else prepared.round
        self.pending_version = 0 if prepared is None else prepared.version
        self.pending_shards = tuple(sid for sid, msgs in items for _ in msgs)
        self.pending_messages = tuple(m.serialize() for _, msgs in items for m in msgs)

    def prepared(self, round_: int) -> PreparedPush | None:
        """The kept push messages, if they are ``round_``'s."""
        if not self.pending_messages or self.pending_round != round_:
            return None
        messages: dict[str, list[PushBatch]] = {}
        for sid, data in zip(self.pending_shards, self.pending_messages, strict=True):
            messages.setdefault(sid, []).append(PushBatch.from_bytes(data))
        return PreparedPush(self.pending_round, self.pending_version, messages)

    @classmethod
    def load(cls, context: Context) -> _NodeState:
        record = context.state.config_records.get(RECORD_KEY)
        if record is None:
            return cls()
        shards = record.get("pending-shards", [])
        messages = record.get("pending-messages", [])
        if not isinstance(shards, list) or not isinstance(messages, list):
            raise InvalidArgumentError("Context.state holds malformed pending pushes")
        return cls(
            last_round=int(_float(record.get("last-round", 0))),
            pending_round=int(_float(record.get("pending-round", 0))),
            pending_version=int(_float(record.get("pending-version", 0))),
            pending_shards=tuple(str(s) for s in shards),
            pending_messages=tuple(bytes(m) for m in messages if isinstance(m, bytes)),
        )

    def save(self, context: Context) -> None:
        context.state.config_records[RECORD_KEY] = ConfigRecord(
            {
                "last-round": self.last_round,
                "pending-round": self.pending_round,
                "pending-version": self.pending_version,
                "pending-shards": list(self.pending_shards),
                "pending-messages": list(self.pending_messages),
            }
        )


def _float(value: object) -> float:
    if not isinstance(value, int | float):
        raise InvalidArgumentError(f"expected a number in the fedps record, got {value!r}")
    return float(value)


class _ClientCache:
    """Built clients of this process, by (run, node); least recently used first out."""

    def __init__(self, size: int, factory: ClientFactory) -> None:
        self._size = size
        self._factory = factory
        self._clients: OrderedDict[tuple[int, int], FlowerClient] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, config: FedPSConfig, context: Context, signer: BlockSigner) -> FlowerClient:
        key = (context.run_id, context.node_id)
        with self._lock:
            client = self._clients.pop(key, None)
        if client is None or client.signing_key != signer.public_key or client.config != config:
            if client is not None:
                client.shutdown()
            client = self._factory(config, index=_partition(context), signer=signer)
        if self._size == 0:
            return client
        with self._lock:
            self._clients[key] = client
            while len(self._clients) > self._size:
                _, old = self._clients.popitem(last=False)
                old.shutdown()
        return client

    def __reduce__(self) -> tuple[type[_ClientCache], tuple[int, ClientFactory]]:
        """Pickled (for another process) without the clients built in this one."""
        return (type(self), (self._size, self._factory))


def _partition(context: Context) -> int:
    value = context.node_config.get(_PARTITION_KEY)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(
            f"the node has no integer {_PARTITION_KEY!r} in its node config; start it with "
            f'--node-config "{_PARTITION_KEY}=0 num-partitions=N"'
        )
    return value


def _config_of(context: Context) -> FedPSConfig:
    path = context.run_config.get(CONFIG_KEY)
    if not isinstance(path, str) or not path:
        raise ConfigError(f"the run config has no {CONFIG_KEY!r} (path of the fedps TOML file)")
    return load_config(Path(path))


def fedps_record(message: Message) -> ConfigRecord | None:
    """The ``"fedps"`` ConfigRecord of a fedps message (None: not one of fedps's)."""
    if not message.has_content():
        return None
    return message.content.config_records.get(RECORD_KEY)


class FlowerNode:
    """The fedps stages of a Flower node (``register``, ``train``, ``push``).

    For a ``ClientApp`` (:func:`create_client_app`) or a mod
    (:class:`~clients.flower.fedps_mod.FedPSMod`).

    Parameters
    ----------
    config
        The fedps configuration, or a function of the node's ``Context`` that returns it;
        ``None``: load the TOML file named by the run config's ``fedps-config`` key.
    client_factory
        Builds a node's client.
    cache_size
        Built clients kept per process (a speed-up only; 0 rebuilds for every message).
    timeout_s
        How long a node waits for the key holder when it attaches.
    """

    def __init__(
        self,
        config: FedPSConfig | Callable[[Context], FedPSConfig] | None = None,
        *,
        client_factory: ClientFactory = FlowerClient,
        cache_size: int = 16,
        timeout_s: float = 60.0,
    ) -> None:
        self._config = config
        self._cache = _ClientCache(cache_size, client_factory)
        self._cache_size = cache_size
        self._timeout_s = timeout_s

    def handle(
        self, message: Message, context: Context, *, local: LocalTrain | None = None
    ) -> Message:
        """Answer a fedps message.

        ``local`` is the ``train`` stage's wrapped training (for a node whose client has a
        :class:`~clients.flower.wrapped_trainer.WrappedTrainer`).

        Raises
        ------
        InvalidArgumentError
            If the message is not a well-formed fedps message.
        """
        record = fedps_record(message)
        if record is None:
            raise InvalidArgumentError(f"not a fedps message: no {RECORD_KEY!r} ConfigRecord")
        stage = stage_of(record)
        if stage == REGISTER_STAGE:
            return self._register(message, context)
        task = FlowerTask.from_record(record)
        if stage == PUSH_STAGE:
            return _reply(self._push(task, context), message)
        return _reply(self._train(task, context, local), message)

    @contextmanager
    def _session(self, context: Context) -> Iterator[tuple[_NodeState, FlowerClient]]:
        """The node's state and client for one message.

        The node's state folder is open (and locked) for the message, and its client resumes its
        accountant from the ledger there; the client is released after it (a cached node keeps no
        connection between messages).
        """
        config = self._config
        resolved = config if isinstance(config, FedPSConfig) else (config or _config_of)(context)
        index = _partition(context)
        identity = resolved.tls.name or f"client-{index}"
        folder = ClientState.open(default_state_dir(resolved, identity), identity=identity)
        with closing(folder):
            client = self._cache.get(resolved, context, folder.signer)
            try:
                client.use_state(folder)
                yield _NodeState.load(context), client
            finally:
                if self._cache_size == 0:
                    client.shutdown()
                else:
                    client.detach()

    def _register(self, message: Message, context: Context) -> Message:
        with self._session(context) as (_, client):
            values: dict[str, ConfigRecordValues] = {**client.registration().to_record()}
        return Message(RecordDict({RECORD_KEY: ConfigRecord(values)}), reply_to=message)

    def _train(self, task: FlowerTask, context: Context, local: LocalTrain | None) -> RoundReport:
        with self._session(context) as (state, client):
            if task.round <= state.last_round:
                # Never train twice for a round (nor spend privacy on it): a repeated message.
                _log.info("%s: round %d already trained; not again", client.name, task.round)
                return client.idle_report(task.round)
            return _train_round(client, state, task, context, self._timeout_s, local)

    def _push(self, task: FlowerTask, context: Context) -> RoundReport:
        with self._session(context) as (state, client):
            prepared = state.prepared(task.round)
            if prepared is None:
                _log.info("%s: nothing committed for round %d", client.name, task.round)
                return client.idle_report(task.round)
            report = client.push_task(task, prepared, timeout_s=self._timeout_s)
            state.keep(None)
            state.save(context)
            return report


def _train_round(
    client: FlowerClient,
    state: _NodeState,
    task: FlowerTask,
    context: Context,
    timeout_s: float,
    local: LocalTrain | None,
) -> RoundReport:
    """Train one round from the accountant the node's ledger resumed.

    Whatever happens, the round is marked trained in ``Context.state`` once it took a DP step
    (the ledger recorded the spend before the round trained).
    """
    before = client.accountant_history()
    report: RoundReport | None = None
    try:
        report = client.train_task(task, timeout_s=timeout_s, local=local)
        state.keep(client.pending)
        return report
    finally:
        spent = client.accountant_history() != before
        if spent or (report is not None and report.budget_exhausted):
            state.last_round = task.round
        state.save(context)


def create_client_app(
    config: FedPSConfig | Callable[[Context], FedPSConfig] | None = None,
    *,
    client_factory: ClientFactory = FlowerClient,
    cache_size: int = 16,
    timeout_s: float = 60.0,
) -> ClientApp:
    """A Flower ``ClientApp`` that trains with DP-SGD and pushes encrypted updates to fedps.

    Parameters
    ----------
    config
        The fedps configuration, or a function of the node's ``Context`` that returns it;
        ``None``: load the TOML file named by the run config's ``fedps-config`` key.
    client_factory
        Builds a node's client; a :class:`FlowerClient` built with mods adds behaviour.
    cache_size
        Built clients kept per process (a speed-up only; 0 rebuilds for every message).
    timeout_s
        How long a node waits for the key holder when it attaches.

    Returns
    -------
    ClientApp
        Handles every fedps stage (:class:`FlowerNode`), all of them ``train`` messages.
    """
    app = ClientApp()
    node = FlowerNode(
        config, client_factory=client_factory, cache_size=cache_size, timeout_s=timeout_s
    )

    @app.train()
    def train(message: Message, context: Context) -> Message:
        return node.handle(message, context)

    return app


def _reply(report: RoundReport, message: Message) -> Message:
    reported: dict[str, MetricRecordValues] = {**report.to_metrics()}
    return Message(RecordDict({METRICS_KEY: MetricRecord(reported)}), reply_to=message)
