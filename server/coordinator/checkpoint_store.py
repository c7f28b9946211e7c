"""The coordinator's checkpoint: the last model it pulled and its state, in one file.

The file is an ``.npz`` with two arrays: ``model`` (the flat parameter vector) and ``meta``
(the state as UTF-8 JSON), kept as a checked state file (:func:`crypto.files.write_checked`):
replaced atomically, so a crash at any moment leaves the previous checkpoint or the new one,
never a mix, and verified against its SHA-256 at load, so a damaged checkpoint stops the
coordinator (:class:`~fedps.errors.CorruptStateError`) instead of resuming from it. A
checkpoint written before the checked format is loaded once unchecked and rewritten at the
next save. A write that fails (a full disk) is retried until it succeeds
(:meth:`CheckpointStore.save_until_written`): the round waits for its checkpoint.
"""

from __future__ import annotations

import io
import json
import logging
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from crypto.files import private_directory, read_checked, write_checked
from fedps.errors import CorruptStateError, FedPSError
from fedps.storage.write_retry import write_until_written

__all__ = ["CHECKPOINT_FILE", "Checkpoint", "CheckpointStore"]

_log = logging.getLogger("fedps")

#: The checkpoint's file name in the coordinator's state folder.
CHECKPOINT_FILE = "coordinator-checkpoint.npz"

_HINT = (
    "restore it from a backup, or move it aside to start the run over (the key holder keeps "
    "the model)"
)


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint."""

    model: np.ndarray
    state: dict[str, Any]  # the JSON state, as :meth:`CheckpointStore.save` was given it
    saved_at: float  # the file's modification time (Unix seconds)


class CheckpointStore:
    """Saves and loads the coordinator's checkpoint in ``directory`` (created if absent).

    Parameters
    ----------
    directory
        The coordinator's state folder.
    """

    def __init__(self, directory: Path) -> None:
        private_directory(directory)
        self.path = directory / CHECKPOINT_FILE

    def save(self, model: np.ndarray, state: dict[str, Any]) -> None:
        """Replace the checkpoint with ``model`` and ``state`` (JSON-ready), atomically."""
        buffer = io.BytesIO()
        meta = np.frombuffer(json.dumps(state).encode(), dtype=np.uint8)
        np.savez(buffer, model=model, meta=meta)
        write_checked(self.path, buffer.getbuffer())

    def save_until_written(
        self, model: np.ndarray, state: dict[str, Any], *, stop: threading.Event
    ) -> bool:
        """:meth:`save`, retried with a growing delay (up to 30 s) while the write fails.

        A full disk, for example. False when ``stop`` was set first.
        """
        return write_until_written(
            lambda: self.save(model, state),
            retry_on=OSError,
            failure=lambda exc: (
                f"cannot write the checkpoint {self.path} ({getattr(exc, 'strerror', None) or exc})"
            ),
            stop=stop,
        )

    def load(self, *, num_params: int | None = None) -> Checkpoint | None:
        """The saved checkpoint, or None when there is none.

        ``num_params``: the size of the model it must hold.

        Raises
        ------
        CorruptStateError
            If the file exists but cannot be read (truncated, checksum mismatch, not a
            checkpoint, bad JSON): a coordinator that silently started over would repeat
            rounds.
        FedPSError
            If it holds a model of another size than ``num_params``.
        """
        what = "the coordinator checkpoint"
        raw = read_checked(self.path, what=what, hint=_HINT, legacy_prefix=b"PK\x03\x04")
        if raw is None:
            return None
        try:
            with np.load(io.BytesIO(raw)) as data:
                state = json.loads(bytes(data["meta"]).decode())
                model = np.asarray(data["model"])
        except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as exc:
            raise CorruptStateError(f"{self.path}: {what} cannot be read ({exc}); {_HINT}") from exc
        if not isinstance(state, dict):
            raise CorruptStateError(f"{self.path}: {what} holds no coordinator state; {_HINT}")
        if num_params is not None and model.shape != (num_params,):
            raise FedPSError(
                f"checkpoint {self.path} is for another model ({model.size} parameters, the "
                f"task's model has {num_params}): give another cluster.state_dir, or delete "
                "this one, to start a new run"
            )
        return Checkpoint(model=model, state=state, saved_at=self.path.stat().st_mtime)
