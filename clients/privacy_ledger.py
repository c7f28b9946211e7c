"""An edge client's privacy spend as its ledger keeps it.

Resumed when the client starts, recorded (durable) before each round it trains, and after rounds it
sat out.

The spend belongs to the client's data, not to its process (docs/privacy.md): the ledger
(:class:`clients.client_state.ClientState`) keys it by the data's order-free fingerprint and
keeps which rows each entry covers. A client resumes from the largest spend recorded on any data
that shares a row with its own (:func:`largest`): every entry's history covers every step taken
on its rows, as it started from the largest spend on them, so going from data A to data B that
holds A's rows and back to A resumes B's history, which holds A's steps. Data that shares no
row with earlier data starts from zero.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence

from clients.client_state import ClientState, DataSource
from clients.dp_trainer import History, PrivacySpend, Trainer
from fedps.config import PrivacyConfig

__all__ = ["EXTERNAL_DATA", "PrivacyLedger", "largest"]

#: The ledger's key (a fingerprint's format) for the spend of a given trainer, whose data
#: fedps never sees.
EXTERNAL_DATA = hashlib.sha256(b"fedps-data-v1/external").hexdigest()

_log = logging.getLogger("fedps")


class PrivacyLedger:
    """One client's spend on one data set.

    The trainer's accountant, kept in step with the ledger of its state.

    Building it resumes the trainer's accountant from the ledger (:meth:`resume`); the
    ledger's file was read when the state was opened, so nothing here reads a file.

    Parameters
    ----------
    state
        The client's state: its ledger (in a folder, or in memory).
    trainer
        The client's trainer, whose accountant holds the spend.
    data
        The data the spend is on (:meth:`DataSource.of <clients.client_state.DataSource.of>`), or
        what the ledger keys it by alone (a fingerprint, or :data:`EXTERNAL_DATA`), whose rows
        are then unknown: it overlaps any data.
    privacy
        The privacy settings (level, delta, accountant).
    name
        The client's display name (for the log).

    Attributes
    ----------
    recorded
        The spend the ledger holds: what every call to the coordinator carries.
    """

    def __init__(
        self,
        state: ClientState,
        trainer: Trainer,
        *,
        data: DataSource | str,
        privacy: PrivacyConfig,
        name: str,
    ) -> None:
        self.trainer = trainer
        self.source = data if isinstance(data, DataSource) else DataSource(data)
        self.data = self.source.fingerprint
        self.privacy = privacy
        self.name = name
        self.state = state
        self.recorded = self.reopen(state, quiet=False)

    def reopen(self, state: ClientState, *, quiet: bool = True) -> PrivacySpend:
        """Keep the spend in ``state`` from now on, and resume from it (:meth:`resume`).

        For a client whose state folder is opened again (a Flower node, for each message);
        ``quiet``: a resumed spend is logged at DEBUG, not INFO.
        """
        self.state = state
        state.remember(self.source)
        self.recorded = self.resume(quiet=quiet)
        return self.recorded

    @property
    def epsilon(self) -> float:
        """The recorded epsilon (at ``privacy.delta``)."""
        return self.recorded.epsilon

    def resume(self, *, quiet: bool = False) -> PrivacySpend:
        """Resume the trainer's accountant from the ledger; returns the spend restored.

        The largest spend (:func:`largest`) recorded on this data or on any data that shares a
        row with it: data the ledger has not seen (a file that grew, other preprocessing) starts
        from what was spent on its rows before, never from zero (a WARNING says so). ``quiet``:
        the spend resumed from the data's own entry is logged at DEBUG, not INFO.
        """
        entries = self.state.overlapping(self.source, self.privacy.level)
        if not entries:
            return self.trainer.spend()
        history, run_id = largest([e.spend for e in entries])
        self.trainer.restore(history, run_id=run_id)
        level = self.privacy.level
        own = self.state.spent(self.data, level) or self.state.spent(self.source.earlier, level)
        if own is None or own.history != history:
            _log.warning(
                "%s: its data changed since it last trained; the largest spend recorded on data "
                "that shares rows with it (%s, %d entries) counts: epsilon %.3f spent (delta %g)",
                self.name,
                self.state.ledger_path,
                len(entries),
                self.trainer.epsilon(),
                self.privacy.delta,
            )
        else:
            _log.log(
                logging.DEBUG if quiet else logging.INFO,
                "%s: resumes its privacy budget from %s: epsilon %.3f spent (delta %g)",
                self.name,
                self.state.ledger_path,
                self.trainer.epsilon(),
                self.privacy.delta,
            )
        return self.trainer.spend()

    def record(self, spend: PrivacySpend) -> None:
        """Write ``spend`` to the ledger (durable), then carry it in every later call."""
        self.state.record(self.data, spend, privacy=self.privacy, replaces=self.source.earlier)
        self.recorded = spend

    def record_next_round(self) -> None:
        """Before training: record what the round will have spent.

        Whatever happens afterwards (a crash while training, a push that never lands), the ledger
        never holds less than was spent; killed before it trains, the client has recorded one round
        too many.
        """
        self.record(self.trainer.spend_after_next_round())

    def sit_out(self, round_: int) -> bool:
        """Rounds up to ``round_`` finished without this client.

        At client level they count in its spend all the same (amplification by sampling counts every
        global round). Records the spend when it grew; returns whether it did.
        """
        if not self.trainer.sit_out(round_):
            return False
        self.record(self.trainer.spend())
        return True


def largest(spends: Sequence[PrivacySpend]) -> tuple[History, str]:
    """The least history that covers each of ``spends``, and the run its last entry counts.

    A spend that covers every other one (at least as many steps at each noise multiplier and
    sample rate, so at least the epsilon with any steps that follow) is returned as it is, with
    its run, the first such one of ``spends``. Otherwise the largest step count at each noise
    multiplier and sample rate, in the order they first appear, and no run (client level: the
    current run's rounds count again, on top).
    """
    steps: dict[tuple[float, float], int] = {}
    for spend in spends:
        for stretch, n in _totals(spend.history).items():
            steps[stretch] = max(steps.get(stretch, 0), n)
    for spend in spends:
        if _totals(spend.history) == steps:
            return spend.history, spend.run_id
    return tuple((sigma, rate, n) for (sigma, rate), n in steps.items()), ""


def _totals(history: History) -> dict[tuple[float, float], int]:
    """The steps of ``history`` at each (noise multiplier, sample rate)."""
    totals: dict[tuple[float, float], int] = {}
    for sigma, rate, n in history:
        totals[sigma, rate] = totals.get((sigma, rate), 0) + n
    return totals
