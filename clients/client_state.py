"""A client's state that outlives its process: identity, signing key and privacy ledger.

A client's privacy budget belongs to its data, not to its process. :class:`ClientState` keeps
one folder per identity (``<cluster.state_dir>/clients/<identity>`` by default, see
:func:`default_state_dir`; ``fedps client --state-dir`` chooses another):

``ledger.json``
    The identity the folder belongs to (``tls.name`` or ``client-INDEX``, the client id the
    coordinator gives it), and one privacy spend per data source, keyed by the SHA-256
    fingerprint of the training data (:func:`data_fingerprint`: features and labels, with
    their dtypes and shapes) and the privacy level (``"example"`` or ``"client"``): the
    accountant's history of ``(noise multiplier, sample rate, steps)``, its epsilon at the
    delta and accountant it was recorded with, and (client level) the run whose global rounds
    the last entry counts. The file carries a SHA-256 checksum of its content and is
    rewritten atomically (:func:`crypto.files.write_atomic`) at every record.
``signing.key``
    The Ed25519 key the client signs its updates with (mode 0600): a restarted client's
    commitments are still its own. ``signing.key.sha256`` beside it tells a damaged key
    (:func:`crypto.files.check_key`).
``lock``
    Held (``flock``) while a client uses the folder: two processes on one ledger would each
    spend budget the other does not see.

The session credential the coordinator issues at registration is not kept: a restarted client
registers again (proving its identity with its certificate or enrolment token, in
``tls.directory``) and gets a new one.

The edge client records the spend a round *will* have made before it trains the round
(:meth:`clients.dp_trainer.Trainer.spend_after_next_round`), so a client killed at any moment
never reports less than it spent: at worst, killed between the record and the training, one
round more. A ledger that does not parse, fails its checksum or belongs to another identity is
a :class:`~fedps.errors.ConfigError` naming the file; a folder whose ledger is gone while its
signing key is still there is refused too. The budget is never silently reset.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from clients.dp_trainer import History, PrivacySpend
from crypto.files import private_directory, private_opener, write_atomic
from crypto.signing import BlockSigner
from fedps.config import FedPSConfig, PrivacyConfig
from fedps.errors import ConfigError
from fedps.learning.datasets import Dataset

__all__ = ["ClientState", "LedgerEntry", "data_fingerprint", "default_state_dir"]

_log = logging.getLogger("fedps")

LEDGER_FILE = "ledger.json"
SIGNING_KEY_FILE = "signing.key"
LOCK_FILE = "lock"
_FORMAT = "fedps-client-ledger/1"


def default_state_dir(config: FedPSConfig, identity: str) -> Path:
    """Where client ``identity`` keeps its state unless told otherwise."""
    return config.cluster.state_dir / "clients" / identity


def data_fingerprint(data: Dataset) -> str:
    """SHA-256 (hex) of a training set: its features and labels, with dtypes and shapes."""
    digest = hashlib.sha256(b"fedps-data-v1")
    for array in (data.x, data.y):
        a = np.ascontiguousarray(array)
        header = f"{a.dtype.str}{a.shape}".encode()
        digest.update(len(header).to_bytes(4, "little") + header)
        digest.update(a.data.cast("B"))
    return digest.hexdigest()


class LedgerEntry(BaseModel):
    """The privacy spent on one data source at one privacy level."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data: str  # data_fingerprint of the training data
    level: Literal["example", "client"]
    history: History
    epsilon: float  # of history, at delta under accountant, when recorded (inf: no bound)
    delta: float
    accountant: str
    run_id: str = ""
    updated_unix: float = 0.0

    @field_validator("data")
    @classmethod
    def _check_data(cls, value: str) -> str:
        if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
            raise ValueError("not a SHA-256 fingerprint")
        return value

    @field_validator("history")
    @classmethod
    def _check_history(cls, value: History) -> History:
        for sigma, rate, steps in value:
            if not (math.isfinite(sigma) and sigma >= 0 and 0 < rate <= 1 and steps >= 1):
                raise ValueError(f"invalid accountant entry {(sigma, rate, steps)}")
        return value

    @field_validator("epsilon")
    @classmethod
    def _check_epsilon(cls, value: float) -> float:
        if math.isnan(value) or value < 0:
            raise ValueError("epsilon must be >= 0")
        return value

    @property
    def spend(self) -> PrivacySpend:
        """The spend to restore a trainer from."""
        return PrivacySpend(self.history, self.epsilon, self.run_id)


class _LedgerFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["fedps-client-ledger/1"]
    identity: str
    entries: tuple[LedgerEntry, ...]


