"""Error feedback for sparsified updates: what a round did not send joins the next round's.

With shared random-k sparsification (:mod:`fedps.sharding.sparse_mask`) a client sends only the
coordinates its round's mask picks. With ``compression.error_feedback`` it keeps the rest of
the update, its residual, and adds it to its next update before that one is masked (Stich et
al., "Sparsified SGD with Memory", NeurIPS 2018), so no coordinate's change is lost, only
delayed. The residual is made of updates that were already noised by DP-SGD: keeping and
adding it is post-processing and changes no privacy accounting (docs/privacy.md).

The residual is the client's state: kept in its state folder (``residual.bin``, written
atomically and checked, as other state files), so a restarted client goes on with it. A
residual of another size (another model) is dropped with a warning.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from crypto.files import read_checked, write_checked
from fedps.config import CompressionConfig

__all__ = ["RESIDUAL_FILE", "ErrorFeedback"]

_log = logging.getLogger("fedps")
RESIDUAL_FILE = "residual.bin"


class ErrorFeedback:
    """A client's residual: the part of its updates not sent yet.

    Parameters
    ----------
    num_params
        The model's size.
    directory
        The client's state folder (None: the residual lives in memory only).
    """

    def __init__(self, num_params: int, directory: Path | None = None) -> None:
        self.path = None if directory is None else directory / RESIDUAL_FILE
        self.residual = np.zeros(num_params, dtype=np.float64)
        saved = self._load()
        if saved is not None:
            self.residual = saved

    @classmethod
    def configured(
        cls, compression: CompressionConfig, num_params: int, directory: Path | None
    ) -> ErrorFeedback | None:
        """The residual a client keeps under ``compression`` (None: no error feedback)."""
        if compression.enabled and compression.error_feedback:
            return cls(num_params, directory)
        return None

    def _load(self) -> np.ndarray | None:
        """The residual saved in the state folder (None: none, or of another model)."""
        if self.path is None:
            return None
        data = read_checked(
            self.path, what="the error-feedback residual", hint="delete it to start from zero"
        )
        if data is None:
            return None
        saved = np.frombuffer(data, dtype="<f8").astype(np.float64)
        if saved.shape != self.residual.shape:
            _log.warning(
                "%s holds %d values, the model has %d; starting from zero",
                self.path,
                saved.size,
                self.residual.size,
            )
            return None
        return saved

    def add(self, update: np.ndarray) -> np.ndarray:
        """``update`` with the residual added (a new array)."""
        return update + self.residual

    def keep(self, total: np.ndarray, sent: np.ndarray) -> None:
        """Keep what of ``total`` was not sent (``sent``: the coordinates sent), durably.

        Parameters
        ----------
        total
            The update that was masked (the residual added).
        sent
            The coordinates sent (:meth:`fedps.sharding.sparse_mask.SparseMask.indices`).
        """
        residual = np.array(total, dtype=np.float64)
        residual[sent] = 0.0
        if self.path is not None:
            write_checked(self.path, residual.astype("<f8").tobytes())
        self.residual = residual
