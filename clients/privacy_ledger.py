"""An edge client's privacy spend as its ledger keeps it.

Resumed when the client starts, recorded (durable) before each round it trains, and after rounds it
sat out.

The spend belongs to the client's data, not to its process (docs/privacy.md): the ledger
(:class:`clients.client_state.ClientState`) keys it by the data's fingerprint, and a client
whose data changed resumes from what was spent on the earlier data too, as the two may
overlap.
"""

from __future__ import annotations

import hashlib
import logging

from clients.client_state import ClientState
from clients.dp_trainer import PrivacySpend, Trainer
from fedps.config import PrivacyConfig

__all__ = ["EXTERNAL_DATA", "PrivacyLedger"]

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
        What the ledger keys the spend by: the data's fingerprint
        (:func:`clients.client_state.data_fingerprint`), or :data:`EXTERNAL_DATA`.
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
        data: str,
        privacy: PrivacyConfig,
        name: str,
    ) -> None:
        self.state = state
        self.trainer = trainer
        self.data = data
        self.privacy = privacy
        self.name = name
        self.recorded = self.resume()

    @property
    def epsilon(self) -> float:
        """The recorded epsilon (at ``privacy.delta``)."""
        return self.recorded.epsilon

    def resume(self) -> PrivacySpend:
        """Resume the trainer's accountant from the ledger; returns the spend restored.

        Data the ledger has not seen (a file that grew or changed, other preprocessing) may
        overlap the data this client trained on before: the spend recorded on other data is
        then composed with it, so the budget never starts again from zero.
        """
        level = self.privacy.level
        entry = self.state.spent(self.data, level)
        earlier = self.state.spent_on_other_data(self.data, level)
        if entry is None and earlier:
            self.trainer.restore([step for e in earlier for step in e.history])
            _log.warning(
                "%s: its data changed since it last trained; the spend recorded on the earlier "
                "data (%s) counts too, as the data may overlap: epsilon %.3f spent (delta %g)",
                self.name,
                self.state.ledger_path,
                self.trainer.epsilon(),
                self.privacy.delta,
            )
        if entry is not None:
            self.trainer.restore(entry.history, run_id=entry.run_id)
            _log.info(
                "%s: resumes its privacy budget from %s: epsilon %.3f spent (delta %g)",
                self.name,
                self.state.ledger_path,
                self.trainer.epsilon(),
                self.privacy.delta,
            )
        return self.trainer.spend()

    def record(self, spend: PrivacySpend) -> None:
        """Write ``spend`` to the ledger (durable), then carry it in every later call."""
        self.state.record(self.data, spend, privacy=self.privacy)
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
