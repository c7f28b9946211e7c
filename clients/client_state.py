"""A client's state that outlives its process: identity, signing key and privacy ledger.

A client's privacy budget belongs to its data, not to its process. :class:`ClientState` keeps
one folder per identity (``<cluster.state_dir>/clients/<identity>`` by default, see
:func:`default_state_dir`; ``fedps client --state-dir`` chooses another; a Flower node keeps
the same folder, see :mod:`clients.flower.flower_client`):

``ledger.json``
    The identity the folder belongs to (``tls.name`` or ``client-INDEX``, the client id the
    coordinator gives it), and one privacy spend per data source, keyed by the fingerprint of
    the training data (:func:`data_fingerprint`) and the privacy level (``"example"`` or
    ``"client"``): the accountant's history of ``(noise multiplier, sample rate, steps)``, its
    epsilon at the delta and accountant it was recorded with, and (client level) the run whose
    global rounds the last entry counts. The file carries an HMAC-SHA256 of its content under
    the folder's ledger key and is rewritten atomically (:func:`crypto.files.write_atomic`) at
    every record.
``ledger.key``
    The ledger's HMAC key: 32 random bytes (mode 0600, its SHA-256 beside it as
    ``ledger.key.sha256``, :func:`crypto.files.check_key`), created with the folder. A ledger
    edited and given a recomputed plain SHA-256 is refused as a damaged one is.
``rows/<fingerprint>``
    Which rows a data source holds: the sorted SHA-256 digests of its rows (32 bytes each;
    3.2 MB for 100,000 rows), written once, when the client first opens the data. The file's
    name is the data's fingerprint, which is the SHA-256 of its content: a changed file is
    refused, a lost one makes its entry count as overlapping any data (:meth:`ClientState.
    overlapping`).
``signing.key``
    The Ed25519 key the client signs its updates with (mode 0600): a restarted client's
    commitments are still its own. ``signing.key.sha256`` beside it tells a damaged key
    (:func:`crypto.files.check_key`).
``lock``
    Held (``flock``) while a client uses the folder: two processes on one ledger would each
    spend budget the other does not see.

The fingerprint of a data source is order-free: the SHA-256 of the sorted digests of its rows
(each row's features and label, with their dtypes and shapes), so a reordered copy of the same
rows is the same data. A ledger written by the previous version (fingerprints that depended on
the order of the rows, a plain SHA-256 checksum, no ledger key) is accepted once: it is
rewritten with a keyed checksum (a WARNING says so), and an entry of the old fingerprint is
taken over by the new fingerprint of the same data at its first record. An unkeyed checksum in
a folder that has a ledger key is refused.

The session credential the coordinator issues at registration is not kept: a restarted client
registers again (proving its identity with its certificate or enrolment token, in
``tls.directory``) and gets a new one.

The edge client records the spend a round *will* have made before it trains the round
(:meth:`clients.dp_trainer.Trainer.spend_after_next_round`), so a client killed at any moment
never reports less than it spent: at worst, killed between the record and the training, one
round more. A ledger that does not parse, fails its checksum or belongs to another identity is
a :class:`~fedps.errors.ConfigError` naming the file; a folder whose ledger is gone while its
signing key is still there is refused too. The budget is never silently reset by fedps; an
operator who deletes the whole folder starts the client's own ledger again, and the server's
ledger (docs/privacy.md) is the authority then.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import logging
import math
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from clients.dp_trainer import History, PrivacySpend
from crypto.files import check_key, private_directory, private_opener, write_atomic, write_key
from crypto.signing import BlockSigner
from fedps.config import FedPSConfig, PrivacyConfig
from fedps.errors import ConfigError
from fedps.learning.datasets import Dataset

__all__ = ["ClientState", "DataSource", "LedgerEntry", "data_fingerprint", "default_state_dir"]

_log = logging.getLogger("fedps")

LEDGER_FILE = "ledger.json"
SIGNING_KEY_FILE = "signing.key"
LOCK_FILE = "lock"
LEDGER_KEY_FILE = "ledger.key"
ROWS_FOLDER = "rows"
_FORMAT = "fedps-client-ledger/2"  # keyed checksum ("hmac_sha256")
_UNKEYED_FORMAT = "fedps-client-ledger/1"  # the previous version's, plain "sha256"
_ROW_DOMAIN = b"fedps-row-v2"
_DATA_DOMAIN = b"fedps-data-v2"
_DIGEST = 32  # bytes of a row's digest


def default_state_dir(config: FedPSConfig, identity: str) -> Path:
    """Where client ``identity`` keeps its state unless told otherwise."""
    return config.cluster.state_dir / "clients" / identity


def data_fingerprint(data: Dataset) -> str:
    """The order-free fingerprint (SHA-256, hex) of a training set.

    The SHA-256 of the sorted digests of its rows (:func:`row_digests`): reordering the rows
    leaves it as it is; changing, adding or removing one changes it.
    """
    return _fingerprint_of_rows(row_digests(data))


def row_digests(data: Dataset) -> bytes:
    """The SHA-256 digests of ``data``'s rows, sorted and concatenated (32 bytes each).

    A row's digest covers its features and its label, with their dtypes and shapes.
    """
    x, y = np.ascontiguousarray(data.x), np.ascontiguousarray(data.y)
    header = f"{x.dtype.str}{x.shape[1:]}|{y.dtype.str}{y.shape[1:]}".encode()
    prefix = _ROW_DOMAIN + len(header).to_bytes(4, "little") + header
    xs, ys = x.reshape(len(x), -1).view(np.uint8), y.reshape(len(y), -1).view(np.uint8)
    digests = sorted(
        hashlib.sha256(prefix + xs[i].tobytes() + ys[i].tobytes()).digest() for i in range(len(x))
    )
    return b"".join(digests)


def _fingerprint_of_rows(rows: bytes) -> str:
    return hashlib.sha256(_DATA_DOMAIN + rows).hexdigest()


def _fingerprint_v1(data: Dataset) -> str:
    """The previous version's fingerprint, which depended on the order of the rows."""
    digest = hashlib.sha256(b"fedps-data-v1")
    for array in (data.x, data.y):
        a = np.ascontiguousarray(array)
        header = f"{a.dtype.str}{a.shape}".encode()
        digest.update(len(header).to_bytes(4, "little") + header)
        digest.update(a.data.cast("B"))
    return digest.hexdigest()


