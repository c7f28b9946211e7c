"""fedps inside a Flower ``ClientApp``: DP-SGD, encrypted pushes, metadata-only replies.

A Flower app gains fedps's encrypted aggregation by using :func:`create_client_app` as its
``ClientApp`` and :class:`server.flower.flower_strategy.FlowerStrategy` as its strategy. The Flower
messages replace the fedps coordinator's client protocol (register, get task, report); the
update itself never travels in a Flower message:

1. ``query.fedps_register``: the node answers with its Ed25519 public key, its number of
   training examples, the model size and its enrolment token (``tls.directory/client-N.token``
   from ``fedps certs``); the strategy registers it with the coordinator as ``client-N``.
2. ``train``: the message's ``"fedps"`` ConfigRecord is the coordinator's task (round,
   model version, client id, run id, context id, weight scale, deadline). The node runs the
   same round as :class:`clients.edge_client.EdgeClient`: it pulls the signed model of that
   version from the shards, trains with DP-SGD (Opacus), weights, clips, encrypts, signs and
   commits the update at the key holder (the block roots and their sketches under the round's
   challenge), keeps the signed push messages in its ``Context.state`` and replies with
   metadata only (weight, epsilon), never the update.
3. ``query.fedps_push``: once every commitment of the round is fixed, the node pushes the
   messages it kept to the shards that own the blocks and replies with the bytes pushed.

Flower rebuilds the ``ClientApp`` for every message and may run a node's messages in
different processes, so everything a node must keep lives in its ``Context.state``: its
signing key (the node's secret; ``Context.state`` stays on the SuperNode) and its privacy
accountant's history, which is restored before every round. A node therefore keeps no state
folder of its own (:class:`clients.client_state.ClientState` in memory only): its budget
lasts as long as the SuperNode's ``Context.state``. The noise and Poisson sampling come from
the CSPRNG (:class:`crypto.randomness.SecureRandom`), fresh at every draw; only with
``privacy.insecure_reproducible`` are they seeded, from (``training.seed``, partition, round),
so that a rebuilt client never replays an earlier round's noise. Built clients are kept in a
small per-process cache purely as a speed-up; the state restored from the context is
authoritative.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
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

from clients.client_state import ClientState
from clients.dp_trainer import DPTrainer
from clients.edge_client import EdgeClient, PreparedPush
from crypto import BlockEncryptor
from crypto.randomness import SeededRandom
from crypto.signing import BlockSigner
from fedps.blocks import BlockLayout
from fedps.config import FedPSConfig, load_config
from fedps.errors import ConfigError, InvalidArgumentError
from fedps.flower_messages import (
    CONFIG_KEY,
    METRICS_KEY,
    PUSH_ACTION,
    RECORD_KEY,
    REGISTER_ACTION,
    FlowerTask,
    Registration,
    RoundReport,
)
from fedps.hash_ring import HashRing
from fedps.parameter_client import ParameterClient
from fedps.proto import coordinator_pb2, keyholder_pb2_grpc, shard_pb2
from fedps.provisioning import setup_tls
from fedps.transport import create_channel

__all__ = ["ClientFactory", "FlowerClient", "create_client_app"]

_log = logging.getLogger("fedps")

_PARTITION_KEY = "partition-id"


class FlowerClient(EdgeClient):
    """An edge client whose coordinator speaks through Flower messages.

    Pulls, DP training, encryption, signatures, commitments and pushes are
    :class:`~clients.edge_client.EdgeClient`'s own; only the task arrives in a Flower
    message and the report leaves in the reply.

    Parameters
    ----------
    config
        The fedps configuration (cluster addresses, training, privacy, HE).
    index
        The node's data partition (Flower's ``partition-id``).
    signer
        The node's Ed25519 key, kept in its ``Context.state`` across messages.

    Raises
    ------
    ConfigError
        For ``privacy.level = "client"``: its accountant state cannot be carried in
        ``Context.state`` yet, so only example-level DP-SGD is offered through Flower. Or the
        node's enrolment token is missing.
    """

    def __init__(self, config: FedPSConfig, *, index: int, signer: BlockSigner) -> None:
        if config.privacy.level != "example":
            raise ConfigError('Flower clients support privacy.level = "example" (DP-SGD) only')
        # Before any channel exists, as `fedps client` does: certificate tls.name (or
        # client-INDEX) under mutual TLS; a process holds one certificate, so under TLS each
        # node runs in its own process.
        setup_tls(config.tls, f"client-{index}")
        super().__init__(config, index=index, name=f"flower-{index}")
        # The strategy registers the node by its token, whatever the transport.
        self._enrolment_token = self._load_token(required=True)
        self.index = index
        self._signer = signer
        self._last_report: RoundReport | None = None
        self.pending: PreparedPush | None = None  # committed, not pushed yet
        self._attached = ("", "")
        self._open = False

    @property
    def signing_key(self) -> bytes:
        """The Ed25519 public key the strategy registers for this node."""
        return self._signer.public_key

    @property
    def enrolment_token(self) -> str:
        """The token that proves this node's identity (``client-INDEX``) to the strategy."""
        return self._enrolment_token

    def attach(self, *, client_id: str, run_id: str, timeout_s: float = 60.0) -> None:
        """Connect to the key holder and shards of ``config.cluster`` for run ``run_id``.

        After :meth:`close` this only reopens the channels: the public context, the
        encryptor and its encryptions of zero are kept for the same run and client id.
        """
        if self._open:
            if self._attached == (client_id, run_id):
                return
            self.close()
        cluster = self.config.cluster
        shards = dict(zip(cluster.shard_ids, cluster.shards, strict=True))
        self._keyholder_channel = create_channel(cluster.keyholder)
        self._keyholder = keyholder_pb2_grpc.KeyHolderStub(self._keyholder_channel)
        self._params = ParameterClient(shards)
        self._ring = HashRing(sorted(shards), virtual_nodes=cluster.virtual_nodes)
        self._open = True
        if self._attached != (client_id, run_id):
            self.client_id, self.run_id = client_id, run_id
            self._keyholder_key = b""
            self._fetch_context(timeout_s)
            self._layout = BlockLayout(self.num_params, self._values_per_block)
            self._attached = (client_id, run_id)

    def close(self) -> None:
        """Close the channels to the key holder and shards (:meth:`attach` reopens them)."""
        if self._open:
            self._params.close()
            self._keyholder_channel.close()
            self._open = False

    def shutdown(self) -> None:
        """Close the channels and stop any encryption worker."""
        self.close()
        encryptor = getattr(self, "_encryptor", None)
        if isinstance(encryptor, BlockEncryptor):
            encryptor.close()

    # ------------------------------------------------------------------ privacy state
    def _open_state(self, state_dir: Path | None) -> ClientState:
        """No folder: the node's key and accountant live in its ``Context.state``."""
        return ClientState.in_memory(self.identity)

    def _announce_spend(self) -> None:
        """The train reply carries the epsilon (the strategy reports it to the coordinator)."""

    @property
    def _dp(self) -> DPTrainer:
        assert isinstance(self.trainer, DPTrainer)
        return self.trainer

    def accountant_history(self) -> list[tuple[float, float, int]]:
        """Every (noise multiplier, sample rate, steps) this node's DP-SGD has taken."""
        return list(self.trainer.history())

    def restore_accountant(self, history: list[tuple[float, float, int]]) -> None:
        """Continue from ``history`` (the one in ``Context.state``), whatever was here."""
        self.trainer.restore(history)

    def reseed(self, round_: int) -> None:
        """With ``privacy.insecure_reproducible`` only: seed this round's DP noise and Poisson
        sampling from (seed, partition, round). The secure default draws fresh from the
        CSPRNG and needs no seed."""
        source = self._dp.source
        if isinstance(source, SeededRandom):
            text = f"fedps-flower/{self.config.training.seed}/{self.index}/{round_}".encode()
            source.reseed(int.from_bytes(hashlib.sha256(text).digest()[:8], "little"))

    # ------------------------------------------------------------------ one round
    def train_task(self, task: FlowerTask, *, timeout_s: float = 60.0) -> RoundReport:
        """Train and push one round, as :class:`EdgeClient` does for a coordinator task."""
        self.attach(client_id=task.client_id, run_id=task.run_id, timeout_s=timeout_s)
        self._last_report = None
        self.pending = None
        self.reseed(task.round)
        self._train(
            coordinator_pb2.Task(
                kind=coordinator_pb2.Task.TRAIN,
                round=task.round,
                version=task.version,
                deadline_unix=task.deadline_unix,
                weight_scale=task.weight_scale,
                context_id=task.context_id,
            )
        )
        # None: no update this round (the model was not published, or the version moved on)
        return self._last_report or self.idle_report(task.round)

    def push_task(
        self, task: FlowerTask, prepared: PreparedPush, *, timeout_s: float = 60.0
    ) -> RoundReport:
        """Push the update committed for ``task`` (the round's commitments are frozen)."""
        self.attach(client_id=task.client_id, run_id=task.run_id, timeout_s=timeout_s)
        pushed = self.send(prepared)
        return self._summary(task.round, pushed=pushed, budget_exhausted=False, trained=True)

    def idle_report(self, round_: int) -> RoundReport:
        """The report of a round in which this node pushes nothing."""
        return self._summary(round_, pushed=0, budget_exhausted=False, trained=False)

    def _report(self, round_: int, pushed: int, *, budget_exhausted: bool) -> None:
        """Keep the report for the Flower reply instead of calling the coordinator."""
        self._last_report = self._summary(
            round_,
            pushed=pushed,
            budget_exhausted=budget_exhausted,
            trained=self.pending is not None,  # committed; it pushes when asked
        )

    def _summary(
        self, round_: int, *, pushed: int, budget_exhausted: bool, trained: bool
    ) -> RoundReport:
        return RoundReport(
            round=round_,
            trained=trained,
            bytes_pushed=pushed,
            budget_exhausted=budget_exhausted,
            weight=self.weight,
            epsilon=self.trainer.epsilon(),
            delta=self.config.privacy.delta,
            num_examples=self.trainer.num_examples,
        )

    def _wait_for_push_phase(self, round_: int, timeout_s: float) -> bool:
        """The strategy's push query is the signal: the commitments are frozen."""
        return True

    def push(self, round_: int, version: int, delta: np.ndarray) -> int:
        """Encrypt and commit as :class:`EdgeClient` does, but keep the push messages for
        the push query (they may go out only once every commitment of the round is fixed),
        then refill the pool of encryptions of zero in this process: a node has no idle time
        between Flower messages for a background worker."""
        self.pending = self.prepare(round_, version, delta)
        if isinstance(self._encryptor, BlockEncryptor):
            self._encryptor.precompute(self._layout.num_blocks)
        return 0


