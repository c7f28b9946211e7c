"""Cohort sampling: which live clients the coordinator asks to train in a round.

Client level (DP-FedAvg): the accountant amplifies by sampling at rate q = n / clients
(:func:`fedps.learning.accounting.client_cohort`, n the configured cohort size), which assumes
Poisson sampling: every provisioned client takes part in a round independently with
probability q, whoever else does (Abadi et al. 2016; Mironov, Talwar and Zhang 2019). The
sampler draws each live client with probability q. A provisioned client that is not live
cannot take part whatever the draw, so this is Poisson sampling over all provisioned clients
followed by absences: no client takes part with a probability above q, and a cohort is not
topped up from the clients that are live when others are not (that would raise their rate).
With q = 1 (``training.cohort_size = 0`` or at least ``training.clients``) every live client
trains. A cohort's size is random: it can be smaller than ``training.min_quorum`` (the
coordinator then skips the round) or larger than n.

Example level: the accountant is each client's own DP-SGD and the cohort rate plays no part in
it; the sampler takes ``training.cohort_size`` live clients uniformly (all when 0), the same
size every round.

A round runs only with a cohort of at least ``training.min_quorum`` and at most
``he.max_clients`` clients (:meth:`CohortSampler.fits`); with another it is skipped before
anything opens, and still counts as a global round.

Both draw from :func:`crypto.randomness.random_source`: a CSPRNG, so the cohorts cannot be
predicted or regenerated from the configuration (a seed gives them away), and a seeded
generator only behind ``privacy.insecure_reproducible``.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable

from crypto.randomness import random_source
from fedps.config import PrivacyConfig, TrainingConfig
from fedps.learning.accounting import client_cohort

__all__ = ["CohortSampler"]

_log = logging.getLogger("fedps")


class CohortSampler:
    """Draws each round's cohort from the live clients.

    Parameters
    ----------
    training, privacy
        The run's configuration: ``privacy.level`` picks Poisson sampling (client level) or a
        fixed-size sample (example level).
    max_clients
        Most clients a round may have (``he.max_clients``).
    """

    def __init__(
        self, training: TrainingConfig, privacy: PrivacyConfig, *, max_clients: int = 1 << 30
    ) -> None:
        self.min_quorum = training.min_quorum
        self.max_clients = max_clients
        self.poisson = privacy.level == "client"
        #: client level: the Poisson rate q, the one the clients' accountant uses
        self.rate = client_cohort(training)[1] if self.poisson else 1.0
        #: example level: clients per cohort (0: every live client)
        self.size = training.cohort_size
        seed = training.seed if privacy.insecure_reproducible else None
        self._source = random_source(seed, role="coordinator")

    def draw(self, live: Iterable[str]) -> frozenset[str]:
        """The cohort of one round out of the ``live`` clients' ids (maybe empty)."""
        members = sorted(live)
        if self.poisson:
            chosen = self._source.bernoulli(len(members), self.rate)
            return frozenset(m for m, keep in zip(members, chosen, strict=True) if keep)
        return frozenset(self._source.sample(members, self.size or len(members)))

    def fits(self, round_: int, cohort: Collection[str]) -> bool:
        """Whether round ``round_`` can run with the drawn ``cohort``.

        At least ``min_quorum`` and at most ``he.max_clients`` clients (a Poisson draw can miss
        either; the round is then skipped before anything opens, and still counts as a global
        round).
        """
        low, high = self.min_quorum, self.max_clients
        if low <= len(cohort) <= high:
            return True
        _log.warning(
            "round %d skipped: %d clients drawn (Poisson, rate %.4g), the round needs %d to %d; "
            "nothing is opened or released, and the clients' accountants count the round",
            round_,
            len(cohort),
            self.rate,
            low,
            high,
        )
        return False
