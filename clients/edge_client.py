"""The edge client (worker): register, pull, train with DP-SGD, encrypt, push, report.

One round as the client sees it:

1. ``GetTask`` from the coordinator says ``TRAIN`` round r on model version v.
2. Pull version v's blocks from the shards, every block's signature checked
   (:meth:`clients.client_session.ClientSession.pull`).
3. Record what the round will spend in the client's privacy ledger
   (:class:`clients.privacy_ledger.PrivacyLedger`) and tell the coordinator (a ``GetTask``
   call carrying the epsilon), then train locally with DP-SGD
   (:class:`clients.dp_trainer.DPTrainer`), or with client-level DP
   (``privacy.level = "client"``, :class:`clients.dp_trainer.ClientLevelTrainer`: the update
   is clipped and noised); the trainer's accountant keeps everything spent on this data.
4. Weight the update, clip it to ``he.max_abs_value``, cut it into blocks and encrypt each
   block under the key holder's public context
   (:class:`clients.update_pipeline.UpdatePipeline`).
5. Commit at the key holder: the signed root of every encrypted block, and the sketch of every
   block under the round's secret challenge, before any ciphertext of the round reaches a
   shard (the same pipeline).
6. Push each block to the shard that owns it once the key holder froze the commitments
   (:class:`clients.pusher.Pusher`), and report to the coordinator (epsilon spent, bytes
   pushed).

While it waits for its next round, the client draws at low priority what that round will
need and what does not depend on the model: the encryptions of zero (the offline half of
encryption) and the DP noise (:class:`crypto.noise_pool.NoisePool`).

:class:`EdgeClient` is the run loop that composes those parts: :meth:`EdgeClient.run` loops
over the coordinator's tasks with :meth:`EdgeClient.run_task`; steps 2 to 5 are
:meth:`EdgeClient.train_round`, the part a Flower node runs too
(:mod:`clients.flower.flower_client`), and step 6 is :meth:`EdgeClient.send`. Its
:class:`~clients.client_session.ClientSession` holds who it is in the run (enrolment token,
signing key, registration) and its channels, with the key holder's public context; mods
(:mod:`clients.train_step`) wrap the training from outside, as the simulated slow devices
and dropouts of :class:`clients.simulation.SimulatedDevice` do; the coordinator is reached
through an :class:`~clients.client_session.Uplink`.

The client outlasts its peers: no answer of a shard, the coordinator or the key holder ends
it, whatever status or error class the answer names (a peer can name any class of
:mod:`fedps.errors`, :class:`~fedps.errors.ConfigError` or
:class:`~fedps.errors.QuarantinedError` included). A call a peer refused or failed (after
transient failures were retried for ``peer_wait_s``) is counted in
:attr:`EdgeClient.peer_failures` (:class:`clients.peer_failures.PeerFailures`), shown in the
round's :class:`~clients.round_progress.RoundProgress` and logged as a warning naming the peer
and the reason; the client then goes on: a shard that refuses a push costs that shard's blocks
of the round (the others still get theirs, and the client reports), a refused commitment costs
the round, and any other refusal sends it back, after a backoff, to asking the coordinator for
its next task. A committed update is kept and pushed when the coordinator asks for it, even
after such a failure. A coordinator that refuses the client's identity is asked again too
(with a warning that names the enrolment token and the certificate to check): a peer's word,
or an impostor's, never stops the client. Only its own faults do: its configuration, its
identity and data as it loads them, its state folder, and its configuration refusing the key
holder it was pointed at (a signing key other than the one ``security.keyholder_key`` pins, no
encryption while ``he.enabled`` is set): each a :class:`~fedps.errors.ConfigError` or
:class:`~fedps.errors.CorruptStateError` the client raises itself (never one a peer names), or
an error that is not fedps's, such as a full disk.

The client's state folder (``<cluster.state_dir>/clients/<identity>``, or ``state_dir``)
keeps its signing key and privacy ledger across restarts: a restarted client registers with
the same id and key, reports the epsilon it had spent, and resumes its budget from there; it
refuses to train past its target.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import numpy as np

from clients.client_eval import ClientEvaluation
from clients.client_session import LONG_POLL_S, ClientSession, Uplink, pause
from clients.client_setup import ClientSetup, open_setup
from clients.client_state import DataSource
from clients.dp_trainer import PrivacySpend, Trainer
from clients.error_feedback import ErrorFeedback
from clients.peer_failures import (
    COORDINATOR,
    PAUSE_S,
    SHARDS,
    PeerFailures,
    failure_backoff,
    from_peer,
    own_fault,
)
from clients.privacy_ledger import EXTERNAL_DATA, PrivacyLedger
from clients.pusher import Pusher
from clients.round_progress import ClientSummary, RoundProgress
from clients.train_step import TrainMod, TrainStep, chain
from clients.update_pipeline import PreparedPush, UpdatePipeline, aggregation_weight
from crypto.signing import BlockSigner
from fedps.config import FedPSConfig
from fedps.errors import (
    FedPSError,
    PrivacyBudgetExceededError,
    UnauthenticatedError,
    UnknownClientError,
)
from fedps.learning.tasks import Task
from fedps.rpc.coordinator_messages import Assignment
from fedps.rpc.coordinator_stub import CoordinatorStub

__all__ = [
    "EXTERNAL_DATA",
    "ClientSummary",
    "EdgeClient",
    "PreparedPush",
    "RoundOutcome",
    "RoundProgress",
    "Uplink",
]

_log = logging.getLogger("fedps")
_PEER_WAIT_S = 90.0  # how long a call waits out a restarting peer (EdgeClient's peer_wait_s)


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


class EdgeClient:
    """A federated worker: a run loop over its parts.

    Made by :meth:`open` (which reads its enrolment token, opens its state folder and loads
    its data); the constructor takes the parts and does no I/O.

    Attributes
    ----------
    session, ledger, pipeline, pusher
        Its parts: its identity in the run and its channels
        (:class:`~clients.client_session.ClientSession`), its privacy spend
        (:class:`~clients.privacy_ledger.PrivacyLedger`), what weights, clips, encrypts and
        commits its updates (:class:`~clients.update_pipeline.UpdatePipeline`) and what pushes
        them (:class:`~clients.pusher.Pusher`).
    identity, state, signing_key, enrolment_token
        Who it is: ``tls.name`` or ``client-INDEX``; its state (signing key and ledger, in its
        folder or in memory); the Ed25519 public key it signs with; the token that proves its
        identity (empty if it has none).
    data_fingerprint, num_params
        What the ledger keys its spend by (its data's fingerprint); the model's parameters.
    peer_failures
        The calls peers refused or failed, counted by ``"peer: reason"`` (``"shard-1:
        invalid_argument"``, ``"coordinator: unauthenticated"``); :attr:`failures` is their
        total.
    weight, rounds_trained
        Its last update's aggregation weight; the rounds it trained in.
    """

    def __init__(
        self,
        config: FedPSConfig,
        *,
        setup: ClientSetup,
        mods: Sequence[TrainMod] = (),
        on_round: Callable[[RoundProgress], None] | None = None,
        uplink: Uplink | None = None,
        peer_wait_s: float = _PEER_WAIT_S,
    ) -> None:
        """Compose a client from its ``setup`` (see :meth:`open` for the other parameters)."""
        self.config = config
        name, state, trainer, own_data = setup.name, setup.state, setup.trainer, setup.own_data
        self.name, self.identity = name, setup.identity
        self.mods = tuple(mods)
        self.on_round = on_round
        self.task, self.trainer = setup.task, trainer
        self._evaluation = ClientEvaluation.configured(config, setup.task, own_data, name=name)
        source = DataSource(EXTERNAL_DATA) if own_data is None else DataSource.of(own_data)
        self.ledger = PrivacyLedger(state, trainer, data=source, privacy=config.privacy, name=name)
        self._peers = PeerFailures(
            name, identity=setup.identity, tls_directory=config.tls.directory
        )
        # Every call has a deadline: one caught in a peer's restart fails and is retried.
        self.session = ClientSession(
            config,
            name=name,
            enrolment_token=setup.enrolment_token,
            ledger=self.ledger,
            failures=self._peers,
            uplink=uplink if uplink is not None else CoordinatorStub(config.cluster.coordinator),
            peer_wait_s=peer_wait_s,
        )
        #: the seconds of each phase of the round in progress (:mod:`fedps.round_timer`),
        #: reported with the round; the trainer's own timer, which times its DP noise
        self.timer = trainer.timer
        feedback = ErrorFeedback.configured(
            config.compression, self.session.num_params, state.directory
        )
        self.pipeline = UpdatePipeline(
            self.session, self._peers, timer=self.timer, feedback=feedback
        )
        self.pusher = Pusher(self.session, self._peers, timer=self.timer)
        self.state, self.uplink, self.peer_wait_s = state, self.session.uplink, peer_wait_s
        self.num_params, self.signing_key = self.session.num_params, state.signer.public_key
        self.data_fingerprint, self.enrolment_token = source.fingerprint, setup.enrolment_token
        self.peer_failures = self._peers.counts
        self.rounds_trained = 0
        self.weight = 1.0  # num_examples / the round's weight_scale

    @classmethod
    def open(
        cls,
        config: FedPSConfig,
        *,
        index: int,
        name: str = "",
        state_dir: Path | None = None,
        signer: BlockSigner | None = None,
        token_required: bool = False,
        mods: Sequence[TrainMod] = (),
        data: Path | Sequence[Path] | None = None,
        task: Task | None = None,
        trainer: Trainer | None = None,
        on_round: Callable[[RoundProgress], None] | None = None,
        uplink: Uplink | None = None,
        peer_wait_s: float = _PEER_WAIT_S,
    ) -> Self:
        """Open client ``index``'s setup and compose the client.

        :func:`~clients.client_setup.open_setup` reads its enrolment token, opens its state
        folder and loads its task and data; the client is then made of those parts.

        Parameters
        ----------
        config, index, name, state_dir, signer, token_required, data, task, trainer
            What :func:`~clients.client_setup.open_setup` takes (see there).
        mods
            Wrap every round's training (:data:`clients.train_step.TrainMod`), the first
            outermost; for example :class:`clients.simulation.SimulatedDevice`.
        on_round
            Called with a :class:`RoundProgress` after each round the client took part in (the
            CLI prints its line).
        uplink
            Where it registers, asks for tasks and reports (default: the coordinator of
            ``config.cluster`` over gRPC); closed by :meth:`close`.
        peer_wait_s
            How long a call to a peer retries its transient failures (a peer restarting,
            unreachable or overloaded) before the call counts as failed.

        Raises
        ------
        ConfigError, InvalidArgumentError
            See :func:`~clients.client_setup.open_setup`.
        """
        setup = open_setup(
            config,
            index=index,
            name=name,
            state_dir=state_dir,
            signer=signer,
            token_required=token_required,
            data=data,
            task=task,
            trainer=trainer,
        )
        return cls(
            config,
            setup=setup,
            mods=mods,
            on_round=on_round,
            uplink=uplink,
            peer_wait_s=peer_wait_s,
        )

    @property
    def recorded(self) -> PrivacySpend:
        """The spend the ledger holds."""
        return self.ledger.recorded

    @property
    def client_id(self) -> str:
        """The id the coordinator gave the client (empty before it registered)."""
        return self.session.client_id

    @property
    def bytes_pushed(self) -> int:
        """What the shards took over the run."""
        return self.pusher.bytes_pushed

    @property
    def failures(self) -> int:
        """How many of the client's calls peers refused or failed (:attr:`peer_failures`)."""
        return self._peers.total

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
            if self.session.start(deadline):
                _log.info("%s registered as %s", self.name, self.client_id)
                self.trainer.draw_noise_ahead()  # while it waits for its first round
                self._run_tasks(deadline)
        finally:
            self.session.shutdown()
            self.trainer.close()
        return ClientSummary(
            self.client_id,
            self.rounds_trained,
            self.recorded.epsilon,
            self.config.privacy.delta,
            self.bytes_pushed,
            self.failures,
        )

    def _run_tasks(self, deadline: float) -> None:
        """Ask for tasks and carry them out until the run is over for us or ``deadline``.

        The deadline is a ``time.time()``; every answer of a peer is survived.

        The steps that talk to the shards and the key holder count their peers' refusals
        themselves; what reaches this loop is the coordinator's (its tasks, a registration
        again) or the client's own.
        """
        backoff = failure_backoff()
        registered = True
        while (left := deadline - time.time()) > 0:
            try:
                if not registered:
                    self.session.register(left)
                    registered = True
                task = self.session.poll_task(retry_s=left, wait_s=LONG_POLL_S)
                if not self.run_task(task):
                    return
                backoff.reset()
                continue
            except FedPSError as exc:
                if not from_peer(exc) and isinstance(exc, PrivacyBudgetExceededError):
                    _log.info("%s: %s; done", self.name, exc)  # our own accountant says so
                    return
                if own_fault(exc):
                    raise
                if isinstance(exc, UnknownClientError):  # the coordinator restarted without us
                    _log.info("%s: %s; registering again", self.name, exc)
                    registered = False
                else:
                    self._peers.failed(COORDINATOR, exc)
                    # a credential refused: a registration again brings a fresh one
                    registered = registered and not isinstance(exc, UnauthenticatedError)
            backoff.pause()

    def run_task(self, task: Assignment) -> bool:
        """Carry out one task of the coordinator.

        ``TRAIN``: :meth:`train_round`, then push the update once the round's commitments
        are frozen and report to the coordinator. ``PUSH``: push again what was pushed for
        that round (the coordinator restarted before it saw the report) and report; a client
        restarted since it committed has nothing to push and reports at once, so the round
        closes without it instead of at its deadline. ``WAIT`` and
        ``DONE``: count the rounds that went on without this client (client-level DP), then
        wait ``task.retry_after`` or stop.

        Returns
        -------
        bool
            False when this client is done: the run is over or its privacy budget is spent.
        """
        if task.kind in ("wait", "done"):
            self.session.sit_out(task.round, final=task.kind == "done")
        if task.kind == "done":
            return False
        if task.kind == "train":
            return self._train(task)
        if task.kind == "push":
            # Pushed again, or nothing of ours to push (a restart lost what this client
            # committed): either way the report tells the round not to wait for us.
            self.pusher.resend(task)
            self._report(task.round, 0, budget_exhausted=False)
        else:
            pause(task)
        return True

    def close(self) -> None:
        """Release the state folder and close the uplink; drop the noise drawn ahead."""
        self.trainer.close()
        self.state.close()
        self.uplink.close()

    def _train(self, task: Assignment) -> bool:
        """Train, push and report one round; returns False when the privacy budget is spent."""
        self.timer.reset()
        if not self.session.adopt_context(task.context_id):
            time.sleep(PAUSE_S)
            return True
        committed = self.pusher.committed
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
            self.pusher.keep(outcome.prepared)  # kept through a failure of what follows
            self._deliver(outcome.prepared)
        # Offline half of encryption and the next round's DP noise, at low priority while we
        # wait for the next round (no noise after the run's last round).
        self.session.precompute(background=True)
        if task.round < self.config.training.rounds:
            self.trainer.draw_noise_ahead()
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
        ``num_examples``), encrypt it and commit it at the key holder (:meth:`prepare`).
        Nothing reaches a shard: :meth:`send` pushes the committed update once the round's
        commitments are frozen.

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
        self.trainer.noise_pool.stop()  # the wait is over: nothing more drawn ahead
        if not self.session.adopt_context(context_id):
            return RoundOutcome(round_)
        self.trainer.set_round(round_)
        if not self.trainer.can_train_round():
            _log.info("%s: privacy budget spent (epsilon %.3f)", self.name, self.recorded.epsilon)
            return RoundOutcome(round_, budget_exhausted=True)
        try:
            with self.timer.phase("pull"):
                vector, pulled = self.session.pull(version)
        except FedPSError as exc:
            self._peers.failed(SHARDS, exc)
            time.sleep(PAUSE_S)
            return RoundOutcome(round_)
        if pulled != version:
            _log.info("%s: shards moved to version %d; skipping round", self.name, pulled)
            return RoundOutcome(round_)
        if self._evaluation is not None:
            with self.timer.phase("client_eval"):
                self._evaluation.evaluate(round_, vector)
        # Record what the round will have spent (durable), then tell the coordinator: neither
        # ever reports less than was spent, whatever happens afterwards (a crash, a lost push).
        with self.timer.phase("spend"):
            self.ledger.record_next_round()
        with self.timer.phase("announce"):
            told = not announce or self.session.announce_spend()
        if not told:
            return RoundOutcome(round_)  # not told (or it forgot us): the round is not trained
        weight = aggregation_weight(self.config, self.trainer.num_examples, weight_scale)
        step = TrainStep(self.name, self.client_id, round_, version, deadline_unix, weight)
        with self.timer.phase("train"):  # its DP noise apart (the trainer times it)
            delta = chain(self.mods, self._train_step)(step, vector)
        if delta is None:  # a mod kept the update back
            return RoundOutcome(round_)
        self.weight = step.weight
        prepared = self.prepare(round_, version, delta)
        self.rounds_trained += 1
        committed = round_ if prepared is None else prepared.round
        return RoundOutcome(committed, trained=True, prepared=prepared)

    def _train_step(self, step: TrainStep, params: np.ndarray) -> np.ndarray:
        """Local DP training from ``params`` (the innermost step of the mods' chain)."""
        return self.trainer.train_round(params, only=self.pipeline.training_mask(step.round))

    def prepare(self, round_: int, version: int, delta: np.ndarray) -> PreparedPush | None:
        """Weight (by :attr:`weight`), clip, encrypt and commit an update.

        Returns the signed push messages per shard (None when the round's commitments had closed).
        """
        return self.pipeline.prepare(round_, version, delta, weight=self.weight)

    def send(self, prepared: PreparedPush) -> int:
        """Push committed messages to their shards now; returns bytes pushed.

        The round's commitments must be frozen and the shards have opened it. A shard that refuses
        or keeps failing counts no bytes (and a failure, :attr:`peer_failures`).
        """
        return self.pusher.send(prepared)

    def _deliver(self, prepared: PreparedPush) -> None:
        """Push a committed update once its round's push phase opens, then report it."""
        self._conclude(prepared.round, self.pusher.push_when_open(prepared))

    def _conclude(self, round_: int, pushed: int) -> None:
        """Report a round the client trained for (``pushed`` bytes) and tell ``on_round``."""
        try:
            self._report(round_, pushed, budget_exhausted=False)
        finally:
            refused = self._peers.take_refused()
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
                        push_seconds=self.pusher.push_seconds if pushed else 0.0,
                        refused=refused,
                        failures=self.failures,
                    )
                )

    def _report(self, round_: int, pushed: int, *, budget_exhausted: bool) -> None:
        """Report a round to the coordinator.

        With its metrics (``task.client_eval``) and the seconds of its phases (:attr:`timer`,
        taken).
        """
        metrics = {} if self._evaluation is None else self._evaluation.take(round_)
        self.session.report(
            round_,
            pushed=pushed,
            weight=self.weight,
            budget_exhausted=budget_exhausted,
            metrics=metrics,
            phase_seconds=self.timer.take(),
        )
