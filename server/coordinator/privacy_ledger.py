"""The server's privacy ledger: every released round, by client identity, no client can reset.

A client's own ledger lives in its state folder, which its operator controls: a fresh folder,
or a new signing key, starts it again from 0. The coordinator keeps its own, from what it saw
released: for each round the key holder applied, the exact contributor set the key holder
returns (:class:`~fedps.rpc.keyholder_messages.AppliedRound`), each contributor with the
mechanism it declared when it registered (:class:`Declaration`: its data source's fingerprint,
noise multiplier, sample rate and DP-SGD steps per round). At client level (DP-FedAvg) every
global round counts for every registered identity, drawn or not, released or skipped, as the
clients' accountants count it: one step at the run's (sigma, q), sigma the smaller of the
configured one and the one the released sum carried.

An identity's epsilon composes everything recorded for it at the run's level, over every
declared data source and every run: the server cannot see rows, so it cannot know that two
sources are disjoint (:meth:`PrivacyLedger.sources` keeps the breakdown). The reported figure
is this one, or the client's own when that is larger (an honest client records a round before
it trains it, so its figure can include a round that was never released); a client below the
server's figure is logged as a WARNING with both.

Durable: one record per round on a :class:`~fedps.storage.record_log.RecordLog` (checksummed,
fsynced, 0600 files in a 0700 folder), written before the round is reported applied and
replayed at start. The ledger lives in the coordinator's state folder beside the run's
checkpoint, not in it: a new run (a checkpoint moved aside) continues every identity's ledger,
unless the operator starts a new one (:func:`start_new_ledger`, ``--new-ledger``).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from fedps.config import PrivacyConfig, TrainingConfig
from fedps.errors import CorruptStateError, FedPSError
from fedps.learning.accounting import client_level_noise, epsilon_of_history, merged_history
from fedps.storage.record_log import RecordLog
from server.coordinator.coordinator_settings import CoordinatorSettings

__all__ = [
    "LEDGER_DIR",
    "Declaration",
    "PrivacyLedger",
    "Release",
    "open_ledger",
    "start_new_ledger",
]

_log = logging.getLogger("fedps")

#: The ledger's folder in the coordinator's state folder.
LEDGER_DIR = "privacy-ledger"
_FILE_KEY = 0  # every record goes to one file of the record log
_TOLERANCE = 0.01  # a client's figure this far below the server's (relative) is a warning
_WARNINGS_KEPT = 64
_HINT = (
    "restore the ledger from a backup; moving it aside starts every identity's epsilon again "
    "from 0 (`--new-ledger` does that and says so)"
)

_History = tuple[tuple[float, float, int], ...]


@dataclass(frozen=True)
class Declaration:
    """What a client declares of its training when it registers.

    Attributes
    ----------
    source
        The fingerprint of the data it trains on (empty: not declared).
    noise_multiplier, sample_rate, steps
        One round's DP-SGD: sigma, the Poisson rate and the optimizer steps (steps 0: not
        declared; the server then has only the client's own figure).
    """

    source: str = ""
    noise_multiplier: float = 0.0
    sample_rate: float = 0.0
    steps: int = 0

    def check(self) -> None:
        """Refuse a declaration no accountant can compose.

        Raises
        ------
        ValueError
            A negative or NaN noise multiplier or step count, or a sample rate outside [0, 1].
        """
        if not self.noise_multiplier >= 0 or self.steps < 0 or not 0 <= self.sample_rate <= 1:
            raise ValueError(
                "a declared mechanism needs noise_multiplier >= 0, sample_rate in [0, 1] and "
                "steps >= 0"
            )
        if self.steps and not self.sample_rate:
            raise ValueError("declared steps need a sample rate in (0, 1]")


@dataclass(frozen=True)
class Release:
    """One identity's part in one recorded round (what the ledger composes)."""

    run_id: str
    round: int
    identity: str
    source: str
    level: str  # "example" (DP-SGD steps) or "client" (one global round)
    noise_multiplier: float
    sample_rate: float
    steps: int


