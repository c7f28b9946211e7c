"""A Flower strategy whose aggregation is fedps's: shard sums decrypted by the key holder.

:class:`FlowerStrategy` is a message-based Flower ``Strategy`` that plays the fedps
coordinator's part for a running key holder and shards. It holds a real
:class:`~server.coordinator.coordinator.Coordinator` and lets Flower carry the coordinator's client
protocol (see :mod:`fedps.rpc.flower_messages`):

Every fedps message is a Flower ``train`` message whose ``"fedps"`` record names its stage
(:mod:`fedps.rpc.flower_messages`), so that a mod around a user's own ``train`` sees them all.

- Nodes it has not met yet get a ``register`` message; each answers with its
  Ed25519 public key, examples, model size and enrolment token, and is registered with the
  coordinator under the identity its token proves (``client-N``).
- ``configure_train`` opens the next fedps round on every shard for the sampled nodes (the
  coordinator's own round, in a thread) and sends each node the coordinator's task: round,
  model version, client id, context id, weight scale, deadline. Nodes pull that version from
  the shards, train with DP-SGD, and push encrypted, signed blocks to the shards themselves.
- Nodes commit their encrypted update at the key holder and reply (metadata only). Once the
  coordinator froze the commitments and opened the round on the shards, ``aggregate_train``
  sends each committed node a ``push`` message; it pushes and replies. Each reply is
  reported to the coordinator, which then closes the round on the shards and asks the key
  holder to verify, decrypt, average and apply the aggregate of exactly the committed clients
  whose pushes completed. The result is the model the key holder published, pulled from the
  shards with every block's signature checked: the same model fedps trains on its own.

So the Flower server never sees an update, encrypted or not, and never holds a key. Its
replies carry what fedps's coordinator records: contributors, the largest epsilon of any
client (not a weighted mean), bytes pushed, held-out accuracy and loss.

Client-level DP (``privacy.level = "client"``, the privacy of nodes that wrap their own
``train``, :class:`clients.flower.fedps_mod.FedPSMod`) counts every global round at the
cohort rate q = ``training.cohort_size / training.clients``, which assumes Poisson cohorts;
Flower samples a fixed fraction instead, so at client level the strategy takes every node in
every round (q = 1: ``training.cohort_size`` 0 or ``training.clients``, ``fraction_train``
1) and refuses any other setting.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    ConfigRecordValues,
    Message,
    MessageType,
    MetricRecord,
    MetricRecordValues,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.serverapp.strategy.strategy_utils import sample_nodes

from fedps.config import FedPSConfig
from fedps.errors import ConfigError, FedPSError, InvalidArgumentError
from fedps.learning.accounting import client_cohort
from fedps.learning.tasks import Task as UserTask
from fedps.rpc import flower_messages as wire
from fedps.sharding.blocks import load_flat
from server.coordinator.coordinator import RoundRecord
from server.serve import open_coordinator

__all__ = ["FlowerStrategy"]

_log = logging.getLogger("fedps")
_POLL_S = 0.02


@dataclass(frozen=True)
class _Member:
    """A Flower node as the coordinator knows it."""

    client_id: str
    credential: bytes


@dataclass
class _Round:
    """The fedps round in progress: its number, cohort and the coordinator's thread."""

    number: int
    cohort: dict[int, _Member]  # Flower node id -> member
    thread: threading.Thread
    error: list[BaseException]
    tasks: dict[int, wire.FlowerTask] = field(default_factory=dict)  # what each node was sent


