"""Local training with differential privacy: example level (DP-SGD) or client level (DP-FedAvg).

``privacy.level`` picks the trainer from a registry (:func:`create_trainer`):

``"example"`` (:class:`DPTrainer`)
    DP-SGD through Opacus. ``PrivacyEngine.make_private`` is called once per client, at the
    start of the run: the model, optimizer and Poisson-sampled data loader are wrapped once
    and reused every round, so the accountant accumulates every step the client ever takes (a
    new engine per round would reset epsilon). Per-sample gradients are clipped by Opacus's
    ghost clipping or its hooks (``privacy.clipping``, :mod:`clients.private_engine`): the same
    sum. With a target epsilon the noise multiplier is calibrated for the whole run
    (``rounds x local_epochs`` epochs at the client's own sampling rate) by
    :func:`fedps.learning.accounting.calibrate_noise`, which never overshoots.
``"client"`` (:class:`ClientLevelTrainer`)
    Plain local SGD; the whole update is clipped and noised, and the accountant counts rounds
    at the cohort sampling rate.

Either way the client refuses a round that would take it past its epsilon budget.

A trainer's spend is its accountant's history, ``(noise multiplier, sample rate, steps)``
entries (:class:`PrivacySpend`): :meth:`Trainer.spend_after_next_round` is what the client
records durably *before* it trains a round (``clients.client_state``), and
:meth:`Trainer.restore` continues from a recorded history, so a restarted client resumes its
budget instead of starting again from epsilon 0.
"""

from __future__ import annotations

import abc
import logging
import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from clients.private_engine import CLIPPING, SourcedPrivacyEngine, dp_backward
from crypto.noise_pool import NoiseDraw, NoisePool
from crypto.randomness import RandomSource, random_source
from fedps._registry import add_entry
from fedps.config import PrivacyConfig, TrainingConfig
from fedps.errors import ConfigError, PrivacyBudgetExceededError
from fedps.learning.accounting import (
    calibrate_noise,
    client_level_noise,
    epsilon_of_history,
    merged_history,
)
from fedps.learning.datasets import Dataset
from fedps.learning.tasks import Task, check_dp_trainable
from fedps.round_timer import RoundTimer
from fedps.sharding.blocks import flatten_model, load_flat

__all__ = [
    "ClientLevelTrainer",
    "DPTrainer",
    "History",
    "PrivacySpend",
    "Trainer",
    "create_trainer",
    "register_trainer",
]

_log = logging.getLogger("fedps")

History = tuple[tuple[float, float, int], ...]
"""An accountant's history: one ``(noise_multiplier, sample_rate, steps)`` per stretch of
sampled Gaussian steps with the same noise and rate (Opacus's format)."""


@dataclass(frozen=True)
class PrivacySpend:
    """What a trainer has spent on its data.

    Its accountant's history and that history's epsilon (at ``privacy.delta``, under
    ``privacy.accountant``).

    ``run_id`` is the run whose global rounds the last entry counts (client level; empty
    otherwise or before the client registered).
    """

    history: History
    epsilon: float
    run_id: str = ""


def _history(entries: Iterable[tuple[float, float, int]]) -> History:
    """``entries`` as a :data:`History` of plain floats and ints, empty stretches left out."""
    return tuple((float(s), float(q), int(n)) for s, q, n in entries if int(n) > 0)


def _tensors(data: Dataset) -> TensorDataset:
    return TensorDataset(torch.from_numpy(data.x), torch.from_numpy(data.y))


def _loader(data: Dataset, batch_size: int, seed: int, *, shuffle: bool) -> DataLoader[object]:
    return DataLoader(
        _tensors(data),
        batch_size=max(1, min(batch_size, len(data.y))),
        shuffle=shuffle,
        generator=torch.Generator().manual_seed(seed),
    )


