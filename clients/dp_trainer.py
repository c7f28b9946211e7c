"""Local training with differential privacy: example level (DP-SGD) or client level (DP-FedAvg).

``privacy.level`` picks the trainer from a registry (:func:`create_trainer`):

``"example"`` (:class:`DPTrainer`)
    DP-SGD through Opacus. ``PrivacyEngine.make_private`` is called once per client, at the
    start of the run: the model, optimizer and Poisson-sampled data loader are wrapped once
    and reused every round, so the accountant accumulates every step the client ever takes (a
    new engine per round would reset epsilon). With a target epsilon the noise multiplier is
    calibrated for the whole run (``rounds x local_epochs`` epochs at the client's own
    sampling rate) by :func:`clients.accounting.calibrate_noise`, which never overshoots.
``"client"`` (:class:`ClientLevelTrainer`)
    Plain local SGD; the whole update is clipped and noised, and the accountant counts rounds
    at the cohort sampling rate.

Either way the client refuses a round that would take it past its epsilon budget.
"""

from __future__ import annotations

import abc
import logging
import math
import warnings

import numpy as np
import torch
from opacus import PrivacyEngine
from torch.utils.data import DataLoader, TensorDataset

from clients.accounting import calibrate_noise, epsilon, epsilon_of_history
from fedps.blocks import flatten_model, load_flat
from fedps.config import PrivacyConfig, TrainingConfig
from fedps.datasets import Dataset
from fedps.errors import ConfigError, PrivacyBudgetExceededError

__all__ = ["ClientLevelTrainer", "DPTrainer", "Trainer", "create_trainer"]

_log = logging.getLogger("fedps")


def _loader(data: Dataset, batch_size: int, seed: int, *, shuffle: bool) -> DataLoader[object]:
    dataset = TensorDataset(torch.from_numpy(data.x), torch.from_numpy(data.y))
    return DataLoader(
        dataset,
        batch_size=max(1, min(batch_size, len(data.y))),
        shuffle=shuffle,
        generator=torch.Generator().manual_seed(seed),
    )


class Trainer(abc.ABC):
    """A client's local trainer: trains a round, returns the update, keeps the privacy account.

    Subclasses set the attributes in their constructor and implement :meth:`epsilon`,
    :meth:`epsilon_after_next_round` and :meth:`_train_locally`.
    """

    model: torch.nn.Module
    num_examples: int
    noise_multiplier: float
    sample_rate: float
    budget: float | None

    @abc.abstractmethod
    def epsilon(self) -> float:
        """Epsilon spent so far (at ``privacy.delta``), over the whole run."""

    @abc.abstractmethod
    def epsilon_after_next_round(self) -> float:
        """Epsilon the client would have spent after one more round."""

    @abc.abstractmethod
    def _train_locally(self) -> None:
        """Train ``self.model`` in place for one round."""

    def set_round(self, round_: int) -> None:
        """Tell the trainer which global round the next :meth:`train_round` belongs to.

        Only client-level accounting counts global rounds; by default this does nothing.
        """
        del round_

    def can_train_round(self) -> bool:
        """Whether one more round stays within the epsilon budget (if there is one)."""
        return self.budget is None or self.epsilon_after_next_round() <= self.budget

    def train_round(self, global_params: np.ndarray) -> np.ndarray:
        """Train locally from ``global_params``; return the update (new - old).

        Raises
        ------
        PrivacyBudgetExceededError
            If the round would exceed the epsilon budget.
        """
        if not self.can_train_round():
            raise PrivacyBudgetExceededError(
                f"one more round would spend epsilon {self.epsilon_after_next_round():.3f} "
                f"> budget {self.budget}"
            )
        load_flat(self.model, global_params)
        self._train_locally()
        update: np.ndarray = flatten_model(self.model) - global_params
        return self._release(update)

    def _release(self, update: np.ndarray) -> np.ndarray:
        """What leaves the client of a trained update (by default, the update itself)."""
        return update


