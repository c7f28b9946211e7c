"""What the evidence proved, kept: tampering detected by shard, and clients blamed.

A round whose check failed is traced (:mod:`.blame`); :class:`Suspects` keeps the outcome.
A shard proven to have changed a sum, or to have shown false evidence, gets a detection
(counted by reason); after ``security.max_detections`` detections it is quarantined and the
key holder decrypts nothing more until the operator replaced it and cleared the detections
(``fedps keyholder --clear-detections``). A client proven to have sent key material, garbage
or a lying sketch is blamed, with what the evidence proved, and excluded from every later
round (the commit board takes no challenge request or commitment from it). Both are saved in
the key holder's state (:mod:`.state_store`).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Collection, Mapping

from fedps.errors import QuarantinedError
from server.keyholder.aggregate_verifier import TamperingError

__all__ = ["Suspects"]

_log = logging.getLogger("fedps")


class Suspects:
    """Tampering detected by shard and reason, and the clients blamed on evidence.

    Parameters
    ----------
    max_detections
        Detected tamperings by one shard after which it is quarantined.
    exclude
        Called with ``(client, why)`` for every blamed client, loaded or new, to exclude it
        from later rounds.
    """

    def __init__(self, *, max_detections: int, exclude: Callable[[str, str], None]) -> None:
        self.max_detections = max_detections
        self._exclude = exclude
        self._lock = threading.Lock()
        #: detected tamperings by shard, then by reason
        self.detections: dict[str, dict[str, int]] = {}
        #: clients proven guilty (:mod:`.blame`), with what they did; excluded for good
        self.blamed: dict[str, str] = {}
        #: called with (shard, reason) for each detection (metrics)
        self.on_tampering: Callable[[str, str], None] | None = None
        #: called with the client for each blame (metrics)
        self.on_blame: Callable[[str], None] | None = None

    def load(self, detections: Mapping[str, dict[str, int]], blamed: Mapping[str, str]) -> None:
        """Take the saved ``detections`` and ``blamed`` clients (these are excluded again)."""
        with self._lock:
            self.detections = dict(detections)
            self.blamed = dict(blamed)
        for client, why in blamed.items():
            self._exclude(client, why)

    def detected(self, round_: int, exc: TamperingError) -> None:
        """Count the tampering ``exc`` proved in ``round_`` against its shard."""
        with self._lock:
            reasons = self.detections.setdefault(exc.shard, {})
            reasons[exc.reason] = reasons.get(exc.reason, 0) + 1
            count = sum(reasons.values())
        _log.warning(
            "round %d: %s sent a tampered %s (detection %d); the round is never decrypted",
            round_,
            exc.shard,
            exc.reason,
            count,
        )
        if self.on_tampering is not None:
            self.on_tampering(exc.shard, exc.reason)

    def blame(self, round_: int, client: str, why: str) -> None:
        """Exclude ``client`` from every later round: the evidence of ``round_`` proved ``why``."""
        with self._lock:
            self.blamed[client] = f"round {round_}: {why}"
        self._exclude(client, self.blamed[client])
        _log.warning(
            "round %d: %s blamed on evidence (%s); it is excluded from later rounds",
            round_,
            client,
            why,
        )
        if self.on_blame is not None:
            self.on_blame(client)

    def counts(self) -> dict[str, int]:
        """Detections so far, by shard."""
        with self._lock:
            return {shard: sum(r.values()) for shard, r in self.detections.items()}

    def reasons(self) -> dict[str, int]:
        """Detections so far, by reason, summed over the shards."""
        with self._lock:
            return dict(sum((Counter(r) for r in self.detections.values()), Counter()))

    @property
    def quarantined(self) -> list[str]:
        """Shards caught tampering ``max_detections`` times or more."""
        return sorted(
            shard for shard, count in self.counts().items() if count >= self.max_detections
        )

    def check_none_quarantined(self, ring: Collection[str]) -> None:
        """Raise if a shard on ``ring`` is quarantined: the key holder decrypts nothing from it.

        A quarantined shard off the ring (the coordinator declared it gone) stops nothing: no
        block of a round on ``ring`` comes from it.

        Raises
        ------
        QuarantinedError
            Naming the shards on ``ring`` caught tampering ``max_detections`` times or more.
        """
        quarantined = [s for s in self.quarantined if s in ring]
        if quarantined:
            raise QuarantinedError(
                f"{', '.join(quarantined)} handed over tampered aggregates "
                f"{self.max_detections} times or more; the key holder decrypts nothing from "
                "a ring that holds it: the coordinator declares it gone, or the operator "
                "replaces it and clears the detections (docs/operations.md)"
            )

    def clear(self) -> None:
        """Forget every detection (the operator replaced the suspect shards)."""
        with self._lock:
            if self.detections:
                _log.warning("clearing tampering detections: %s", self.detections)
            self.detections = {}
