"""The coordinator's checkpoint: the last model it pulled and its state, in one file.

The file is an ``.npz`` with two arrays: ``model`` (the flat parameter vector) and ``meta``
(the state as UTF-8 JSON). It is replaced atomically (:func:`crypto.files.write_atomic`):
a crash at any moment leaves the previous checkpoint or the new one, never a mix.
"""

from __future__ import annotations

import io
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from crypto.files import write_atomic
from fedps.errors import FedPSError

__all__ = ["CHECKPOINT_FILE", "Checkpoint", "CheckpointStore"]

#: The checkpoint's file name in the coordinator's state folder.
CHECKPOINT_FILE = "coordinator-checkpoint.npz"


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
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / CHECKPOINT_FILE

    def save(self, model: np.ndarray, state: dict[str, Any]) -> None:
        """Replace the checkpoint with ``model`` and ``state`` (JSON-ready), atomically."""
        buffer = io.BytesIO()
        meta = np.frombuffer(json.dumps(state).encode(), dtype=np.uint8)
        np.savez(buffer, model=model, meta=meta)
        write_atomic(self.path, buffer.getvalue())

    def load(self) -> Checkpoint | None:
        """The saved checkpoint, or None when there is none.

        Raises
        ------
        FedPSError
            If the file exists but cannot be read (truncated, not a checkpoint, bad JSON):
            a coordinator that silently started over would repeat rounds.
        """
        if not self.path.exists():
            return None
        try:
            with np.load(self.path) as data:
                state = json.loads(bytes(data["meta"]).decode())
                model = np.asarray(data["model"])
        except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as exc:
            raise FedPSError(
                f"checkpoint {self.path} cannot be read ({exc}); restore it from a backup, "
                "or move it away to start the run over"
            ) from exc
        if not isinstance(state, dict):
            raise FedPSError(f"checkpoint {self.path} holds no coordinator state")
        return Checkpoint(model=model, state=state, saved_at=self.path.stat().st_mtime)