class DPTrainer(Trainer):
    """DP-SGD (Abadi et al. 2016) on one client's data, via Opacus: example-level DP.

    Parameters
    ----------
    model
        An Opacus-compatible module (no BatchNorm).
    data
        The client's private training data.
    training, privacy
        Hyperparameters; ``training.rounds * training.local_epochs`` is the horizon the noise
        is calibrated for when ``privacy.target_epsilon`` is set.
    seed
        Seeds the data order and the DP noise (not cryptographically secure; Opacus's
        ``secure_mode`` is off).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        data: Dataset,
        *,
        training: TrainingConfig,
        privacy: PrivacyConfig,
        seed: int = 0,
    ) -> None:
        torch.manual_seed(seed)
        self.model = model
        self.privacy = privacy
        self.num_examples = len(data.y)
        self._epochs = training.local_epochs
        loader = _loader(data, training.batch_size, seed, shuffle=False)
        # Opacus's Poisson loader samples each example at rate 1 / len(loader) but draws
        # int(1 / (1 / len(loader))) batches per epoch, which floating point makes one fewer
        # for some lengths (93, 99, ...); its accountant records 1 / (batches per epoch) per
        # step (a conservative rate). Calibrate for exactly what the accountant will record.
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
        optimizer = torch.optim.SGD(model.parameters(), lr=training.lr, momentum=training.momentum)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # secure_mode=False and RNG warnings
            self.engine = PrivacyEngine(accountant=privacy.accountant)
            self.module, self.optimizer, self.loader = self.engine.make_private(
                module=model,
                optimizer=optimizer,
                data_loader=loader,
                noise_multiplier=sigma,
                max_grad_norm=privacy.max_grad_norm,
                poisson_sampling=True,
            )
        if len(self.loader) != steps_per_epoch:  # calibrated for a different step count
            raise RuntimeError(f"Opacus draws {len(self.loader)} batches, not {steps_per_epoch}")
        self.noise_multiplier = float(self.optimizer.noise_multiplier)
        self.budget = privacy.target_epsilon
        _log.info(
            "DP-SGD: %d examples, sample rate %.4f, noise multiplier %.3f",
            self.num_examples,
            self.sample_rate,
            self.noise_multiplier,
        )

    @property
    def steps_per_round(self) -> int:
        """Optimizer steps one round takes (each is one Poisson-sampled batch)."""
        return self._epochs * len(self.loader)

    def epsilon(self) -> float:
        """Epsilon spent so far (at ``privacy.delta``), over the whole run."""
        return self._epsilon_of(list(self.engine.accountant.history))

    def epsilon_after_next_round(self) -> float:
        """Epsilon the client would have spent after one more round."""
        step = (self.noise_multiplier, self.sample_rate, self.steps_per_round)
        history = list(self.engine.accountant.history)
        if history and history[-1][:2] == step[:2]:
            # Opacus merges consecutive steps with the same noise and sample rate.
            history[-1] = (*step[:2], history[-1][2] + step[2])
        else:
            history.append(step)
        return self._epsilon_of(history)

    def _epsilon_of(self, history: list[tuple[float, float, int]]) -> float:
        return epsilon_of_history(history, self.privacy.delta, self.privacy.accountant)

    def _train_locally(self) -> None:
        self.module.train()
        loss_fn = torch.nn.CrossEntropyLoss()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook")
            for _ in range(self._epochs):
                for x, y in self.loader:
                    self.optimizer.zero_grad()
                    loss = loss_fn(self.module(x), y) if len(y) else self.module(x).sum() * 0.0
                    loss.backward()
                    self.optimizer.step()
        self.optimizer.zero_grad()


class ClientLevelTrainer(Trainer):
    """DP-FedAvg (McMahan et al. 2018, "Learning Differentially Private Recurrent Language
    Models"): client-level DP with distributed Gaussian noise.

    The client trains with plain SGD, clips its whole update to L2 norm ``privacy.clip_norm``
    (C) and adds Gaussian noise of std ``sigma * C / sqrt(n)`` per coordinate, where n is the
    cohort size (``training.cohort_size``, or ``training.clients`` when that is 0: the task
    does not carry the realised cohort). The sum of n such updates carries noise of std
    ``sigma * C``, the Gaussian mechanism on a sum whose sensitivity to one client is C. This
    relies on at least n honest clients adding their share: a round that sums m < n honest
    updates carries only ``sqrt(m / n)`` of the noise the accountant assumes. The edge client
    weighs every update 1.0 (a weight by example count would also scale the noise down).

    Accounting: one sampled Gaussian mechanism per global round, at sample rate
    ``q = n / training.clients``; sigma is calibrated for ``training.rounds`` rounds. The
    epsilon after global round r is the accountant's value for ``(sigma, q, r)``: every round
    counts, whether or not this client was in its cohort, which the amplification by sampling
    needs.

    Parameters
    ----------
    model
        The model (any module; no per-sample gradients are needed).
    data
        The client's private training data.
    training, privacy
        Hyperparameters; ``training.mode`` must be ``"sync"``.
    seed
        Seeds the data order only. The noise comes from the operating system's entropy, so
        nobody who knows the configuration can subtract it from the update.

    Raises
    ------
    ConfigError
        In asynchronous mode (no cohorts), or for an unknown accountant.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        data: Dataset,
        *,
        training: TrainingConfig,
        privacy: PrivacyConfig,
        seed: int = 0,
    ) -> None:
        if training.mode != "sync":
            raise ConfigError("privacy.level = 'client' needs training.mode = 'sync' (cohorts)")
        self.model = model
        self.privacy = privacy
        self.num_examples = len(data.y)
        self.cohort_size = min(training.cohort_size or training.clients, training.clients)
        self.sample_rate = self.cohort_size / training.clients
        self.clip_norm = privacy.clip_norm
        if privacy.target_epsilon is not None:
            self.noise_multiplier = calibrate_noise(
                privacy.target_epsilon,
                privacy.delta,
                self.sample_rate,
                training.rounds,
                privacy.accountant,
            )
        else:
            assert privacy.noise_multiplier is not None
            self.noise_multiplier = privacy.noise_multiplier
        self.noise_std = self.noise_multiplier * self.clip_norm / math.sqrt(self.cohort_size)
        self.budget = privacy.target_epsilon
        self._epochs = training.local_epochs
        self._loader = _loader(data, training.batch_size, seed, shuffle=True)
        self._optimizer = torch.optim.SGD(
            model.parameters(), lr=training.lr, momentum=training.momentum
        )
        self._rng = np.random.default_rng()  # seeded from OS entropy, never from the config
        self._round = 0  # the global round announced by set_round
        self._rounds_spent = 0  # global rounds accounted for
        if training.min_quorum < self.cohort_size:
            _log.warning(
                "client-level DP: each client adds 1/%d of the noise; a round that closes with "
                "fewer updates (min_quorum %d) carries less noise than accounted",
                self.cohort_size,
                training.min_quorum,
            )
        _log.info(
            "DP-FedAvg: clip %.3g, noise multiplier %.3f, cohort %d, sample rate %.4f",
            self.clip_norm,
            self.noise_multiplier,
            self.cohort_size,
            self.sample_rate,
        )

    def set_round(self, round_: int) -> None:
        """Record the global round the next :meth:`train_round` belongs to."""
        self._round = round_

    def _next_rounds_spent(self) -> int:
        # At least one more round, even if the same round number is trained twice.
        return max(self._round, self._rounds_spent + 1)

    def epsilon(self) -> float:
        """Client-level epsilon spent so far: every global round up to the last one trained."""
        return self._epsilon_after(self._rounds_spent)

    def epsilon_after_next_round(self) -> float:
        """Client-level epsilon after the round announced by :meth:`set_round`."""
        return self._epsilon_after(self._next_rounds_spent())

    def _epsilon_after(self, rounds: int) -> float:
        p = self.privacy
        return epsilon(self.noise_multiplier, self.sample_rate, rounds, p.delta, p.accountant)

    def clip(self, update: np.ndarray) -> np.ndarray:
        """Scale ``update`` down to L2 norm at most ``clip_norm``."""
        norm = float(np.linalg.norm(update))
        clipped: np.ndarray = update * min(1.0, self.clip_norm / norm) if norm > 0 else update
        return clipped

    def add_noise(self, update: np.ndarray) -> np.ndarray:
        """Add this client's share of the noise: N(0, (sigma * C)^2 / n) per coordinate."""
        noised: np.ndarray = update + self._rng.normal(0.0, self.noise_std, size=update.shape)
        return noised

    def _train_locally(self) -> None:
        self.model.train()
        loss_fn = torch.nn.CrossEntropyLoss()
        for _ in range(self._epochs):
            for x, y in self._loader:
                self._optimizer.zero_grad()
                loss_fn(self.model(x), y).backward()
                self._optimizer.step()
        self._optimizer.zero_grad()

    def _release(self, update: np.ndarray) -> np.ndarray:
        """Clip and noise the update, and account for the round."""
        released = self.add_noise(self.clip(update))
        self._rounds_spent = self._next_rounds_spent()
        return released


_TRAINERS: dict[str, type[DPTrainer] | type[ClientLevelTrainer]] = {
    "client": ClientLevelTrainer,
    "example": DPTrainer,
}


def create_trainer(
    model: torch.nn.Module,
    data: Dataset,
    *,
    training: TrainingConfig,
    privacy: PrivacyConfig,
    seed: int = 0,
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
    return cls(model, data, training=training, privacy=privacy, seed=seed)