class Trainer(abc.ABC):
    """A client's local trainer: trains a round, returns the update, keeps the privacy account.

    Subclasses set up their training and noise in :meth:`_prepare`, which the constructor
    calls last, and implement :meth:`history`, :meth:`history_after_next_round`,
    :meth:`restore`, :meth:`noise_of_next_round` and :meth:`_train_locally`.

    The noise a round adds can be drawn ahead of it, while the client waits
    (:meth:`draw_noise_ahead`, :class:`crypto.noise_pool.NoisePool`): a round takes what is
    ready and draws the rest itself. :meth:`close` ends the drawing.

    Parameters
    ----------
    model
        The model to train (a subclass may restrict it).
    data
        The client's private training data.
    training, privacy
        Hyperparameters; ``privacy.target_epsilon`` is the budget (``None``: no budget).
    seed
        Used only with ``privacy.insecure_reproducible``: then the DP noise and the sampling
        are drawn from it (anyone holding it can regenerate them). By default they come from
        :class:`crypto.randomness.SecureRandom`.
    task
        Where the loss and the local optimizer come from
        (:class:`fedps.learning.tasks.Task`; default:
        cross-entropy, or mean squared error for regression, and SGD).

    Attributes
    ----------
    timer
        Times the DP noise as its ``noise`` phase (the client's round timer: what the noise
        costs the training, drawn then or taken as drawn ahead, counts for ``noise``, not
        ``train``).
    noise_pool
        The noise drawn ahead (:meth:`draw_noise_ahead`), from :attr:`source`.
    """

    model: torch.nn.Module
    num_examples: int
    noise_multiplier: float
    sample_rate: float
    budget: float | None
    privacy: PrivacyConfig
    source: RandomSource
    noise_pool: NoisePool
    run_id: str = ""  # the run the trainer counts global rounds in (see set_run)

    def __init__(
        self,
        model: torch.nn.Module,
        data: Dataset,
        *,
        training: TrainingConfig,
        privacy: PrivacyConfig,
        seed: int = 0,
        task: Task | None = None,
    ) -> None:
        self.model = model
        self.privacy = privacy
        self.num_examples = len(data.y)
        self.budget = privacy.target_epsilon
        self._epochs = training.local_epochs
        self.task = task or Task(name="default", model=lambda: model, load_data=lambda _: data)
        self._loss = self.task.loss_fn(data.is_regression)
        #: the mean loss of the last round's local batches (NaN: none yet); shown on the
        #: client's own console, never sent
        self.last_loss = math.nan
        self.timer = RoundTimer()
        self._prepare(data, training, seed)

    @abc.abstractmethod
    def _prepare(self, data: Dataset, training: TrainingConfig, seed: int) -> None:
        """Set up training on ``data``.

        Set :attr:`source` and :attr:`noise_pool` from ``seed`` (see :func:`_randomness`; after
        the subclass's own checks, so that a refused configuration warns of no insecure seed),
        and set :attr:`noise_multiplier` and :attr:`sample_rate`.
        """

    @abc.abstractmethod
    def history(self) -> History:
        """The accountant's history so far.

        Everything spent on this data (restored spend included).
        """

    @abc.abstractmethod
    def history_after_next_round(self) -> History:
        """The accountant's history as it will be after one more round."""

    @abc.abstractmethod
    def restore(self, history: Iterable[tuple[float, float, int]], *, run_id: str = "") -> None:
        """Continue from a recorded ``history`` (what :meth:`spend` returned before).

        It replaces whatever this trainer has spent; ``run_id`` is the spend's
        :attr:`PrivacySpend.run_id`.
        """

    @abc.abstractmethod
    def noise_of_next_round(self) -> list[NoiseDraw]:
        """The noise the next round will add, in the order it adds it."""

    @abc.abstractmethod
    def _train_locally(self, only: np.ndarray | None = None) -> None:
        """Train ``self.model`` in place for one round (``only``: those coordinates alone)."""

    def draw_noise_ahead(self) -> None:
        """Start drawing the next round's noise in the background; returns at once.

        At low priority, for the time the client waits for its next round (see
        :class:`crypto.noise_pool.NoisePool`); :meth:`train_round` stops it and takes what is
        ready. Nothing is drawn ahead from a reproducible source.
        """
        self.noise_pool.fill(self.noise_of_next_round())

    def close(self) -> None:
        """Stop drawing noise ahead and drop what was drawn (no thread is left)."""
        self.noise_pool.close()

    def epsilon(self) -> float:
        """Epsilon spent so far (at ``privacy.delta``), over everything recorded."""
        return self._epsilon_of(self.history())

    def epsilon_after_next_round(self) -> float:
        """Epsilon the client would have spent after one more round."""
        return self._epsilon_of(self.history_after_next_round())

    def spend(self) -> PrivacySpend:
        """What has been spent so far."""
        history = self.history()
        return PrivacySpend(history, self._epsilon_of(history), self.run_id)

    def spend_after_next_round(self) -> PrivacySpend:
        """What will have been spent after one more round (record it before training)."""
        history = self.history_after_next_round()
        return PrivacySpend(history, self._epsilon_of(history), self.run_id)

    def _epsilon_of(self, history: History) -> float:
        return epsilon_of_history(history, self.privacy.delta, self.privacy.accountant)

    def set_run(self, run_id: str) -> None:
        """Tell the trainer which run (the coordinator's run id) its next rounds belong to.

        Only client-level accounting counts global rounds, per run; by default the run id is
        only recorded with the spend.
        """
        self.run_id = run_id

    def set_round(self, round_: int) -> None:
        """Tell the trainer which global round the next :meth:`train_round` belongs to.

        Only client-level accounting counts global rounds; by default this does nothing.
        """
        del round_

    def sit_out(self, round_: int) -> bool:
        """Account for finished global rounds up to ``round_`` that this client did not train in.

        Returns whether the spend grew. Only client-level accounting counts them (amplification by
        sampling counts every round); by default this does nothing.
        """
        del round_
        return False

    def can_train_round(self) -> bool:
        """Whether one more round stays within the epsilon budget (if there is one)."""
        return self.budget is None or self.epsilon_after_next_round() <= self.budget

    def train_round(
        self, global_params: np.ndarray, *, only: np.ndarray | None = None
    ) -> np.ndarray:
        """Train locally from ``global_params``; return the update (new - old).

        The noise drawn ahead is used where it is ready; nothing more is drawn ahead while
        the round trains. ``only``: the coordinates trained (``compression.masked_training``;
        None: every one); the others stay at ``global_params``.

        Raises
        ------
        PrivacyBudgetExceededError
            If the round would exceed the epsilon budget.
        """
        self.noise_pool.stop()
        if not self.can_train_round():
            raise PrivacyBudgetExceededError(
                f"one more round would spend epsilon {self.epsilon_after_next_round():.3f} "
                f"> budget {self.budget}"
            )
        load_flat(self.model, global_params)
        self._train_locally(only)
        update: np.ndarray = flatten_model(self.model) - global_params
        return self._release(update)

    def _release(self, update: np.ndarray) -> np.ndarray:
        """What leaves the client of a trained update (by default, the update itself)."""
        return update