class ClientFactory(Protocol):
    """Builds a node's client (:class:`FlowerClient` or a subclass)."""

    def __call__(self, config: FedPSConfig, *, index: int, signer: BlockSigner) -> FlowerClient: ...


@dataclass
class _NodeState:
    """What a node keeps in ``Context.state["fedps"]`` between messages."""

    signing_key: bytes  # Ed25519 private key, raw 32 bytes
    last_round: int = 0
    history: tuple[tuple[float, float, int], ...] = ()
    # The committed update's push messages, until the push query (serialised PushRequests)
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
        self.pending_messages = tuple(m.SerializeToString() for _, msgs in items for m in msgs)

    def prepared(self, round_: int) -> PreparedPush | None:
        """The kept push messages, if they are ``round_``'s."""
        if not self.pending_messages or self.pending_round != round_:
            return None
        messages: dict[str, list[shard_pb2.PushRequest]] = {}
        for sid, data in zip(self.pending_shards, self.pending_messages, strict=True):
            messages.setdefault(sid, []).append(shard_pb2.PushRequest.FromString(data))
        return PreparedPush(self.pending_round, self.pending_version, messages)

    @classmethod
    def load(cls, context: Context) -> _NodeState:
        record = context.state.config_records.get(RECORD_KEY)
        if record is None:
            raw = Ed25519PrivateKey.generate().private_bytes(
                Encoding.Raw, PrivateFormat.Raw, NoEncryption()
            )
            state = cls(signing_key=raw)
            state.save(context)
            return state
        sigmas = _numbers(record.get("accountant-sigma", []))
        rates = _numbers(record.get("accountant-rate", []))
        steps = [int(n) for n in _numbers(record.get("accountant-steps", []))]
        key = record["signing-key"]
        if not isinstance(key, bytes):
            raise InvalidArgumentError("Context.state holds no valid fedps signing key")
        shards = record.get("pending-shards", [])
        messages = record.get("pending-messages", [])
        if not isinstance(shards, list) or not isinstance(messages, list):
            raise InvalidArgumentError("Context.state holds malformed pending pushes")
        return cls(
            signing_key=key,
            last_round=int(_float(record.get("last-round", 0))),
            history=tuple(zip(sigmas, rates, steps, strict=True)),
            pending_round=int(_float(record.get("pending-round", 0))),
            pending_version=int(_float(record.get("pending-version", 0))),
            pending_shards=tuple(str(s) for s in shards),
            pending_messages=tuple(bytes(m) for m in messages if isinstance(m, bytes)),
        )

    def save(self, context: Context) -> None:
        context.state.config_records[RECORD_KEY] = ConfigRecord(
            {
                "signing-key": self.signing_key,
                "last-round": self.last_round,
                "accountant-sigma": [float(s) for s, _, _ in self.history],
                "accountant-rate": [float(q) for _, q, _ in self.history],
                "accountant-steps": [int(n) for _, _, n in self.history],
                "pending-round": self.pending_round,
                "pending-version": self.pending_version,
                "pending-shards": list(self.pending_shards),
                "pending-messages": list(self.pending_messages),
            }
        )

    def signer(self) -> BlockSigner:
        return BlockSigner(Ed25519PrivateKey.from_private_bytes(self.signing_key))