def start_new_ledger(state_dir: Path) -> Path | None:
    """Set the ledger in the coordinator's ``state_dir`` aside, so a new one starts.

    Only between runs: the ledger of a run in progress (its checkpoint is there) is kept.

    Parameters
    ----------
    state_dir
        The coordinator's state folder.

    Returns
    -------
    Path or None
        Where the old ledger now is; None when there was none (or nothing recorded in it).

    Raises
    ------
    FedPSError
        A run is in progress in ``state_dir``: its ledger cannot be replaced.
    """
    from server.coordinator.checkpoint_store import CHECKPOINT_FILE

    directory = state_dir / LEDGER_DIR
    if (state_dir / CHECKPOINT_FILE).exists():
        raise FedPSError(
            f"a run is in progress in {state_dir} (its checkpoint {CHECKPOINT_FILE}): its "
            "privacy ledger stays; start a new ledger only with a new run"
        )
    if not directory.is_dir() or not any(directory.iterdir()):
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    aside = directory.with_name(f"{LEDGER_DIR}-retired-{stamp}")
    directory.rename(aside)
    _log.warning(
        "a new privacy ledger starts (--new-ledger): every client's epsilon starts again from 0; "
        "the old ledger is kept at %s",
        aside,
    )
    return aside


def open_ledger(state_dir: Path, settings: CoordinatorSettings, *, new: bool) -> PrivacyLedger:
    """The coordinator's ledger (:meth:`PrivacyLedger.open`), a new one first if ``new``.

    A new ledger sets the old one aside (:func:`start_new_ledger`); asked for while a run is in
    progress, it is not started, with a WARNING.

    Parameters
    ----------
    state_dir
        The coordinator's state folder.
    settings
        The coordinator's settings (the run's privacy and training, whether to fsync).
    new
        Start a new ledger (``--new-ledger``).

    Returns
    -------
    PrivacyLedger
        The ledger, with every record replayed.
    """
    if new:
        try:
            start_new_ledger(state_dir)
        except FedPSError as exc:
            _log.warning("--new-ledger ignored: %s", exc)
    return PrivacyLedger.open(
        state_dir,
        privacy=settings.privacy,
        training=settings.training,
        fsync=settings.cluster.fsync,
    )


class _Account:
    """One identity's releases, with its history at the ledger's level merged as they come.

    And the epsilons of that history computed so far (a cache, cleared by each release).
    """

    def __init__(self, level: str) -> None:
        self.level = level
        self.releases: list[Release] = []
        self.history: _History = ()
        self.before_last: _History = ()  # the history without its latest round
        self.last_step: tuple[float, float, int] | None = None
        self.figures: dict[_History, float] = {}

    def add(self, release: Release) -> None:
        self.releases.append(release)
        if release.level == self.level and release.steps > 0:
            step = (release.noise_multiplier, release.sample_rate, release.steps)
            self.before_last, self.history = self.history, merged_history([*self.history, step])
            self.last_step = step
            self.figures = {}