class DPTrainer(Trainer):
    """DP-SGD (Abadi et al. 2016) on one client's data, via Opacus: example-level DP.

    Takes the parameters of :class:`Trainer`: the model must be Opacus-compatible (no
    BatchNorm), and ``training.rounds * training.local_epochs`` epochs are the horizon the
    noise is calibrated for when ``privacy.target_epsilon`` is set.
    """

    def _prepare(self, data: Dataset, training: TrainingConfig, seed: int) -> None:
        model, privacy = self.model, self.privacy
        check_dp_trainable(model, self.task.name)
        self.source, self.noise_pool = _randomness(privacy, seed)
        loader = _loader(data, training.batch_size, self.source.seed(), shuffle=False)
        # Poisson sampling takes each example at rate 1 / len(loader) but draws
        # int(1 / (1 / len(loader))) batches per epoch (as Opacus's loader does), which
        # floating point makes one fewer for some lengths (93, 99, ...); the accountant records
        # 1 / (batches per epoch) per step (a conservative rate). Calibrate for exactly what
        # the accountant will record.
        steps_per_epoch = int(1 / (1 / len(loader)))
        self.sample_rate = 1.0 / steps_per_epoch
        if privacy.target_epsilon is not None:
            sigma = calibrate_noise(
                privacy.target_epsilon,
                privacy.delta,
                self.sample_rate,
                training.rounds * training.local_epochs * steps_per_epoch,
                privacy.accountant,
            )
        else:
            assert privacy.noise_multiplier is not None
            sigma = privacy.noise_multiplier
        optimizer = self.task.create_optimizer(model.parameters(), training)
        with warnings.catch_warnings():
            # Opacus warns that its own secure_mode is off: the source replaces it.
            warnings.filterwarnings("ignore", message=".*[Ss]ecure.*")
            self.engine = SourcedPrivacyEngine(
                accountant=privacy.accountant, noise=self.noise_pool, timer=self.timer
            )
            private = self.engine.make_private(
                module=model,
                optimizer=optimizer,
                data_loader=loader,
                noise_multiplier=sigma,
                max_grad_norm=privacy.max_grad_norm,
                poisson_sampling=True,
                grad_sample_mode=CLIPPING[privacy.clipping],
            )
        # ghost clipping also returns Opacus's loss wrapper, which dp_backward does without
        self.module, self.optimizer, self.loader = private[0], private[1], private[-1]
        if len(self.loader) != steps_per_epoch:  # calibrated for a different step count
            raise RuntimeError(f"Opacus draws {len(self.loader)} batches, not {steps_per_epoch}")
        self.noise_multiplier = float(self.optimizer.noise_multiplier)
        _log.info(
            "DP-SGD: %d examples, sample rate %.4f, noise multiplier %.3f, %s noise, %s clipping",
            self.num_examples,
            self.sample_rate,
            self.noise_multiplier,
            privacy.noise_mode,
            privacy.clipping,
        )

    @property
    def steps_per_round(self) -> int:
        """Optimizer steps one round takes (each is one Poisson-sampled batch)."""
        return self._epochs * len(self.loader)

    def noise_of_next_round(self) -> list[NoiseDraw]:
        """Every step's noise: one array per trainable parameter, of its shape."""
        draws: list[NoiseDraw] = self.optimizer.noise_draws()
        return draws * self.steps_per_round

    def history(self) -> History:
        """The Opacus accountant's history: every DP-SGD step taken (and restored)."""
        return _history(self.engine.accountant.history)

    def history_after_next_round(self) -> History:
        """The accountant's history after one more round of :attr:`steps_per_round` steps."""
        step = (self.noise_multiplier, self.sample_rate, self.steps_per_round)
        return merged_history([*self.history(), step])  # as Opacus merges the steps

    def restore(self, history: Iterable[tuple[float, float, int]], *, run_id: str = "") -> None:
        """Continue the Opacus accountant from ``history``.

        Later steps merge into its last entry when their noise and sample rate are the same.
        """
        self.engine.accountant.history = list(_history(history))
        self.run_id = run_id

    def _train_locally(self, only: np.ndarray | None = None) -> None:
        """DP-SGD over the local data; with ``only``, on those coordinates alone.

        Each example's gradient is masked to them before it is clipped (Opacus's hooks: the
        mask's coordinates get the whole clipping norm), and the others are put back after
        each step (their noise never lands in the model).
        """
        self.module.train()
        loss_fn = self._loss
        masks = None if only is None else _parameter_masks(self.model, only)
        start = [] if masks is None else [p.detach().clone() for p in self.model.parameters()]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook")
            losses: list[float] = []
            for _ in range(self._epochs):
                for x, y in self.loader:
                    self.optimizer.zero_grad()
                    loss = dp_backward(self.module, loss_fn, x, y)
                    if masks is not None:
                        _masked_step(self.model, masks, start, self.optimizer)
                    else:
                        self.optimizer.step()
                    if len(y):
                        losses.append(float(loss.detach()))
        self.optimizer.zero_grad()
        self.last_loss = float(np.mean(losses)) if losses else math.nan