class ClientState:
    """One client identity's state folder: signing key and privacy ledger.

    See the module docstring. Use :meth:`open` for a folder, :meth:`in_memory` for none.

    Parameters
    ----------
    identity
        The client's provisioned identity (its client id).
    signer
        Its Ed25519 signing key.
    entries
        Its ledger, by (data fingerprint, level).
    directory
        The folder (None: nothing is written).
    lock
        The folder's lock file, open and locked for this process (:meth:`open` takes it;
        :meth:`close` releases it).
    """

    def __init__(
        self,
        identity: str,
        signer: BlockSigner,
        entries: dict[tuple[str, str], LedgerEntry] | None = None,
        *,
        directory: Path | None = None,
        lock: IO[bytes] | None = None,
    ) -> None:
        self.identity = identity
        self.signer = signer
        self.directory = directory
        self._entries = dict(entries or {})
        self._lock = lock

    @classmethod
    def in_memory(cls, identity: str) -> ClientState:
        """State that lives as long as this object (for clients that keep theirs elsewhere)."""
        return cls(identity, BlockSigner())

    @classmethod
    def open(cls, directory: Path, *, identity: str) -> ClientState:
        """Open (or create) ``identity``'s state folder and lock it for this process.

        Raises
        ------
        ConfigError
            Another process holds the folder; its ledger is corrupt, of another identity, or
            missing beside an existing signing key; or its signing key is corrupt.
        """
        if not identity:
            raise ConfigError("a client state folder needs the client's identity")
        private_directory(directory)
        lock = _acquire(directory / LOCK_FILE)
        try:
            ledger = directory / LEDGER_FILE
            key = directory / SIGNING_KEY_FILE
            if ledger.exists():
                entries = _read_ledger(ledger, identity)
            elif key.exists():
                raise ConfigError(
                    f"client state {directory}: {ledger} is missing but {key} exists, so this "
                    "client has run before and its privacy ledger is lost; restore the folder "
                    "from a backup (starting the budget again from zero would under-report "
                    "what its data has already spent)"
                )
            else:
                entries = {}
                _write_ledger(ledger, identity, entries)
            state = cls(
                identity,
                BlockSigner.load_or_create(key),
                entries,
                directory=directory,
                lock=lock,
            )
        except BaseException:
            lock.close()
            raise
        if entries:
            _log.info("%s: privacy ledger %s restored (%d entries)", identity, ledger, len(entries))
        return state

    @property
    def ledger_path(self) -> Path | None:
        """The ledger file (None in memory)."""
        return None if self.directory is None else self.directory / LEDGER_FILE

    def spent(self, data: str, level: str) -> LedgerEntry | None:
        """What was recorded for data fingerprint ``data`` at privacy ``level``."""
        return self._entries.get((data, level))

    def spent_on_other_data(self, data: str, level: str) -> list[LedgerEntry]:
        """What was recorded at privacy ``level`` for data other than fingerprint ``data``."""
        return [e for (d, lv), e in sorted(self._entries.items()) if lv == level and d != data]

    def record(self, data: str, spend: PrivacySpend, *, privacy: PrivacyConfig) -> LedgerEntry:
        """Record ``spend`` on data fingerprint ``data`` at ``privacy.level``.

        Durable (in a folder) when this returns.
        """
        entry = LedgerEntry(
            data=data,
            level=privacy.level,
            history=spend.history,
            epsilon=spend.epsilon,
            delta=privacy.delta,
            accountant=privacy.accountant,
            run_id=spend.run_id,
            updated_unix=time.time(),
        )
        entries = {**self._entries, (data, entry.level): entry}
        path = self.ledger_path
        if path is not None:
            if self._lock is None:
                raise RuntimeError(f"client state {self.directory} was closed")
            _write_ledger(path, self.identity, entries)
        self._entries = entries
        return entry

    def close(self) -> None:
        """Release the folder's lock (nothing is written after this)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None


def _acquire(path: Path) -> IO[bytes]:
    """Open and exclusively lock ``path``.

    The lock is released when the file is closed or the process dies, SIGKILL included.
    """
    fd = private_opener(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
    fh = os.fdopen(fd, "r+b")
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.close()
        raise ConfigError(
            f"client state {path.parent} is in use by another process (it holds {path}): two "
            "clients on one privacy ledger would each spend budget the other does not see"
        ) from None
    return fh


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _write_ledger(path: Path, identity: str, entries: dict[tuple[str, str], LedgerEntry]) -> None:
    body: dict[str, Any] = {
        "format": _FORMAT,
        "identity": identity,
        "entries": [entries[k].model_dump(mode="python") for k in sorted(entries)],
    }
    body["entries"] = json.loads(json.dumps(body["entries"]))  # tuples as lists, as read back
    document = {**body, "sha256": hashlib.sha256(_canonical(body)).hexdigest()}
    write_atomic(path, (json.dumps(document, indent=1, sort_keys=True) + "\n").encode())


def _read_ledger(path: Path, identity: str) -> dict[tuple[str, str], LedgerEntry]:
    """The entries of the ledger at ``path``, checked (see the module docstring)."""

    def corrupt(why: str) -> ConfigError:
        return ConfigError(
            f"privacy ledger {path} is corrupt ({why}); restore it from a backup: fedps never "
            "resets a client's privacy budget"
        )

    try:
        document = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise corrupt(f"unreadable: {exc}") from None
    if not isinstance(document, dict) or not isinstance(document.get("sha256"), str):
        raise corrupt("no checksum")
    claimed = document.pop("sha256")
    if hashlib.sha256(_canonical(document)).hexdigest() != claimed:
        raise corrupt("checksum mismatch")
    try:
        ledger = _LedgerFile.model_validate(document)
    except ValidationError as exc:
        errors = (f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise corrupt("; ".join(errors)) from None
    if ledger.identity != identity:
        raise ConfigError(
            f"privacy ledger {path} belongs to client {ledger.identity!r}, not {identity!r}: "
            "each identity has its own state folder"
        )
    entries: dict[tuple[str, str], LedgerEntry] = {(e.data, e.level): e for e in ledger.entries}
    if len(entries) != len(ledger.entries):
        raise corrupt("two entries for one data source and level")
    return entries
