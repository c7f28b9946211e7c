"""Local DP-SGD training with one privacy accountant for the whole run.

Opacus's ``PrivacyEngine.make_private`` is called once per client, at the start of the run:
the model, optimizer and Poisson-sampled data loader are wrapped once and reused every round,
so the accountant accumulates every step the client ever takes (a new engine per round would
reset epsilon). With a target epsilon the noise multiplier is calibrated for the whole run
(``rounds x local_epochs`` epochs at the client's own sampling rate), and the client refuses a
round that would take it past that budget.
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import torch
from opacus import PrivacyEngine
from opacus.accountants import create_accountant
from torch.utils.data import DataLoader, TensorDataset

from fedps.blocks import flatten_model, load_flat
from fedps.config import PrivacyConfig, TrainingConfig
from fedps.datasets import Dataset
from fedps.errors import PrivacyBudgetExceededError

__all__ = ["DPTrainer"]

_log = logging.getLogger("fedps")


class DPTrainer:
    """DP-SGD (Abadi et al. 2016) on one client's data, via Opacus.

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
        dataset = TensorDataset(torch.from_numpy(data.x), torch.from_numpy(data.y))
        batch_size = min(training.batch_size, self.num_examples)
        loader = DataLoader(
            dataset, batch_size=batch_size, generator=torch.Generator().manual_seed(seed)
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=training.lr)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # secure_mode=False and RNG warnings
            self.engine = PrivacyEngine(accountant=privacy.accountant)
            if privacy.target_epsilon is not None:
                self.module, self.optimizer, self.loader = self.engine.make_private_with_epsilon(
                    module=model,
                    optimizer=optimizer,
                    data_loader=loader,
                    target_epsilon=privacy.target_epsilon,
                    target_delta=privacy.delta,
                    epochs=training.rounds * training.local_epochs,
                    max_grad_norm=privacy.max_grad_norm,
                    poisson_sampling=True,
                )
            else:
                assert privacy.noise_multiplier is not None
                self.module, self.optimizer, self.loader = self.engine.make_private(
                    module=model,
                    optimizer=optimizer,
                    data_loader=loader,
                    noise_multiplier=privacy.noise_multiplier,
                    max_grad_norm=privacy.max_grad_norm,
                    poisson_sampling=True,
                )
        self.noise_multiplier = float(self.optimizer.noise_multiplier)
        self.sample_rate = 1.0 / len(self.loader)
        self.budget = privacy.target_epsilon
        self._epsilon_cache: dict[tuple[tuple[float, float, int], ...], float] = {}
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
        """Epsilon of an accountant history; cached, the RDP computation is slow."""
        if not history:
            return 0.0
        key = tuple(history)
        if key not in self._epsilon_cache:
            accountant = create_accountant(mechanism=self.privacy.accountant)
            accountant.history = list(history)
            self._epsilon_cache = {key: float(accountant.get_epsilon(delta=self.privacy.delta))}
        return self._epsilon_cache[key]

    def can_train_round(self) -> bool:
        """Whether one more round stays within the epsilon budget (if there is one)."""
        return self.budget is None or self.epsilon_after_next_round() <= self.budget + 1e-9

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
        self.module.train()
        loss_fn = torch.nn.CrossEntropyLoss()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook")
            self._epochs_loop(loss_fn)
        self.optimizer.zero_grad()
        delta: np.ndarray = flatten_model(self.model) - global_params
        return delta

    def _epochs_loop(self, loss_fn: torch.nn.Module) -> None:
        for _ in range(self._epochs):
            for x, y in self.loader:
                self.optimizer.zero_grad()
                loss = loss_fn(self.module(x), y) if len(y) else self.module(x).sum() * 0.0
                loss.backward()
                self.optimizer.step()
