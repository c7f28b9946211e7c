"""The coordinator (chief): the round state machine, orchestrating its parts.

The parts, one module each: the client registry (:mod:`.client_registry`), the task desk that
answers the clients' calls for tasks and their reports (:mod:`.task_desk`), the round policy
that tells synchronous rounds from asynchronous buffers (:mod:`.round_policy`), a round's
commit and push phases (:mod:`.round_phases`), the calls to the key holder and the shards
(:mod:`.cluster_peers`), the cohort sampler, the evaluator (in the background:
:mod:`.background_evaluation`) and the checkpoint store (:mod:`.checkpoint_store`).

One round: draw a cohort of live clients (:class:`~.cohort_sampler.CohortSampler`: Poisson at
client level, so a round can be skipped for a cohort smaller than ``min_quorum``), collect
their commitments at the key holder and freeze them, then have exactly the committed clients
push their ciphertexts to the shards (:class:`~.round_phases.RoundPhases`). If at least the
policy's ``min_quorum`` pushed all their blocks, the key holder checks and decrypts the
aggregate of exactly those clients, applies it and publishes the next version; otherwise the
round is abandoned and its sums are discarded, never decrypted.

Each client's privacy spend arrives with its calls (a client records what a round will spend,
and says so, before it trains), a second opinion: the server's privacy ledger
(:mod:`.privacy_ledger`) records each applied round with its exact contributors before the round
counts, and a client it says is out of budget is not drawn.
Every ``eval_every`` rounds the published model is pulled from the shards and evaluated on the
held-out split. The state is checkpointed (atomically) when a round opens (with its cohort
and deadline), when its commitments freeze, when it starts closing, every
``checkpoint_every`` rounds and at the end, so a restarted coordinator continues the round
it was in instead of starting over.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from fedps.errors import FedPSError, PolicyError, QuarantinedError, ShardStalledError
from fedps.learning.tasks import Task, check_dp_trainable
from fedps.round_timer import KEYHOLDER_PHASES, RoundTimer
from fedps.rpc.coordinator_messages import RETRY_AFTER_S, Assignment, RoundSummary
from fedps.rpc.keyholder_messages import RoundApplication
from fedps.sharding.blocks import BlockLayout
from server.coordinator.background_evaluation import BackgroundEvaluation
from server.coordinator.checkpoint_store import Checkpoint, CheckpointStore
from server.coordinator.client_registry import ClientRegistry, RegisteredClient
from server.coordinator.closed_rounds import ClosedRounds
from server.coordinator.cluster_peers import ClusterPeers
from server.coordinator.cohort_sampler import CohortSampler
from server.coordinator.coordinator_settings import CoordinatorSettings
from server.coordinator.evaluator import Evaluator
from server.coordinator.privacy_ledger import open_ledger
from server.coordinator.ring_keeper import ShardGoneError
from server.coordinator.round_phases import RoundPhases
from server.coordinator.round_policy import create_round_policy
from server.coordinator.round_record import (
    CLIENT_PHASE_ROUNDS,
    OpenRound,
    RoundRecord,
    check_phase_seconds,
    critical_path,
    known_phases,
    merged_metrics,
    slowest_clients,
)
from server.coordinator.task_desk import TaskDesk
from server.shard_misses import ShardMisses

if TYPE_CHECKING:
    from pathlib import Path

__all__ = ["Assignment", "Coordinator", "RoundRecord"]

_log = logging.getLogger("fedps")


class Coordinator:
    """The chief of a fedps cluster.

    The round state machine and its orchestration live here; the parts are a
    :class:`~.client_registry.ClientRegistry` (registration, authentication, liveness,
    privacy spend), a :class:`~.task_desk.TaskDesk` (the clients' tasks and reports, shown the
    round in progress), a :class:`~.round_policy.RoundPolicy` picked by ``training.mode``,
    :class:`~.round_phases.RoundPhases` (a round's commit and push phases),
    :class:`~.cluster_peers.ClusterPeers` (every call to the key holder and the shards), a
    :class:`~.checkpoint_store.CheckpointStore` and an :class:`~.evaluator.Evaluator`.

    :meth:`run` drives the rounds itself. Another driver (the Flower strategy) uses the public
    steps instead: ``registry.register`` for each client, :meth:`bootstrap` once, then for
    each round :meth:`run_round` (in a thread), ``desk.get_task``, ``desk.wait_until_pushing``
    and ``desk.report`` for the cohort, and :meth:`pull_model` for the published model.

    Build one with :meth:`open`, which does the I/O; the constructor takes what it made.

    Parameters
    ----------
    settings
        The rounds' schedule and limits, and the addresses of the other roles.
    evaluator
        The task's model (its initial parameters start the run) and its evaluation data, if
        any (evaluates every published model).
    registry
        The clients (:meth:`ClientRegistry.register` is a client's first call).
    store
        Where checkpoints are written.
    checkpoint
        The checkpoint to resume from (None: a new run), of the task's model.
    """

    def __init__(
        self,
        settings: CoordinatorSettings,
        *,
        evaluator: Evaluator,
        registry: ClientRegistry,
        store: CheckpointStore,
        checkpoint: Checkpoint | None = None,
    ) -> None:
        self.settings = settings
        self._training = settings.training
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.closed = ClosedRounds()  #: the sets rounds were applied with (parties ask)
        self._stop = threading.Event()
        self.evaluator = evaluator
        self._vector: np.ndarray = evaluator.initial_vector()
        self._vector_version = 0  # the version _vector holds
        self.layout = BlockLayout(self._vector.size, settings.values_per_block)
        #: registration and authentication (``registry.register`` is the client's first call)
        self.registry = registry
        registry.on_change = self._notify
        #: the clients' tasks (``GetTask``, a long poll) and reports (``ReportUpdate``)
        self.desk = TaskDesk(
            registry,
            self._changed,
            stop=self._stop,
            max_held_calls=settings.max_held_calls,
            client_eval=evaluator.client_eval,
        )
        self._store = store
        self._policy = create_round_policy(self._training.mode, self._training)
        self._sampler = CohortSampler(
            self._training, settings.privacy, max_clients=settings.max_clients
        )
        misses = ShardMisses(limit=settings.max_shard_misses, deadline_s=settings.shard_deadline_s)
        self.shard_misses = misses  #: the shards' missed deadlines of opening and closing rounds
        self._peers = ClusterPeers(settings.cluster, stop=self._stop, misses=self.shard_misses)
        self.run_id = secrets.token_hex(8)
        self.version = 0
        self.history: list[RoundRecord] = []
        self.last_checkpoint = 0.0
        self._resume: OpenRound | None = None  # the round a restarted coordinator continues
        self._last_live: frozenset[str] | None = None  # live at the last draw (None: none yet)
        self._keyholder_key: bytes | None = None  # verifies published blocks
        #: the coordinator's own phases of the round in progress (the round loop's thread)
        self._timer = RoundTimer()
        self._phases = RoundPhases(
            peers=self._peers,
            desk=self.desk,
            registry=registry,
            policy=self._policy,
            timer=self._timer,
            checkpoint=self._checkpoint,
            changed=self._changed,
            stop=self._stop,
            deadline_s=self._training.deadline_s,
        )
        #: the last applied round's model, evaluated while the next round runs (:meth:`run`)
        self._evaluation: BackgroundEvaluation | None = None
        self._unevaluated: int | None = None  # a round a restart must evaluate (checkpoint)
        #: whether the round loop evaluates in the background (:meth:`run`; not
        #: :meth:`run_round`, whose caller reads the round's record when it returns)
        self._background = False
        if checkpoint is not None:
            self._restore(checkpoint)

    @classmethod
    def open(
        cls,
        state_dir: Path,
        settings: CoordinatorSettings,
        *,
        task: Task,
        new_ledger: bool = False,
    ) -> Coordinator:
        """The coordinator whose state folder is ``state_dir``.

        ``task``'s model is built and its evaluation data loaded, the enrolment key read, the
        checkpoint loaded if there is one, the server's privacy ledger replayed.

        Parameters
        ----------
        state_dir
            Where checkpoints are written (created if absent, private).
        settings
            The rounds' schedule and limits, and the addresses of the other roles.
        task
            The task: its model's initial parameters start the run, and its evaluation data,
            if any, evaluates every published model.
        new_ledger
            Start a new privacy ledger, every client's epsilon from 0: only for a new run
            (:func:`~.privacy_ledger.open_ledger`).

        Raises
        ------
        ConfigError
            Without TLS (``tls.insecure``) and without an enrolment key in ``tls.directory``:
            no client could prove an identity; or, at example level, a model that DP-SGD
            cannot train (stopped here, not with every client at start).
        FedPSError
            If the checkpoint in ``state_dir`` cannot be read or is for another model.
        CorruptStateError
            If the privacy ledger is damaged.
        """
        evaluator = Evaluator(task, seed=settings.training.seed, client_eval=settings.client_eval)
        if settings.privacy.level == "example":
            check_dp_trainable(evaluator.model, task.name)
        num_params = evaluator.initial_vector().size
        store = CheckpointStore(state_dir)
        checkpoint = store.load(num_params=num_params)
        registry = ClientRegistry(
            settings.tls,
            num_params=num_params,
            liveness_s=max(30.0, 3 * settings.training.deadline_s),
            ledger=open_ledger(state_dir, settings, new=new_ledger),
        )
        return cls(
            settings, evaluator=evaluator, registry=registry, store=store, checkpoint=checkpoint
        )

    # ------------------------------------------------------------------ client-facing
    def _notify(self) -> None:
        """Wake whoever waits for a change (a registration, a report, a stop)."""
        with self._changed:
            self._changed.notify_all()

    @property
    def round(self) -> int:
        """The last finished round (the desk's: WAIT and DONE tasks carry it)."""
        return self.desk.round

    @round.setter
    def round(self, value: int) -> None:
        self.desk.round = value

    @property
    def recorded_round(self) -> int:
        """The last finished round that :attr:`history` records (its evaluation ended)."""
        evaluation = self._evaluation
        with self._lock:
            if evaluation is not None and all(r is not evaluation.record for r in self.history):
                return evaluation.record.round - 1
        return self.round

    @property
    def finished(self) -> bool:
        """Whether the run is done (the desk's: it answers every task with DONE)."""
        return self.desk.finished

    @finished.setter
    def finished(self, value: bool) -> None:
        self.desk.finished = value

    @property
    def clients(self) -> Mapping[str, RegisteredClient]:
        """The registered clients by client id (a read-only view)."""
        return self.registry.clients

    @property
    def max_epsilon(self) -> tuple[float, float]:
        """The largest epsilon any client reported, with its delta."""
        return self.registry.max_epsilon

    @property
    def client_epsilons(self) -> dict[str, float]:
        """Each client's epsilon by client id: the server ledger's, or its own if larger."""
        return self.registry.client_epsilons

    @property
    def bytes_pushed(self) -> int:
        """Bytes of encrypted updates the clients report having pushed."""
        return self.registry.bytes_pushed

    @property
    def client_noise_multipliers(self) -> dict[str, float]:
        """The noise multiplier each client last reported, by client id."""
        return self.registry.client_noise_multipliers

    # ------------------------------------------------------------------ the round loop
    def stop(self) -> None:
        """Ask :meth:`run` (and a :meth:`run_round` in progress) to return soon."""
        self._stop.set()
        self._notify()

    def run(self) -> None:
        """Run rounds until ``training.rounds`` are done or :meth:`stop` is called.

        Each applied round's published model is evaluated while the next round runs
        (:mod:`.background_evaluation`); the history records every round once its evaluation
        ended, in round order, and the run ends (or stops) once the last evaluation did.
        """
        self._background = True
        try:
            try:
                self._run()
            finally:
                self._background = False
                self._settle_evaluation(stopping=True)
        except FedPSError:
            if not self._stop.is_set():
                _log.exception("the round loop stopped")
                raise

    def _run(self) -> None:
        checkpointed = self.round
        self.bootstrap()  # the round and version follow the key holder's
        self._evaluate_restored()
        resume, self._resume = self._resume, None
        if resume is not None and checkpointed < resume.round <= self.round:
            # The key holder applied the round before we restarted: record its result.
            _log.info("round %d was applied before a restart; recording it", resume.round)
            self._record_applied(resume)
        elif resume is not None and resume.round > self.round and resume.version == self.version:
            # Restarted mid-round: continue it, so pushes the shards acknowledged still count.
            _log.info("continuing round %d after a restart", resume.round)
            self._run_round(resume.round, resume.cohort, resume=resume)
        while self.round < self._training.rounds and not self._stop.is_set():
            cohort = self._wait_for_cohort()
            if cohort is None:
                break
            self._run_round(self.round + 1, cohort)
        self._settle_evaluation()  # the history is complete before the run says it is done
        with self._changed:
            self.finished = not self._stop.is_set()
            self._changed.notify_all()  # waiting clients learn at once that the run is done
        if self.finished:
            self._checkpoint()
            _log.info("training finished after %d rounds", self.round)

    def bootstrap(self) -> None:
        """Wait for the key holder and give it the initial model (the chief's job).

        A key holder that already has a model at least as new as ours keeps it (and the
        shards get it republished, in case they restarted empty). Call once before the
        first :meth:`run_round`; :meth:`run` calls it itself.

        Raises
        ------
        FedPSError
            If the key holder's model has another size than the configured one.
        """
        state = self._peers.model_state()
        kept = state.initialized and state.version >= self.version
        if kept:
            self.version = state.version
            self.round = max(self.round, state.last_round)
            if state.num_params != self.layout.num_params:
                raise FedPSError("the key holder's model does not match the configured model")
        # A kept model is republished: shards may have restarted empty.
        self.version = self._peers.initialize(
            self.layout, self._vector, self.version, force=not kept
        )
        context = self._peers.public_context()
        self.desk.context_id = context.context_id
        self._keyholder_key = context.signing_key

    def pull_model(self) -> np.ndarray:
        """The published model, pulled from the shards once, every block's signature checked.

        Raises
        ------
        FedPSError
            A shard unavailable, behind, or serving a block the key holder did not sign.
        """
        return self._peers.pull_model(self.layout, self.version, self._keyholder_key)

    def _wait_for_cohort(self) -> frozenset[str] | None:
        """Wait for the clients the next round expects, then draw its cohort from the live ones.

        The first draw expects every provisioned client (``training.clients``); a later one the
        clients that were live at the previous draw (one that died or restarted is given the
        time to come back), not those gone longer: a client that stays away costs one grace,
        not one in every round. Without all of them, the draw goes on once ``deadline_s`` of
        grace has passed and at least ``min_quorum`` clients are live. None: stopping, or
        fewer than ``min_quorum`` clients have privacy budget left.
        """
        expected = self._training.clients
        grace_until = time.time() + self._training.deadline_s
        with self._changed:
            while not self._stop.is_set():
                live = self.registry.live()
                if self._all_back(live) or (
                    len(live) >= self._training.min_quorum and time.time() > grace_until
                ):
                    self._last_live = frozenset(live)
                    return self._sampler.draw(live)
                usable = self.registry.usable()
                if len(self.registry) >= expected and usable < self._training.min_quorum:
                    _log.warning("fewer than min_quorum clients have privacy budget left")
                    self._stop.set()
                    return None
                self._changed.wait(timeout=RETRY_AFTER_S)
        return None

    def _all_back(self, live: list[str]) -> bool:
        """Whether the clients the next draw expects are all ``live`` (see _wait_for_cohort)."""
        if self._last_live is None:
            return len(live) >= self._training.clients
        return self._last_live <= frozenset(live)

    def run_round(self, round_: int, cohort: frozenset[str]) -> None:
        """Run round ``round_`` with ``cohort`` (client ids) to its end.

        Commit, push, close, apply or abandon, evaluate, record it in :attr:`history`.

        Blocks until the round ends, evaluated and recorded (run it in a thread and serve the
        cohort's ``desk.get_task`` and ``desk.report`` meanwhile), or returns early without a
        record when :meth:`stop` is called.
        """
        self._run_round(round_, cohort)

    def _run_round(
        self, round_: int, cohort: frozenset[str], *, resume: OpenRound | None = None
    ) -> None:
        started = time.time()
        self._timer.reset()
        if resume is None and not self._sampler.fits(round_, cohort):
            record = RoundRecord(round_, self.version, 0, abandoned=True, cohort=len(cohort))
            self._finish_round(record, started, self.bytes_pushed)
            return
        with self._timer.phase("open"):  # the context changes when the key holder rotates keys
            self.desk.context_id = self._peers.public_context().context_id
        bytes_before = self.bytes_pushed
        opened = OpenRound(round_, self.version, self._policy.commit_deadline(started), cohort)
        if resume is not None:
            opened.deadline, opened.pushing = resume.deadline, resume.pushing
        if not opened.pushing and not self._phases.commit(opened, self.run_id):
            if not self._stop.is_set():
                record = RoundRecord(round_, opened.version, 0, abandoned=True)
                self._finish_round(record, started, bytes_before)
            return
        if self._stop.is_set():
            return
        committed, commitments = self._phases.freeze(opened)
        record = RoundRecord(round_, opened.version, 0, cohort=len(cohort))
        while True:
            try:
                accepted = self._phases.push(
                    opened, committed, commitments, run_id=self.run_id, resume=resume, record=record
                )
                if accepted is None:
                    return  # stopping
                if not record.abandoned and not self._apply(opened, frozenset(accepted), record):
                    return  # stopping, not refused: a restart continues the round
                break
            except ShardStalledError as exc:  # the round waits in the checkpoint for a restart
                self._halt(exc)
                return
            except ShardGoneError as exc:  # lost after the round closed, nothing decrypted
                self._phases.moved(opened, exc)
                resume = None
        if not record.abandoned:  # a quorum pushed, and the round was applied
            record.metrics = merged_metrics(
                [opened.metrics[c] for c in accepted if c in opened.metrics]
            )
        record.client_phases = opened.phases
        self._finish_round(record, started, bytes_before)

    def _record_applied(self, opened: OpenRound) -> None:
        """Record ``opened``, which the key holder applied while we were down (asked again)."""
        record = RoundRecord(opened.round, opened.version, 0, cohort=len(opened.cohort))
        if self._apply(opened, opened.committed, record):
            self._finish_round(record, time.time(), self.bytes_pushed)

    def _apply(self, opened: OpenRound, accepted: frozenset[str], record: RoundRecord) -> bool:
        """Have the key holder check, decrypt and apply exactly ``accepted``'s sum.

        Record the new version, or abandon the round if the key holder refused it. False: stopping.

        Only a refusal (:class:`PolicyError`: nothing was decrypted) abandons the round; any
        other failure is asked again (:meth:`ClusterPeers.apply_round`), and a shard declared
        gone before the round was applied raises :class:`ShardGoneError` (pushed again). A
        shard that stalls it (:class:`ShardStalledError`) stops the run, the round left as it
        is for a restart to apply once the shard answers.
        """
        self.closed.add(opened.round, accepted)  # what key-holder parties check
        application = RoundApplication(
            opened.round, opened.version, self.run_id, self.registry.signing_keys(accepted)
        )
        try:
            with self._timer.phase("apply_call"):
                applied = self._peers.apply_round(application)  # asks again until applied
        except ShardStalledError as exc:  # nothing failed a check: a restart applies it
            self._halt(exc)
            return False
        except PolicyError as exc:  # refused: the round is never decrypted
            if self._stop.is_set():
                return False
            self._refused(opened, record, exc)
            return True
        except ShardGoneError:
            raise  # not applied: the round's pushes move with the ring (_run_round)
        except FedPSError:  # only once stopping: every other answer is asked again
            return False
        contributors = applied.contributors or tuple(sorted(accepted))  # an older key holder
        released = (opened.round, contributors, applied.noise_multiplier)
        if not self.registry.record_released(self.run_id, *released, stop=self._stop):
            return False  # stopping: a restart records the round (the key holder repeats it)
        self.version = applied.version
        record.version = applied.version
        record.contributors = applied.fewest_contributors
        record.noise_multiplier = applied.noise_multiplier
        try:
            check_phase_seconds(applied.phase_seconds)
        except FedPSError as exc:  # a key holder of another version, or a broken one
            _log.warning("round %d: the key holder's phases are left out: %s", opened.round, exc)
        else:
            for name, seconds in known_phases(applied.phase_seconds, KEYHOLDER_PHASES).items():
                self._timer.add(name, seconds)
        return True

    def _refused(self, opened: OpenRound, record: RoundRecord, exc: PolicyError) -> None:
        """The key holder refused ``opened``.

        Discard it, and follow the key holder's version if the refusal was a version mismatch (later
        rounds train the key holder's model).
        """
        record.abandoned = True
        _log.warning("round %d refused by the key holder: %s", opened.round, exc)
        self._peers.discard_round(opened.round)
        state = self._peers.model_state()  # a shard quarantined on proof is declared gone:
        if self._peers.ring.quarantined(state.quarantined) and isinstance(exc, QuarantinedError):
            self._halt(exc)  # it is the last shard: no round can be applied any more
            return
        if state.version != self.version:
            _log.error(
                "round %d: the key holder's model is at version %d, not %d; following it",
                opened.round,
                state.version,
                self.version,
            )
            self.version = state.version

    def _halt(self, exc: QuarantinedError | ShardStalledError) -> None:
        """Stop the run on ``exc``, which no round can get past (one line: what holds it)."""
        _log.error("the run stops: %s", exc)
        self.stop()

    def _finish_round(self, record: RoundRecord, started: float, bytes_before: int) -> None:
        round_ = record.round
        if record.abandoned and self.settings.privacy.level == "client":
            # every global round counts at client level, released or not
            self.registry.record_released(self.run_id, round_, (), stop=self._stop)
        self.round = round_
        evaluate = not record.abandoned and (
            round_ % self._training.eval_every == 0 or round_ == self._training.rounds
        )
        if evaluate and not self.evaluator.has_data:  # the clients' metrics, if any
            record.take_metrics(record.metrics)
        record.max_epsilon = self.max_epsilon[0]
        record.bytes_pushed = self.bytes_pushed - bytes_before
        self._settle_evaluation()  # the round before is recorded first
        evaluation = None
        if evaluate and self.evaluator.has_data and self._background:
            evaluation = BackgroundEvaluation(
                record, partial(self._evaluate, self.version), self._record
            )
            self._timer.add("evaluate", 0.0)  # the round does not wait for it
        elif evaluate and self.evaluator.has_data:  # the caller reads the record on return
            with self._timer.phase("evaluate"):
                self._vector, metrics = self._evaluate(self.version)
                self._vector_version = self.version
            record.take_metrics(metrics)
        record.seconds = time.time() - started
        record.server_phases = self._timer.take()
        record.phases = critical_path(record.seconds, record.server_phases, record.client_phases)
        record.client_phases = slowest_clients(record.client_phases)
        if evaluation is None:
            self._record(record)
        else:  # the next round starts now; the record follows its evaluation
            self._evaluation = evaluation
            evaluation.start()
        # A round evaluated in the background is checkpointed, evaluated, by the next
        # checkpoint that waits for its evaluation (the next round's freeze, end, or the run's).
        due = round_ % self._training.checkpoint_every == 0
        if record.abandoned or (due and evaluation is None):
            self._checkpoint()

    def _record(self, record: RoundRecord) -> None:
        """Add ``record`` to the history (from the round loop or its evaluation's thread)."""
        with self._lock:
            self.history.append(record)
            if len(self.history) > CLIENT_PHASE_ROUNDS:  # the status and checkpoint stay small
                self.history[-CLIENT_PHASE_ROUNDS - 1].client_phases = {}
        _log.info("%s", RoundSummary.of(record).line(self._training.rounds))

    def _evaluate(self, version: int) -> tuple[np.ndarray, dict[str, float]]:
        """The published model of ``version``, pulled until it arrives, and its metrics."""
        vector = self._peers.retry(
            lambda: self._peers.pull_model(self.layout, version, self._keyholder_key),
            "pull model",
        )
        return vector, self.evaluator.evaluate(vector)

    def _settle_evaluation(self, *, stopping: bool = False) -> None:
        """Wait for the evaluation in progress, if any: its round is recorded once it returns.

        ``stopping``: the run is ending on an error or a stop, and an evaluation that failed
        (a stop ends its pull) leaves its round unrecorded, as a stop during the evaluation
        always did; otherwise its error is raised.
        """
        evaluation, self._evaluation = self._evaluation, None
        if evaluation is None:
            return
        try:
            vector = evaluation.wait()
        except FedPSError:
            if stopping:
                return
            raise
        self._vector, self._vector_version = vector, evaluation.record.version

    def _evaluate_restored(self) -> None:
        """Evaluate the round a checkpoint kept while its evaluation was in progress.

        It is the last round the checkpoint recorded; the key holder cannot have applied a
        later round, whose commitments freeze only once the evaluation ended.
        """
        unevaluated, self._unevaluated = self._unevaluated, None
        if unevaluated is None or not self.history or self.history[-1].round != unevaluated:
            return
        record = self.history[-1]
        if record.metrics or record.version != self.version:
            _log.warning("round %d was not evaluated before a restart", unevaluated)
            return
        self._vector, metrics = self._evaluate(record.version)
        self._vector_version = record.version
        with self._lock:
            record.take_metrics(metrics)
        _log.info("%s", RoundSummary.of(record).line(self._training.rounds))

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint(self, open_round: OpenRound | None = None) -> None:
        """Write the state atomically; ``open_round``: the round in progress, if any.

        Every checkpoint but that of a round's commit phase waits for the evaluation in
        progress first (:meth:`_settle_evaluation`): a round's commitments freeze, and the key
        holder can apply it, only once the round before is recorded with its metrics. A round
        still being evaluated is kept with the checkpoint (as ``evaluating``), and a restart
        evaluates it (:meth:`_evaluate_restored`).
        """
        if open_round is None or open_round.pushing:
            self._settle_evaluation()
        if open_round is None and self._vector_version != self.version:
            try:
                self._vector = self.pull_model()
                self._vector_version = self.version
            except FedPSError as exc:
                _log.warning("checkpoint without a fresh model: %s", exc)
        state = {
            "run_id": self.run_id,
            "round": self.round,
            "version": self.version,
            "clients": self.registry.state_dict(),
            "open": open_round.to_json() if open_round is not None else None,
            "ring": self._peers.ring.state_dict(),
        }
        with self._lock:  # an evaluation's thread records its round meanwhile
            history = list(self.history)
            evaluation = self._evaluation
            if evaluation is not None and all(r is not evaluation.record for r in history):
                history.append(evaluation.record)  # once: the restart evaluates it
                state["evaluating"] = evaluation.record.round
            state["history"] = [asdict(r) for r in history]
        if not self._store.save_until_written(self._vector, state, stop=self._stop):
            return  # stopping (e.g. disk full: the round waits until it is written)
        self.last_checkpoint = time.time()
        _log.info("checkpoint at round %d (version %d)", self.round, self.version)

    def _restore(self, checkpoint: Checkpoint) -> None:
        """Continue from ``checkpoint`` (at construction)."""
        self._vector = checkpoint.model
        state = checkpoint.state
        self.run_id = state["run_id"]
        self.round = int(state["round"])
        self.version = self._vector_version = int(state["version"])
        self.history = [RoundRecord(**r) for r in state["history"]]
        self.registry.load_state_dict(state["clients"])
        moved = self._peers.ring.load_state_dict(state.get("ring"))  # since the checkpoint
        if state.get("open"):
            self._resume = OpenRound.from_json(state["open"])
            self._resume.closing &= not moved  # the moved blocks are pushed again first
        if state.get("evaluating") is not None:
            self._unevaluated = int(state["evaluating"])
        self.last_checkpoint = checkpoint.saved_at
        _log.info("resumed from checkpoint: round %d, version %d", self.round, self.version)