def _float(value: object) -> float:
    if not isinstance(value, int | float):
        raise InvalidArgumentError(f"expected a number in the fedps record, got {value!r}")
    return float(value)


def _numbers(value: object) -> list[float]:
    if not isinstance(value, list):
        raise InvalidArgumentError(f"expected a list in the fedps record, got {value!r}")
    return [_float(v) for v in value]


class _ClientCache:
    """Built clients of this process, by (run, node); least recently used first out."""

    def __init__(self, size: int, factory: ClientFactory) -> None:
        self._size = size
        self._factory = factory
        self._clients: OrderedDict[tuple[int, int], FlowerClient] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, config: FedPSConfig, context: Context, state: _NodeState) -> FlowerClient:
        key = (context.run_id, context.node_id)
        signer = state.signer()
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


def _train_round(
    client: FlowerClient,
    state: _NodeState,
    task: FlowerTask,
    context: Context,
    timeout_s: float,
) -> RoundReport:
    """Train one round from the accountant in ``state``; whatever happens, every DP step
    taken is written back to ``Context.state`` (a failed push still spent the privacy)."""
    before = state.history
    client.restore_accountant(list(before))
    report: RoundReport | None = None
    try:
        report = client.train_task(task, timeout_s=timeout_s)
        state.keep(client.pending)
        return report
    finally:
        state.history = tuple(client.accountant_history())
        if state.history != before or (report is not None and report.budget_exhausted):
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
        Builds a node's client; a :class:`FlowerClient` subclass adds behaviour.
    cache_size
        Built clients kept per process (a speed-up only; 0 rebuilds for every message).
    timeout_s
        How long a node waits for the key holder when it attaches.

    Returns
    -------
    ClientApp
        Handles ``query.fedps_register`` and ``train`` messages.
    """
    app = ClientApp()
    cache = _ClientCache(cache_size, client_factory)

    def prepare(context: Context) -> tuple[_NodeState, FlowerClient]:
        resolved = config if isinstance(config, FedPSConfig) else (config or _config_of)(context)
        state = _NodeState.load(context)
        return state, cache.get(resolved, context, state)

    @contextmanager
    def session(context: Context) -> Iterator[tuple[_NodeState, FlowerClient]]:
        """The node's state and client for one message; the client is released after it
        (a cached node keeps no connection between messages)."""
        state, client = prepare(context)
        try:
            yield state, client
        finally:
            if cache_size == 0:
                client.shutdown()
            else:
                client.close()

    @app.query(REGISTER_ACTION)
    def register(message: Message, context: Context) -> Message:
        _, client = prepare(context)
        registration = Registration(
            client.signing_key,
            client.name,
            client.trainer.num_examples,
            client.num_params,
            enrolment_token=client.enrolment_token,
        )
        values: dict[str, ConfigRecordValues] = {**registration.to_record()}
        record = ConfigRecord(values)
        return Message(RecordDict({RECORD_KEY: record}), reply_to=message)

    @app.train()
    def train(message: Message, context: Context) -> Message:
        task = _task_of(message, "train")
        with session(context) as (state, client):
            if task.round <= state.last_round:
                # Never train twice for a round (nor spend privacy on it): a repeated message.
                _log.info("%s: round %d already trained; not again", client.name, task.round)
                report = client.idle_report(task.round)
            else:
                report = _train_round(client, state, task, context, timeout_s)
        return _reply(report, message)

    @app.query(PUSH_ACTION)
    def push(message: Message, context: Context) -> Message:
        task = _task_of(message, "push")
        with session(context) as (state, client):
            prepared = state.prepared(task.round)
            if prepared is None:
                _log.info("%s: nothing committed for round %d", client.name, task.round)
                report = client.idle_report(task.round)
            else:
                client.restore_accountant(list(state.history))  # the epsilon it reports
                report = client.push_task(task, prepared, timeout_s=timeout_s)
                state.keep(None)
                state.save(context)
        return _reply(report, message)

    return app


def _task_of(message: Message, what: str) -> FlowerTask:
    """The fedps task a train or push message carries."""
    record = message.content.config_records.get(RECORD_KEY)
    if record is None:
        raise InvalidArgumentError(f"{what} message without a {RECORD_KEY!r} ConfigRecord")
    return FlowerTask.from_record(record)


def _reply(report: RoundReport, message: Message) -> Message:
    reported: dict[str, MetricRecordValues] = {**report.to_metrics()}
    return Message(RecordDict({METRICS_KEY: MetricRecord(reported)}), reply_to=message)