@dataclass(frozen=True)
class DataSource:
    """What the ledger knows of the data a spend is on.

    Attributes
    ----------
    fingerprint
        The key of its ledger entry (:func:`data_fingerprint`, or a name for data fedps does not
        see, :data:`clients.privacy_ledger.EXTERNAL_DATA`).
    rows
        Its sorted row digests (:func:`row_digests`); None: unknown (it may overlap any data).
    earlier
        Its fingerprint as the previous version computed it, whose entry this one takes over.
    """

    fingerprint: str
    rows: bytes | None = None
    earlier: str = ""

    @classmethod
    def of(cls, data: Dataset) -> DataSource:
        """The source of a training set whose rows fedps holds."""
        rows = row_digests(data)
        return cls(_fingerprint_of_rows(rows), rows, _fingerprint_v1(data))

    def overlaps(self, rows: bytes | None) -> bool:
        """Whether a source of row digests ``rows`` (None: unknown) may share a row with this one.

        Compares the first 8 bytes of each digest: a chance match can only count as an overlap.
        """
        if rows is None or self.rows is None:
            return True
        mine, theirs = (_prefixes(r) for r in (self.rows, rows))
        if not len(mine):
            return False
        at = np.searchsorted(mine, theirs).clip(max=len(mine) - 1)
        return bool((mine[at] == theirs).any())