class PrivacyLedger:
    """The coordinator's durable record of what each client identity's data has spent.

    Build one with :meth:`open`; thread-safe.

    Parameters
    ----------
    log
        Where the rounds are recorded (replayed here).
    privacy
        The run's privacy: its level, delta, accountant and target (the budget the server
        holds every identity to).
    client_step
        Client level: the run's ``(sigma, q)`` of one global round (None at example level).

    Raises
    ------
    CorruptStateError
        A record of the log is damaged or is not a ledger record.
    """

    def __init__(
        self,
        log: RecordLog,
        *,
        privacy: PrivacyConfig,
        client_step: tuple[float, float] | None = None,
    ) -> None:
        self._log = log
        self.level = privacy.level
        self.delta = privacy.delta
        self.target = privacy.target_epsilon
        self._accountant = privacy.accountant
        self._client_step = client_step
        self._lock = threading.Lock()
        self._rounds: set[tuple[str, int]] = set()  # (run id, round) recorded
        self._accounts: dict[str, _Account] = {}  # by identity
        self._keys: dict[str, str] = {}  # the last signing key (hex) each identity registered
        self._disagreed: dict[str, float] = {}  # the server figure each warning was given at
        self._warnings: deque[str] = deque(maxlen=_WARNINGS_KEPT)  # the latest, oldest first
        self._flagged: set[str] = set()  # the identities a warning named
        for _, payload in log.records():
            self._replay(payload)

    @classmethod
    def open(
        cls,
        state_dir: Path,
        *,
        privacy: PrivacyConfig,
        training: TrainingConfig,
        fsync: bool = True,
    ) -> PrivacyLedger:
        """The ledger in the coordinator's ``state_dir`` (created if absent, private).

        Parameters
        ----------
        state_dir
            The coordinator's state folder; the ledger is its :data:`LEDGER_DIR`.
        privacy, training
            The run's configuration (client level: its calibrated noise).
        fsync
            Flush every record to disk before it counts.

        Returns
        -------
        PrivacyLedger
            The ledger, with every record replayed.
        """
        step = None
        if privacy.level == "client":
            noise = client_level_noise(training, privacy)
            step = (noise.noise_multiplier, noise.sample_rate)
        log = RecordLog(
            state_dir / LEDGER_DIR, fsync=fsync, what="the server's privacy ledger", hint=_HINT
        )
        return cls(log, privacy=privacy, client_step=step)

    # ------------------------------------------------------------------ recording
    def _replay(self, payload: bytes) -> None:
        try:
            record = json.loads(payload)
            if "key" in record:
                self._keys[str(record["identity"])] = str(record["key"])
                return
            releases = [Release(**r) for r in record["releases"]]
            self._rounds.add((str(record["run_id"]), int(record["round"])))
        except (ValueError, TypeError, KeyError) as exc:
            raise CorruptStateError(
                f"{self._log.directory}: a record is not a ledger record ({exc}); {_HINT}"
            ) from exc
        self._add(releases)

    def _add(self, releases: Iterable[Release]) -> None:
        for release in releases:
            self._accounts.setdefault(release.identity, _Account(self.level)).add(release)

    def _append(self, record: dict[str, object]) -> None:
        """Write ``record`` (durable when this returns; a failed write raises, nothing kept)."""
        self._log.append(_FILE_KEY, json.dumps(record, sort_keys=True).encode())

    def recorded(self, run_id: str, round_: int) -> bool:
        """Whether round ``round_`` of run ``run_id`` is recorded."""
        with self._lock:
            return (run_id, round_) in self._rounds

    def record_round(
        self,
        run_id: str,
        round_: int,
        *,
        contributors: Mapping[str, Declaration],
        members: Mapping[str, Declaration],
        noise_multiplier: float = 0.0,
    ) -> None:
        """Record a finished round, once (a round recorded already is left as it is).

        Parameters
        ----------
        run_id, round_
            The round.
        contributors
            Example level: the identities the key holder applied the round with (empty: the
            round released nothing), each with its declaration.
        members
            Client level: every registered identity, each with its declaration (every global
            round counts for each, drawn or not, released or not).
        noise_multiplier
            Client level: the noise multiplier the released sum carried (0: nothing released).

        Raises
        ------
        PeerUnavailableError
            The record could not be written (a full disk): nothing is recorded; ask again.
        """
        releases = self._releases_of(
            run_id, round_, contributors=contributors, members=members, sigma=noise_multiplier
        )
        with self._lock:
            if (run_id, round_) in self._rounds:
                return
            record = {"run_id": run_id, "round": round_, "releases": [asdict(r) for r in releases]}
            self._append(record)
            self._rounds.add((run_id, round_))
            self._add(releases)

    def _releases_of(
        self,
        run_id: str,
        round_: int,
        *,
        contributors: Mapping[str, Declaration],
        members: Mapping[str, Declaration],
        sigma: float,
    ) -> list[Release]:
        if self._client_step is None:
            return [
                Release(
                    run_id,
                    round_,
                    identity,
                    d.source,
                    "example",
                    d.noise_multiplier,
                    d.sample_rate,
                    d.steps,
                )
                for identity, d in sorted(contributors.items())
            ]
        accounted, q = self._client_step
        # The released sum carries at least sigma (the key holder tops it up): count sigma, or
        # less where less was released.
        sigma = min(accounted, sigma) if sigma > 0 else accounted
        return [
            Release(run_id, round_, identity, d.source, "client", sigma, q, 1)
            for identity, d in sorted(members.items())
        ]

    def note_key(self, identity: str, signing_key: str) -> str | None:
        """Remember ``identity``'s signing key (hex); returns the one it replaces, if another.

        Raises
        ------
        PeerUnavailableError
            The key could not be recorded (a full disk).
        """
        with self._lock:
            known = self._keys.get(identity)
            if known == signing_key:
                return None
            self._append({"identity": identity, "key": signing_key})
            self._keys[identity] = signing_key
        return known

    # ------------------------------------------------------------------ composition
    def _account(self, identity: str) -> _Account:
        with self._lock:
            return self._accounts.get(identity) or _Account(self.level)

    def _figure(self, account: _Account, history: _History) -> float:
        """The epsilon of ``history`` (one of ``account``'s), computed once per history."""
        figures = account.figures
        figure = figures.get(history)
        if figure is None:
            figure = figures[history] = self._epsilon_of(history)
        return figure

    def _epsilon_of(self, history: _History) -> float:
        if any(sigma == 0 for sigma, _, _ in history):
            return math.inf  # a round without noise: no finite epsilon
        return epsilon_of_history(history, self.delta, self._accountant)

    def history(self, identity: str) -> _History:
        """Everything recorded for ``identity`` at the run's level, as ``(sigma, q, steps)``."""
        return self._account(identity).history

    def epsilon(self, identity: str) -> float:
        """``identity``'s epsilon at the run's delta: its released rounds composed."""
        account = self._account(identity)
        return self._figure(account, account.history)

    def epsilons(self) -> dict[str, float]:
        """Every recorded identity's epsilon (:meth:`epsilon`), by identity."""
        with self._lock:
            identities = sorted(self._accounts)
        return {identity: self.epsilon(identity) for identity in identities}

    def sources(self, identity: str) -> dict[str, float]:
        """The breakdown of ``identity``'s epsilon: each declared data source's own."""
        account = self._account(identity)
        by_source: dict[str, list[tuple[float, float, int]]] = {}
        for r in account.releases:
            if r.level == self.level:
                by_source.setdefault(r.source, []).append(
                    (r.noise_multiplier, r.sample_rate, r.steps)
                )
        return {
            s: self._epsilon_of(merged_history(entries)) for s, entries in sorted(by_source.items())
        }

    def spent_out(self, identity: str, next_round: Declaration | None = None) -> bool:
        """Whether one more round would take ``identity`` past the target.

        The next round is one global round at client level, else ``next_round`` (the
        identity's declaration; None or undeclared: its last recorded round's). False without
        a target, or for an identity with no recorded round and nothing declared.
        """
        if self.target is None:
            return False
        account = self._account(identity)
        if self._client_step is not None:
            step = (*self._client_step, 1)
        elif next_round is not None and next_round.steps > 0:
            step = (next_round.noise_multiplier, next_round.sample_rate, next_round.steps)
        elif account.last_step is not None:
            step = account.last_step
        else:
            return False
        return self._figure(account, merged_history([*account.history, step])) > self.target

    # ------------------------------------------------------------------ second opinions
    def second_opinion(self, identity: str, reported: float, *, when: str = "reports") -> None:
        """Compare the client's own figure with the server's; WARNING when it is lower.

        Lower by more than 1% (relative) than the server's figure without the identity's
        latest round (a client learns of a round it was not drawn for at its next call). Once
        per identity and server figure: not at every call.

        Parameters
        ----------
        identity
            The client.
        reported
            The epsilon it says it has spent.
        when
            What it did, for the message (``"reports"``, ``"re-registered with"``).
        """
        account = self._account(identity)
        history = account.before_last
        server = self._figure(account, history)
        if not history or math.isinf(reported) or reported >= server * (1 - _TOLERANCE):
            with self._lock:
                self._disagreed.pop(identity, None)
            return
        with self._lock:
            if self._disagreed.get(identity) == server:
                return
            self._disagreed[identity] = server
        self.warn(
            identity,
            f"{identity} {when} epsilon {reported:.4f}, below {server:.4f} that its released "
            "rounds spent by the server's ledger: the server's figure stands",
        )

    def warn(self, identity: str, message: str) -> None:
        """Log ``message`` about ``identity`` as a WARNING and keep it for the operator."""
        _log.warning("%s", message)
        with self._lock:
            self._warnings.append(message)
            self._flagged.add(identity)

    def warned(self) -> tuple[list[str], list[str]]:
        """The warnings the operator should see, and the identities any warning named.

        The latest 64 warnings, oldest first; the identities sorted.
        """
        with self._lock:
            return list(self._warnings), sorted(self._flagged)

    def close(self) -> None:
        """Close the ledger's file."""
        self._log.close()
