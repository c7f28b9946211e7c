"""The dashboard's runs, kept as one JSON record per run in its state folder.

A record is what the page shows of a run, live or long finished: its settings, its status
(:data:`STATUSES`), when it started and ended, and the coordinator's view of its progress
(rounds with their accuracy and epsilon, clients with their epsilon and participation). The
launcher writes the life cycle of the runs it starts, the status collector the progress of the
run it follows; both through :meth:`RunStore.update`, which merges and writes the record only
when it changed. Each record is ``FOLDER/ID.json``, mode 0600 in a 0700 folder, replaced
atomically (:func:`crypto.files.write_atomic`): a crash leaves the previous record whole.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from pathlib import Path
from typing import Any

from crypto.files import private_directory, write_atomic
from fedps.config import FedPSConfig

__all__ = ["FINAL", "STATUSES", "RunStore", "settings_view"]

_log = logging.getLogger("fedps")

#: A run's statuses: the first two while it runs, the others once it has ended
#: (``interrupted``: the dashboard stopped, or was killed, while it ran).
STATUSES = ("starting", "training", "finished", "stopped", "failed", "interrupted")
#: The statuses of a run that has ended.
FINAL = frozenset(STATUSES[2:])

#: What a run id may be: it names a file.
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: The name of the model a run exported (``torch.save`` of its ``state_dict``), in its state folder.
MODEL_FILE = "model.pt"


def settings_view(config: FedPSConfig) -> dict[str, Any]:
    """The settings a run is compared by (the form's, with the privacy budget)."""
    training, privacy = config.training, config.privacy
    return {
        "rounds": training.rounds,
        "clients": training.clients,
        "mode": training.mode,
        "lr": training.lr,
        "batch_size": training.batch_size,
        "local_epochs": training.local_epochs,
        "target_epsilon": privacy.target_epsilon,
        "noise_multiplier": privacy.noise_multiplier,
        "delta": privacy.delta,
        "max_grad_norm": privacy.max_grad_norm,
    }


def _summary(record: dict[str, Any]) -> dict[str, Any]:
    """One line of the run list: the record without its rounds and clients."""
    run = record.get("run") or {}
    evaluated = [r for r in run.get("history", ()) if r.get("accuracy") is not None]
    keep = ("id", "run_id", "status", "error", "started_unix", "ended_unix", "settings")
    return {
        **{k: record.get(k) for k in keep},
        "round": run.get("round", 0),
        "accuracy": evaluated[-1]["accuracy"] if evaluated else None,
        "max_epsilon": run.get("max_epsilon"),
    }


class RunStore:
    """Every run of a dashboard's state folder, one JSON record each (see the module).

    Use :meth:`open`, which creates the folder and reads the records there.

    Parameters
    ----------
    folder
        Where the records are (``ID.json``).
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._lock = threading.Lock()
        self._records: dict[str, dict[str, Any]] = {}
        self._serial = 0

    @classmethod
    def open(cls, folder: Path) -> RunStore:
        """The store of ``folder`` (created 0700), with the records found there.

        A run that had not ended when its dashboard stopped is ``interrupted``; a record that
        does not read is left out with a WARNING naming it.

        Raises
        ------
        OSError
            The folder cannot be created.
        """
        store = cls(private_directory(folder))
        for path in sorted(folder.glob("*.json")):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                _log.warning("dashboard: the run record %s does not read (%s); left out", path, exc)
                continue
            if not isinstance(record, dict) or record.get("id") != path.stem:
                _log.warning("dashboard: %s is not a run record; left out", path)
                continue
            store._records[path.stem] = record
            if record.get("status") not in FINAL:
                store.update(path.stem, status="interrupted")
        return store

    @staticmethod
    def check_id(run_id: str) -> str:
        """``run_id`` if it may name a run (letters, digits, ``_`` and ``-``; up to 64).

        Raises
        ------
        ValueError
            It may not.
        """
        if not _ID.fullmatch(run_id):
            raise ValueError(f"{run_id!r} is not a run id (letters, digits, _ and -; up to 64)")
        return run_id

    @property
    def serial(self) -> int:
        """A number that changes whenever a record does."""
        with self._lock:
            return self._serial

    def get(self, run_id: str) -> dict[str, Any] | None:
        """The record of ``run_id`` (a copy), or ``None``."""
        with self._lock:
            record = self._records.get(run_id)
            return None if record is None else json.loads(json.dumps(record))

    def summaries(self) -> list[dict[str, Any]]:
        """One line per run, the latest started first (:func:`_summary`), with its ``files``."""
        with self._lock:
            records = sorted(
                self._records.values(), key=lambda r: (r.get("started_unix") or 0, r["id"])
            )
            lines = [_summary(r) for r in reversed(records)]
        return [{**line, "files": self.files(line["id"])} for line in lines]

    def update(self, run_id: str, /, **fields: Any) -> dict[str, Any]:
        """Merge ``fields`` into the record of ``run_id`` (created if new) and write it.

        Nothing is written when nothing changed. Returns the record (a copy). ``run_id`` names
        the record; a field ``run_id`` is the coordinator's id of the run.

        Raises
        ------
        ValueError
            ``run_id`` may not name a run, or a status is not one of :data:`STATUSES`.
        OSError
            The record cannot be written (the one in memory is unchanged).
        """
        return self._merge(run_id, fields, {})

    def progress(
        self, run_id: str, status: str, ended: dict[str, Any], /, **fields: Any
    ) -> dict[str, Any]:
        """As :meth:`update`, and ``status`` with ``ended`` only while the run has not ended.

        The collector's progress never overwrites the end the launcher wrote (``stopped``),
        even when both write at once. Errors as :meth:`update`.
        """
        return self._merge(run_id, fields, {"status": status, **ended})

    def _merge(
        self, run_id: str, fields: dict[str, Any], unless_ended: dict[str, Any]
    ) -> dict[str, Any]:
        self.check_id(run_id)
        for status in (fields.get("status"), unless_ended.get("status")):
            if status is not None and status not in STATUSES:
                raise ValueError(f"{status!r} is not a run status")
        with self._lock:
            old = self._records.get(run_id) or {"id": run_id, "started_unix": time.time()}
            new = {**old, **fields, "id": run_id}
            if new.get("status") not in FINAL:
                new.update(unless_ended)
            if new != old or run_id not in self._records:
                data = json.dumps(new, sort_keys=True, indent=1).encode()
                write_atomic(self.folder / f"{run_id}.json", data)
                self._records[run_id] = new
                self._serial += 1
            copy: dict[str, Any] = json.loads(json.dumps(new))
            return copy

    def files(self, run_id: str) -> dict[str, Any]:
        """What of run ``run_id`` can be downloaded: ``{"model": bool, "logs": [names]}``."""
        state_dir = self._state_dir(run_id)
        if state_dir is None:
            return {"model": False, "logs": []}
        logs = state_dir / "logs"
        names = sorted(p.name for p in logs.glob("*.log") if p.is_file()) if logs.is_dir() else []
        return {"model": (state_dir / MODEL_FILE).is_file(), "logs": names}

    def model_path(self, run_id: str) -> Path | None:
        """The model run ``run_id`` exported, if there is one."""
        state_dir = self._state_dir(run_id)
        model = None if state_dir is None else state_dir / MODEL_FILE
        return model if model is not None and model.is_file() else None

    def log_path(self, run_id: str, name: str) -> Path | None:
        """The log ``name`` of run ``run_id``, if it has one of that name (never another file)."""
        state_dir = self._state_dir(run_id)
        if state_dir is None or name not in self.files(run_id)["logs"]:
            return None
        return state_dir / "logs" / name

    def _state_dir(self, run_id: str) -> Path | None:
        with self._lock:
            folder = (self._records.get(run_id) or {}).get("state_dir")
        return Path(folder) if folder else None
