"""Clients that train nothing: many real edge clients in one process, replaying one update.

For measurements at scale (``fedps bench --scale``): a machine that cannot train 100 models
at once can still run 100 clients through the real protocol. Each is a real
:class:`~clients.edge_client.EdgeClient` on a thread of its own, under its own certificate
(:func:`crypto.tls.thread_tls`): it registers, pulls and verifies the model, records and
announces its spend, weights, clips, encrypts and commits its update
(:class:`~clients.update_pipeline.UpdatePipeline`), pushes real ciphertexts to the shards and
reports, and draws its encryptions of zero for the next round in its own worker process.
Only the training is replaced: the :class:`ReplayedUpdate` mod returns one synthetic update
instead of calling the trainer, so the clients' CPU is the protocol's and the encryption's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import numpy as np

from clients.edge_client import EdgeClient
from clients.round_progress import ClientSummary
from clients.train_step import TrainFn, TrainStep
from crypto.tls import TlsIdentity, thread_tls
from fedps.config import FedPSConfig
from fedps.errors import FedPSError

__all__ = ["ReplayedUpdate", "run_replaying_clients"]

_log = logging.getLogger("fedps")


class ReplayedUpdate:
    """A mod (:data:`clients.train_step.TrainMod`) that trains nothing: one update, every round.

    The update is synthetic and DP-scaled: Gaussian, seeded, with the per-coordinate standard
    deviation of DP-SGD's noise in one local step, ``lr * noise_multiplier * clip_norm /
    batch_size``, the part that dominates a DP update of a wide model. It is a payload of the
    right size and magnitude for measurements, not privacy noise (it is regenerated from
    ``seed``): the client's own DP noise is never drawn, since the trainer never runs. Drawn
    once, at the first round, with the model's size; every client holding this mod sends
    it (their ciphertexts differ all the same: encryption is randomised).

    Parameters
    ----------
    std
        The standard deviation of every coordinate.
    seed
        Seeds the draw.
    """

    def __init__(self, *, std: float, seed: int = 0) -> None:
        self.std = std
        self.seed = seed
        self._update: np.ndarray | None = None
        self._lock = threading.Lock()

    @classmethod
    def dp_scaled(cls, config: FedPSConfig, *, seed: int = 0) -> ReplayedUpdate:
        """The update of one DP-SGD step under ``config`` (see the class).

        Its noise multiplier is ``privacy.noise_multiplier`` (1.0 when the noise is calibrated
        from a target epsilon instead).
        """
        privacy, training = config.privacy, config.training
        sigma = privacy.noise_multiplier if privacy.noise_multiplier is not None else 1.0
        std = training.lr * sigma * privacy.max_grad_norm / training.batch_size
        return cls(std=std, seed=seed)

    def __call__(self, step: TrainStep, params: np.ndarray, call_next: TrainFn) -> np.ndarray:
        """The update, the size of ``params``; ``call_next`` (the trainer) is never called."""
        with self._lock:
            if self._update is None or self._update.size != params.size:
                rng = np.random.default_rng(self.seed)
                self._update = rng.normal(0.0, self.std, params.size).astype(np.float32)
            return self._update


def run_replaying_clients(
    config: FedPSConfig, indices: Sequence[int], *, timeout_s: float = 3600.0
) -> list[ClientSummary]:
    """Run clients ``indices`` until training is done, each on its own thread.

    Each is ``client-INDEX`` with its own certificate (its identity under mutual TLS) or
    enrolment token, and one :class:`ReplayedUpdate` (:meth:`ReplayedUpdate.dp_scaled`) is
    shared by all.

    Parameters
    ----------
    config
        The cluster configuration.
    indices
        The clients' numbers.
    timeout_s
        Bounds each client's run.

    Returns
    -------
    list[ClientSummary]
        What each client did, in the order of ``indices``.

    Raises
    ------
    FedPSError
        A client failed (the first failure, once every thread ended); the others ran on.
    """
    replay = ReplayedUpdate.dp_scaled(config, seed=config.training.seed)
    summaries: dict[int, ClientSummary] = {}
    failures: list[BaseException] = []

    def one(index: int) -> None:
        try:
            summaries[index] = _replaying_client(config, index, replay, timeout_s)
        except BaseException as exc:  # reported after every thread ended
            _log.error("client-%d failed: %s", index, exc)
            failures.append(exc)

    threads = [threading.Thread(target=one, args=(i,), name=f"client-{i}") for i in indices]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise FedPSError(f"{len(failures)} of {len(threads)} clients failed") from failures[0]
    return [summaries[i] for i in indices]


def _replaying_client(
    config: FedPSConfig, index: int, replay: ReplayedUpdate, timeout_s: float
) -> ClientSummary:
    """Open client ``index`` and run it, its channels under its own certificate."""
    tls = config.tls
    if not tls.enabled:
        return _open_and_run(config, index, replay, timeout_s)
    with thread_tls(TlsIdentity.load(tls.directory, f"client-{index}")):
        return _open_and_run(config, index, replay, timeout_s)


def _open_and_run(
    config: FedPSConfig, index: int, replay: ReplayedUpdate, timeout_s: float
) -> ClientSummary:
    client = EdgeClient.open(config, index=index, mods=[replay])
    try:
        return client.run(timeout_s=timeout_s)
    finally:
        client.close()