def _parameter_masks(model: torch.nn.Module, only: np.ndarray) -> list[torch.Tensor]:
    """Each parameter's 0/1 mask of the flat coordinates ``only`` (its own shape)."""
    keep = np.zeros(sum(p.numel() for p in model.parameters()), dtype=np.float32)
    keep[only] = 1.0
    masks, at = [], 0
    for p in model.parameters():
        masks.append(torch.from_numpy(keep[at : at + p.numel()]).view_as(p).to(p.dtype))
        at += p.numel()
    return masks


def _masked_step(
    model: torch.nn.Module,
    masks: list[torch.Tensor],
    start: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
) -> None:
    """One DP-SGD step on the masked coordinates (see :meth:`DPTrainer._train_locally`)."""
    for p, mask in zip(model.parameters(), masks, strict=True):
        grad_sample = getattr(p, "grad_sample", None)
        if grad_sample is None:
            raise ConfigError("masked training needs per-sample gradients (privacy.clipping)")
        p.grad_sample = grad_sample * mask  # type: ignore[attr-defined]  # Opacus's attribute
    optimizer.step()
    with torch.no_grad():
        for p, mask, before in zip(model.parameters(), masks, start, strict=True):
            p.copy_(torch.where(mask.bool(), p, before))


class ClientLevelTrainer(Trainer):
    """DP-FedAvg: client-level DP with distributed Gaussian noise.

    From McMahan et al. 2018, "Learning Differentially Private Recurrent Language Models".

    The client trains with plain SGD, clips its whole update to L2 norm ``privacy.clip_norm``
    (C) and adds Gaussian noise of std ``sigma * C / sqrt(n)`` per coordinate, where n is the
    cohort size (``training.cohort_size``, or ``training.clients`` when that is 0: the task
    does not carry the realised cohort). The sum of n such updates carries noise of std
    ``sigma * C``, the Gaussian mechanism on a sum whose sensitivity to one client is C. When a
    round sums m < n updates (dropouts, a small Poisson cohort), the key holder adds the
    missing ``n - m`` shares before it releases anything
    (:meth:`fedps.learning.accounting.ClientLevelNoise.top_up_std`). The edge client weighs every
    update 1.0 (a weight by example count would also scale the noise down).

    Accounting: one sampled Gaussian mechanism per global round, at sample rate
    ``q = n / training.clients``; sigma is calibrated for ``training.rounds`` rounds. The
    epsilon after global round r is the accountant's value for ``(sigma, q, r)``: every round
    counts, whether or not this client was in its cohort, which the amplification by sampling
    needs. Rounds are counted per run (:meth:`set_run`): the spend of earlier runs (or of
    another noise) on the same data is kept as a prior history that the run's
    ``(sigma, q, r)`` is composed with.

    Takes the parameters of :class:`Trainer`; the model may be any module (no per-sample
    gradients are needed), and ``training.mode`` must be ``"sync"``.

    Raises
    ------
    ConfigError
        In asynchronous mode (no cohorts), or for an unknown accountant.
    """

    def _prepare(self, data: Dataset, training: TrainingConfig, seed: int) -> None:
        privacy = self.privacy
        if training.mode != "sync":
            raise ConfigError("privacy.level = 'client' needs training.mode = 'sync' (cohorts)")
        self.source, self.noise_pool = _randomness(privacy, seed)
        self.noise = client_level_noise(training, privacy)
        self.cohort_size = self.noise.cohort
        self.sample_rate = self.noise.sample_rate
        self.clip_norm = privacy.clip_norm
        self.noise_multiplier = self.noise.noise_multiplier
        self.noise_std = self.noise.share_std
        self._num_params = flatten_model(self.model).size
        self._loader = _loader(data, training.batch_size, self.source.seed(), shuffle=True)
        self._optimizer = self.task.create_optimizer(self.model.parameters(), training)
        self._round = 0  # the global round announced by set_round
        self._rounds_spent = 0  # global rounds of run run_id accounted for
        self._prior: History = ()  # spent before run run_id (restored)
        _log.info(
            "DP-FedAvg: clip %.3g, noise multiplier %.3f, cohort %d, sample rate %.4f",
            self.clip_norm,
            self.noise_multiplier,
            self.cohort_size,
            self.sample_rate,
        )

    def set_run(self, run_id: str) -> None:
        """Count global rounds in run ``run_id`` from now on.

        The rounds counted in another run become part of the prior history (composed with this
        run's).
        """
        if run_id != self.run_id:
            self._prior, self._rounds_spent = self.history(), 0
            self.run_id = run_id

    def set_round(self, round_: int) -> None:
        """Record the global round the next :meth:`train_round` belongs to."""
        self._round = round_

    def sit_out(self, round_: int) -> bool:
        """Count every global round up to ``round_``, drawn for or not."""
        if round_ <= self._rounds_spent:
            return False
        self._rounds_spent = round_
        return True

    def _next_rounds_spent(self) -> int:
        # At least one more round, even if the same round number is trained twice.
        return max(self._round, self._rounds_spent + 1)

    def history(self) -> History:
        """The prior history, then ``(sigma, q, r)``.

        The latter covers every global round of this run up to the last one trained.
        """
        return self._with_rounds(self._rounds_spent)

    def history_after_next_round(self) -> History:
        """The history after the round announced by :meth:`set_round`."""
        return self._with_rounds(self._next_rounds_spent())

    def _with_rounds(self, rounds: int) -> History:
        return _history([*self._prior, (self.noise_multiplier, self.sample_rate, rounds)])

    def restore(self, history: Iterable[tuple[float, float, int]], *, run_id: str = "") -> None:
        """Continue from ``history``.

        Its last entry counts the global rounds of run ``run_id`` when it has this trainer's noise
        and rate; everything else is prior.
        """
        entries = _history(history)
        if entries and entries[-1][:2] == (self.noise_multiplier, self.sample_rate):
            self._prior, self._rounds_spent = entries[:-1], entries[-1][2]
        else:
            self._prior, self._rounds_spent = entries, 0
        self.run_id = run_id

    def noise_of_next_round(self) -> list[NoiseDraw]:
        """One share of the noise, over the whole update."""
        return [NoiseDraw(self.noise_std, (self._num_params,), np.float64)]

    def clip(self, update: np.ndarray) -> np.ndarray:
        """Scale ``update`` down to L2 norm at most ``clip_norm``."""
        norm = float(np.linalg.norm(update))
        clipped: np.ndarray = update * min(1.0, self.clip_norm / norm) if norm > 0 else update
        return clipped

    def add_noise(self, update: np.ndarray) -> np.ndarray:
        """Add this client's share of the noise: N(0, (sigma * C)^2 / n) per coordinate."""
        with self.timer.phase("noise"):
            noised: np.ndarray = update + self.noise_pool.normal(self.noise_std, update.shape)
        return noised

    def _train_locally(self, only: np.ndarray | None = None) -> None:
        if only is not None:
            raise ConfigError("masked training is example-level DP-SGD (privacy.level)")
        self.model.train()
        loss_fn = self._loss
        losses: list[float] = []
        for _ in range(self._epochs):
            for x, y in self._loader:
                self._optimizer.zero_grad()
                loss: torch.Tensor = loss_fn(self.model(x), y)
                loss.backward()  # type: ignore[no-untyped-call]  # untyped in torch
                self._optimizer.step()
                losses.append(float(loss.detach()))
        self._optimizer.zero_grad()
        self.last_loss = float(np.mean(losses)) if losses else math.nan

    def _release(self, update: np.ndarray) -> np.ndarray:
        """Clip and noise the update, and account for the round."""
        released = self.add_noise(self.clip(update))
        self._rounds_spent = self._next_rounds_spent()
        return released