class FlowerStrategy(Strategy):
    """Secure aggregation for Flower: the fedps coordinator's rounds as a Flower strategy.

    Parameters
    ----------
    config
        The fedps configuration of the running key holder and shards.
    state_dir
        The coordinator's checkpoints (default: ``cluster.state_dir / "flower"``).
    fraction_train
        Fraction of connected nodes sampled for each round.
    min_train_nodes
        Fewest nodes sampled, as in Flower's ``FedAvg`` (default and lower bound: the quorum,
        ``training.min_quorum``).
    min_available_nodes
        Nodes that must be connected before a round starts, as in Flower's ``FedAvg``
        (default: ``min_train_nodes``).
    register_timeout_s
        How long registration waits for the nodes' answers.
    task
        The task whose model is trained and evaluated (default: the configured one,
        :func:`fedps.learning.tasks.load_task`); the key holder must hold the same model.

    Raises
    ------
    ConfigError
        If the sampling settings cannot reach ``training.min_quorum``, or, at client level,
        sample fewer than every node.
    """

    def __init__(
        self,
        config: FedPSConfig,
        *,
        state_dir: Path | None = None,
        fraction_train: float = 1.0,
        min_train_nodes: int | None = None,
        min_available_nodes: int | None = None,
        register_timeout_s: float = 300.0,
        task: UserTask | None = None,
    ) -> None:
        if not 0 < fraction_train <= 1:
            raise ConfigError("fraction_train must be in (0, 1]")
        if config.privacy.level == "client" and (
            fraction_train < 1 or client_cohort(config.training)[1] < 1
        ):
            raise ConfigError(
                'privacy.level = "client" through Flower takes every node in every round: '
                "set fraction_train = 1 and training.cohort_size = 0 (client-level accounting "
                "assumes Poisson cohorts, which Flower's sampling does not draw)"
            )
        self.config = config
        self.fraction_train = fraction_train
        #: the fewest updates a round may close with (the key holder refuses fewer)
        self.min_quorum = config.training.min_quorum
        # Flower's sampling parameters, mapped onto the quorum here and only here.
        self.min_train_nodes = min_train_nodes or self.min_quorum
        self.min_available_nodes = min_available_nodes or self.min_train_nodes
        if self.min_train_nodes < self.min_quorum:
            raise ConfigError(
                f"min_train_nodes ({self.min_train_nodes}) is below training.min_quorum "
                f"({self.min_quorum}): the key holder would refuse every round"
            )
        self.register_timeout_s = register_timeout_s
        self.coordinator = open_coordinator(
            config, state_dir or config.cluster.state_dir / "flower", task=task
        )
        self._model = copy.deepcopy(self.coordinator.evaluator.model)
        self._members: dict[int, _Member] = {}
        self._exhausted: set[int] = set()
        self._bootstrapped = False
        self._round: _Round | None = None
        self._grid: Grid | None = None

    def initial_arrays(self) -> ArrayRecord:
        """The fedps initial model, to pass as ``initial_arrays`` to :meth:`start`."""
        return ArrayRecord(self._model.state_dict())

    def summary(self) -> None:
        """Log the strategy's settings."""
        t = self.config.training
        _log.info(
            "FlowerStrategy: fedps secure aggregation, %d shard(s), key holder %s, "
            "min quorum %d, deadline %.0fs, fraction_train %.2f",
            len(self.config.cluster.shards),
            self.config.cluster.keyholder,
            self.min_quorum,
            t.deadline_s,
            self.fraction_train,
        )

    # ------------------------------------------------------------------ train
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Register new nodes, open the next fedps round on the shards, send its tasks.

        ``arrays`` are not sent: nodes pull the key holder's signed model from the shards.
        """
        coordinator = self.coordinator
        if not self._bootstrapped:
            coordinator.bootstrap()  # the key holder gets (or keeps) the initial model
            self._bootstrapped = True
            self._check_size(arrays)
        if server_round > self.config.training.rounds:
            _log.warning(
                "round %d is past training.rounds (%d), the horizon clients calibrated their "
                "DP noise for: they refuse rounds that exceed their epsilon budget",
                server_round,
                self.config.training.rounds,
            )
        self._grid = grid  # aggregate_train asks the committed nodes to push through it
        nodes = self._sample(grid)
        self._register(grid, [n for n in nodes if n not in self._members])
        cohort = {n: self._members[n] for n in nodes if n in self._members}
        if len(cohort) < self.min_quorum:
            _log.warning(
                "round %d: %d registered nodes, quorum is %d; skipping the round",
                server_round,
                len(cohort),
                self.min_quorum,
            )
            return []
        if len(cohort) > self.config.he.max_clients:
            raise ConfigError(
                f"{len(cohort)} nodes exceed he.max_clients ({self.config.he.max_clients}), "
                "which sizes the CKKS headroom; raise it or sample fewer nodes"
            )
        opened = self._open(coordinator.round + 1, cohort)
        config = ConfigRecord(dict(config))
        config["server-round"] = server_round
        messages = []
        for node, member in cohort.items():
            task = coordinator.desk.get_task(member.client_id, member.credential)
            if task.kind != "train":
                raise FedPSError(f"round {opened.number}: no task for {member.client_id}")
            opened.tasks[node] = wire.FlowerTask(
                round=task.round,
                version=task.version,
                deadline_unix=task.deadline_unix,
                weight_scale=task.weight_scale,
                context_id=task.context_id,
                client_id=member.client_id,
                run_id=coordinator.run_id,
            )
            messages.append(
                self._message(opened.tasks[node], node, wire.TRAIN_STAGE, server_round, config)
            )
        _log.info("round %d (fedps round %d): %d nodes", server_round, opened.number, len(cohort))
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Report the replies to the coordinator.

        It closes the round and the key holder decrypts and applies the aggregate. Returns the
        published model and the round's metrics (``None`` arrays when the round was abandoned).
        """
        current, self._round = self._round, None
        if current is None:  # configure_train skipped the round
            return None, None
        timeout = self.config.training.deadline_s + 60.0
        committed = self._collect(
            current, replies, set(current.cohort), server_round, hold_committed=True
        )
        grid = self._grid
        if (
            committed
            and grid is not None
            and self.coordinator.desk.wait_until_pushing(current.number, timeout)
        ):
            pushes = [
                self._message(current.tasks[node], node, wire.PUSH_STAGE) for node in committed
            ]
            replies = grid.send_and_receive(pushes, timeout=timeout)
            self._collect(current, replies, set(committed), server_round)
        else:  # the round ended below quorum before any push
            for node, report in committed.items():
                self._report(current.cohort[node], current.number, report)
        record = self._finish(current)
        metrics: dict[str, MetricRecordValues] = {
            "fedps-round": record.round,
            "contributors": record.contributors,
            "max-epsilon": record.max_epsilon,
            "bytes-pushed": record.bytes_pushed,
            "round-seconds": record.seconds,
            "abandoned": int(record.abandoned),
        }
        if record.accuracy >= 0:
            metrics.update({"accuracy": record.accuracy, "loss": record.loss})
        if record.abandoned:
            return None, MetricRecord(metrics)
        load_flat(self._model, self.coordinator.pull_model())
        return ArrayRecord(self._model.state_dict()), MetricRecord(metrics)

    # ------------------------------------------------------------------ evaluate
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """No client-side evaluation: the coordinator evaluates each published model.

        It evaluates it on the held-out split (``training.eval_every``); see the train metrics.
        """
        return []

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Nothing to aggregate (see :meth:`configure_evaluate`)."""
        return None

    # ------------------------------------------------------------------ helpers
    def _message(
        self,
        task: wire.FlowerTask,
        node: int,
        stage: str,
        server_round: int | None = None,
        config: ConfigRecord | None = None,
    ) -> Message:
        """A ``train`` message of ``stage`` carrying ``task`` (and the round's ``config``)."""
        values: dict[str, ConfigRecordValues] = {**task.to_record()}
        group = str(server_round if server_round is not None else task.round)
        message = _stage_message(stage, node, values, group_id=group)
        if config is not None:
            message.content["config"] = config
        return message

    def _collect(
        self,
        current: _Round,
        replies: Iterable[Message],
        expected: set[int],
        server_round: int,
        *,
        hold_committed: bool = False,
    ) -> dict[int, wire.RoundReport]:
        """Report each ``expected`` node's reply to the coordinator.

        A node without one is done, with nothing pushed. With ``hold_committed``, return the
        committed nodes' reports unreported instead (they still have to push).
        """
        held: dict[int, wire.RoundReport] = {}
        replied: set[int] = set()
        for reply in replies:
            node = reply.metadata.src_node_id
            member = current.cohort.get(node)
            if member is None or node in replied or node not in expected:
                continue
            replied.add(node)
            report = self._report_of(reply, current.number)
            if report is not None and report.budget_exhausted:
                self._exhausted.add(node)
            if hold_committed and report is not None and report.trained:
                held[node] = report
            else:
                self._report(member, current.number, report)
        for node in expected - replied:  # no reply in time: close without it
            _log.warning("round %d: no reply from node %d", server_round, node)
            self._report(current.cohort[node], current.number, None)
        return held

    def _check_size(self, arrays: ArrayRecord) -> None:
        size = sum(int(np.asarray(a).size) for a in arrays.to_numpy_ndarrays())
        expected = self.coordinator.layout.num_params
        if size != expected:
            raise InvalidArgumentError(
                f"initial arrays hold {size} values; the fedps model "
                f"({self.config.training.model}) has {expected}: use strategy.initial_arrays()"
            )

    def _sample(self, grid: Grid) -> list[int]:
        """Flower's sampling (waits for ``min_available_nodes``), without spent nodes."""
        connected = len(list(grid.get_node_ids()))
        size = max(int(connected * self.fraction_train), self.min_train_nodes)
        nodes, _ = sample_nodes(grid, self.min_available_nodes, size)
        return [n for n in nodes if n not in self._exhausted]

    def _register(self, grid: Grid, nodes: list[int]) -> None:
        """Ask new nodes for their registration and register them with the coordinator."""
        if not nodes:
            return
        messages = [_stage_message(wire.REGISTER_STAGE, node) for node in nodes]
        for reply in grid.send_and_receive(messages, timeout=self.register_timeout_s):
            node = reply.metadata.src_node_id
            if reply.has_error():
                _log.warning("node %d did not register: %s", node, reply.error.reason)
                continue
            try:
                reg = wire.Registration.from_record(reply.content.config_records[wire.RECORD_KEY])
                client_id, credential = self.coordinator.registry.register(
                    reg.name,
                    reg.num_examples,
                    reg.num_params,
                    reg.signing_key,
                    enrolment_token=reg.enrolment_token,
                )
            except (KeyError, FedPSError) as exc:
                _log.warning("node %d refused: %s", node, exc)
                continue
            # One member per identity: a node that re-registers an identity (a restarted
            # node has a new node id) takes it over.
            for other, member in list(self._members.items()):
                if member.client_id == client_id and other != node:
                    del self._members[other]
            self._members[node] = _Member(client_id, credential)

    def _open(self, number: int, cohort: dict[int, _Member]) -> _Round:
        """Start the coordinator's round in a thread; return once the shards accept pushes."""
        members = frozenset(m.client_id for m in cohort.values())
        errors: list[BaseException] = []

        def run() -> None:
            try:
                self.coordinator.run_round(number, members)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=run, name=f"fedps-round-{number}", daemon=True)
        thread.start()
        first = next(iter(cohort.values()))
        until = time.time() + self.config.training.deadline_s
        while self.coordinator.desk.get_task(first.client_id, first.credential).kind != "train":
            if not thread.is_alive() or time.time() > until:
                self.coordinator.stop()  # ends its retries; this run cannot go on
                thread.join(timeout=5.0)
                raise FedPSError(f"round {number} did not open on the shards") from (
                    errors[0] if errors else None
                )
            time.sleep(_POLL_S)
        self._round = _Round(number, cohort, thread, errors)
        return self._round

    def _report_of(self, reply: Message, number: int) -> wire.RoundReport | None:
        """The node's report, or None for an error reply or a malformed one."""
        node = reply.metadata.src_node_id
        if reply.has_error():
            _log.warning("node %d failed round %d: %s", node, number, reply.error.reason)
            return None
        try:
            report = wire.RoundReport.from_metrics(reply.content.metric_records[wire.METRICS_KEY])
        except (KeyError, InvalidArgumentError) as exc:
            _log.warning("node %d sent a malformed report: %s", node, exc)
            return None
        if report.round != number:
            _log.warning("node %d reported round %d, not %d", node, report.round, number)
            return None
        return report

    def _report(self, member: _Member, number: int, report: wire.RoundReport | None) -> None:
        """Tell the coordinator the member is done with the round (pushed or not).

        Which updates count is what the shards accepted, never what a reply claims.
        """
        try:
            self.coordinator.desk.report(
                member.client_id,
                number,
                epsilon=report.epsilon if report else 0.0,
                delta=report.delta if report else self.config.privacy.delta,
                bytes_pushed=report.bytes_pushed if report else 0,
                budget_exhausted=report.budget_exhausted if report else False,
                credential=member.credential,
            )
        except InvalidArgumentError as exc:  # an implausible report: done, figures ignored
            _log.warning("%s: %s", member.client_id, exc)
            if report is not None:
                self._report(member, number, None)

    def _finish(self, current: _Round) -> RoundRecord:
        """Wait for the coordinator to close, decrypt and apply the round."""
        current.thread.join(timeout=self.config.training.deadline_s + 120.0)
        if current.thread.is_alive():
            self.coordinator.stop()  # ends its retries; this run cannot go on
            raise FedPSError(f"round {current.number} did not finish (key holder or shards down?)")
        if current.error:
            raise FedPSError(f"round {current.number} failed") from current.error[0]
        record = self.coordinator.history[-1]
        if record.round != current.number:
            raise FedPSError(f"round {current.number} was not recorded")
        return record


def _stage_message(
    stage: str,
    node: int,
    values: dict[str, ConfigRecordValues] | None = None,
    *,
    group_id: str = "",
) -> Message:
    """A fedps message to ``node``: a Flower ``train`` message naming ``stage``.

    Its ``"fedps"`` record names ``stage`` (and holds ``values``).
    """
    record = ConfigRecord({**(values or {}), wire.STAGE_KEY: stage})
    content = RecordDict({wire.RECORD_KEY: record})
    return Message(
        content=content, message_type=MessageType.TRAIN, dst_node_id=node, group_id=group_id
    )