def _prefixes(rows: bytes) -> npt.NDArray[np.uint64]:
    """The first 8 bytes of each of the sorted row digests ``rows``, as sorted integers."""
    return np.frombuffer(rows, dtype=">u8")[::4].astype(np.uint64)


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

    format: Literal["fedps-client-ledger/1", "fedps-client-ledger/2"]
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
    key
        The ledger's HMAC key (with ``directory``).
    """

    def __init__(
        self,
        identity: str,
        signer: BlockSigner,
        entries: dict[tuple[str, str], LedgerEntry] | None = None,
        *,
        directory: Path | None = None,
        lock: IO[bytes] | None = None,
        key: bytes = b"",
    ) -> None:
        self.identity = identity
        self.signer = signer
        self.directory = directory
        self._entries = dict(entries or {})
        self._lock = lock
        self._key = key
        self._rows: dict[str, bytes | None] = {}  # row digests by fingerprint, as read

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
            Another process holds the folder; its ledger is corrupt, edited, of another
            identity, missing beside an existing signing key, or keyed while its key is missing.
        CorruptStateError
            Its signing key or ledger key is corrupt.
        """
        if not identity:
            raise ConfigError("a client state folder needs the client's identity")
        private_directory(directory)
        lock = _acquire(directory / LOCK_FILE)
        try:
            ledger = directory / LEDGER_FILE
            key = directory / SIGNING_KEY_FILE
            key_path = directory / LEDGER_KEY_FILE
            if not ledger.exists() and key.exists():
                raise ConfigError(
                    f"client state {directory}: {ledger} is missing but {key} exists, so this "
                    "client has run before and its privacy ledger is lost; restore the folder "
                    "from a backup (starting the budget again from zero would under-report "
                    "what its data has already spent)"
                )
            fresh = not ledger.exists()
            ledger_key = _read_ledger_key(key_path)
            entries = {} if fresh else _read_ledger(ledger, identity, ledger_key, key_path)
            if ledger_key is None:
                ledger_key = _create_ledger_key(key_path)
                if not fresh:  # a ledger of the previous version, accepted once
                    _log.warning(
                        "%s: privacy ledger %s had an unkeyed checksum (an earlier fedps); "
                        "rewritten with a keyed one under %s",
                        identity,
                        ledger,
                        key_path,
                    )
                fresh = True
            if fresh:
                _write_ledger(ledger, identity, entries, ledger_key)
            state = cls(
                identity,
                BlockSigner.load_or_create(key),
                entries,
                directory=directory,
                lock=lock,
                key=ledger_key,
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

    def overlapping(self, source: DataSource, level: str) -> list[LedgerEntry]:
        """What was recorded at privacy ``level`` on data that may share a row with ``source``.

        Its own entry (and the one of its earlier fingerprint) first, then every entry whose
        rows overlap its rows; an entry or a source whose rows are unknown overlaps any data.

        Raises
        ------
        ConfigError
            A rows file does not match its fingerprint.
        """
        own = {source.fingerprint, source.earlier}
        entries = sorted(
            (e for (_, lv), e in self._entries.items() if lv == level),
            key=lambda e: (e.data not in own, e.data),
        )
        return [e for e in entries if e.data in own or source.overlaps(self._rows_of(e.data))]

    def remember(self, source: DataSource) -> None:
        """Keep which rows ``source`` holds (written once, in a folder), for :meth:`overlapping`."""
        if source.rows is None:
            return
        self._rows[source.fingerprint] = source.rows
        path = self._rows_path(source.fingerprint)
        if path is not None and not path.exists():
            self._check_open()
            private_directory(path.parent)
            write_atomic(path, source.rows)

    def record(
        self,
        data: str,
        spend: PrivacySpend,
        *,
        privacy: PrivacyConfig,
        replaces: str = "",
    ) -> LedgerEntry:
        """Record ``spend`` on data fingerprint ``data`` at ``privacy.level``.

        ``replaces``: the fingerprint of an entry that this one takes over (the same data under
        the previous version's fingerprint), dropped in the same write. Durable (in a folder)
        when this returns.
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
        if replaces and replaces != data:
            entries.pop((replaces, entry.level), None)
        path = self.ledger_path
        if path is not None:
            self._check_open()
            _write_ledger(path, self.identity, entries, self._key)
        self._entries = entries
        return entry

    def close(self) -> None:
        """Release the folder's lock (nothing is written after this)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def _check_open(self) -> None:
        if self._lock is None:
            raise RuntimeError(f"client state {self.directory} was closed")

    def _rows_path(self, fingerprint: str) -> Path | None:
        return None if self.directory is None else self.directory / ROWS_FOLDER / fingerprint

    def _rows_of(self, fingerprint: str) -> bytes | None:
        """The row digests of the data of ``fingerprint`` (None: unknown)."""
        if fingerprint not in self._rows:
            path = self._rows_path(fingerprint)
            self._rows[fingerprint] = None if path is None else _read_rows(path, fingerprint)
        return self._rows[fingerprint]


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


def _read_ledger_key(path: Path) -> bytes | None:
    """The ledger's HMAC key kept at ``path`` (None: the folder has none)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    check_key(path, raw, size=32, what="ledger key")
    return raw


def _create_ledger_key(path: Path) -> bytes:
    """A new ledger key, written to ``path`` (which must not exist)."""
    raw = secrets.token_bytes(32)
    write_key(path, raw, exclusive=True)
    return raw


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _keyed(key: bytes, body: dict[str, Any]) -> str:
    return hmac.new(key, _canonical(body), hashlib.sha256).hexdigest()


def _write_ledger(
    path: Path, identity: str, entries: dict[tuple[str, str], LedgerEntry], key: bytes
) -> None:
    body: dict[str, Any] = {
        "format": _FORMAT,
        "identity": identity,
        "entries": [entries[k].model_dump(mode="python") for k in sorted(entries)],
    }
    body["entries"] = json.loads(json.dumps(body["entries"]))  # tuples as lists, as read back
    document = {**body, "hmac_sha256": _keyed(key, body)}
    write_atomic(path, (json.dumps(document, indent=1, sort_keys=True) + "\n").encode())


def _read_ledger(
    path: Path, identity: str, key: bytes | None, key_path: Path
) -> dict[tuple[str, str], LedgerEntry]:
    """The entries of the ledger at ``path``, checked (see the module docstring).

    ``key`` is the folder's ledger key (None: the folder has none, as the previous version's).
    """

    def corrupt(why: str) -> ConfigError:
        return ConfigError(
            f"privacy ledger {path} is corrupt ({why}); restore it from a backup: fedps never "
            "resets a client's privacy budget"
        )

    try:
        document = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise corrupt(f"unreadable: {exc}") from None
    if not isinstance(document, dict):
        raise corrupt("no checksum")
    if isinstance(document.get("hmac_sha256"), str):
        if key is None:
            raise corrupt(f"its key {key_path} is missing")
        claimed, expected, format_ = document.pop("hmac_sha256"), _keyed(key, document), _FORMAT
    elif isinstance(document.get("sha256"), str):
        if key is not None:
            raise corrupt(f"a plain SHA-256 where {key_path} keys the checksum: edited")
        claimed = document.pop("sha256")
        expected, format_ = hashlib.sha256(_canonical(document)).hexdigest(), _UNKEYED_FORMAT
    else:
        raise corrupt("no checksum")
    if not hmac.compare_digest(claimed, expected):
        raise corrupt("checksum mismatch")
    try:
        ledger = _LedgerFile.model_validate(document)
    except ValidationError as exc:
        errors = (f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise corrupt("; ".join(errors)) from None
    if ledger.format != format_:
        raise corrupt(f"format {ledger.format} with the checksum of {format_}")
    if ledger.identity != identity:
        raise ConfigError(
            f"privacy ledger {path} belongs to client {ledger.identity!r}, not {identity!r}: "
            "each identity has its own state folder"
        )
    entries: dict[tuple[str, str], LedgerEntry] = {(e.data, e.level): e for e in ledger.entries}
    if len(entries) != len(ledger.entries):
        raise corrupt("two entries for one data source and level")
    return entries


def _read_rows(path: Path, fingerprint: str) -> bytes | None:
    """The row digests kept at ``path`` for ``fingerprint`` (None: not kept).

    Raises
    ------
    ConfigError
        The file does not match the fingerprint it is named after.
    """
    try:
        rows = path.read_bytes()
    except FileNotFoundError:
        return None
    if len(rows) % _DIGEST or _fingerprint_of_rows(rows) != fingerprint:
        raise ConfigError(
            f"rows file {path} is corrupt (it does not match its data's fingerprint); restore "
            "it from a backup, or delete it: its ledger entry then counts for any data"
        )
    return rows