def _randomness(privacy: PrivacyConfig, seed: int) -> tuple[RandomSource, NoisePool]:
    """The trainer's randomness, and its noise drawn ahead from it.

    A CSPRNG, or ``seed`` behind the insecure setting (then nothing is drawn ahead); the pool
    holds at most ``privacy.noise_ahead_mib``.
    """
    source = random_source(seed if privacy.insecure_reproducible else None, role="client")
    return source, NoisePool(source, max_bytes=privacy.noise_ahead_mib << 20)


_TRAINERS: dict[str, type[DPTrainer] | type[ClientLevelTrainer]] = {
    "client": ClientLevelTrainer,
    "example": DPTrainer,
}


def register_trainer(name: str, trainer: type[DPTrainer] | type[ClientLevelTrainer]) -> None:
    """Make the trainer class ``trainer`` available to :func:`create_trainer`.

    It is chosen by ``privacy.level = NAME``.

    Raises
    ------
    ValueError
        If ``name`` is empty or already registered.
    """
    add_entry(_TRAINERS, name, trainer, "trainer")


def create_trainer(
    model: torch.nn.Module,
    data: Dataset,
    *,
    training: TrainingConfig,
    privacy: PrivacyConfig,
    seed: int = 0,
    task: Task | None = None,
) -> Trainer:
    """The trainer for ``privacy.level`` (``"example"`` or ``"client"``).

    Raises
    ------
    ConfigError
        For an unknown level.
    """
    try:
        cls = _TRAINERS[privacy.level]
    except KeyError:
        raise ConfigError(
            f"unknown privacy level {privacy.level!r}; choose one of {', '.join(_TRAINERS)}"
        ) from None
    return cls(model, data, training=training, privacy=privacy, seed=seed, task=task)
