"""The coordinator's clients: registration, authentication, liveness and privacy spend.

A client's id is its provisioned identity: the common name of its certificate under mutual
TLS, or else the name its enrolment token proves (:mod:`crypto.enrolment`). Registering
returns a fresh random credential; the registry keeps only its SHA-256 and checks every later
call against it in constant time. Registering an identity again (a restarted client) keeps the
id and replaces the credential and the signing key.

Each client's privacy spend (epsilon at delta) arrives with its registration, with every
``GetTask`` and with every report; the registry keeps the largest it was told, so the maximum
over clients never goes down and counts rounds whose update never arrived. That is the client's
own figure, a second opinion: with the server's privacy ledger
(:class:`~.privacy_ledger.PrivacyLedger`, of the rounds the key holder released with each
identity) the figure reported for a client is the ledger's, or the client's own where that is
larger; a client whose own figure is lower, or that registers again with a new signing key, is
a WARNING the operator sees (:attr:`ClientRegistry.warnings`), and a client the ledger says is
out of budget is not live, whatever it says.

A client is live, and may be drawn for a cohort, while it has budget left (by its own word and
by the server's ledger) and has been heard from within ``liveness_s``. A cohort member that
let a round's deadline pass without reporting (:meth:`ClientRegistry.mark_missed`) is not live
until it asks for a task or registers again: a dead client leaves the next draw at once,
instead of staying in cohorts for ``liveness_s``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from types import MappingProxyType

from crypto.enrolment import ENROLMENT_KEY_FILE, load_enrolment_key, verify_token
from crypto.signing import is_weak_key
from fedps.config import TlsConfig
from fedps.errors import (
    InvalidArgumentError,
    PeerUnavailableError,
    UnauthenticatedError,
    UnknownClientError,
)
from fedps.storage.write_retry import write_until_written
from server.coordinator.privacy_ledger import Declaration, PrivacyLedger

__all__ = ["ClientRegistry", "RegisteredClient"]

_log = logging.getLogger("fedps")

_MAX_REPORTED_BYTES = 1 << 40  # per report; keeps totals far from uint64 overflow


@dataclass
class RegisteredClient:
    """What the coordinator knows of one client (all of it is checkpointed)."""

    name: str
    num_examples: int
    signing_key: str = ""  # Ed25519 public key, hex
    credential_hash: str = ""  # SHA-256 of the credential issued at registration, hex
    last_seen: float = field(default_factory=time.time)
    epsilon: float = 0.0
    delta: float = 0.0
    bytes_pushed: int = 0
    exhausted: bool = False
    noise_multiplier: float | None = None  # as the client last reported it
    rounds: int = 0  # rounds it reported an update for
    excluded: bool = False  # blamed on evidence by the key holder: in no cohort again
    #: what it declared at its last registration (see :class:`.privacy_ledger.Declaration`)
    source: str = ""
    declared_noise: float = 0.0
    sample_rate: float = 0.0
    steps: int = 0

    def declaration(self) -> Declaration:
        """What the client declared of its training at its last registration."""
        return Declaration(self.source, self.declared_noise, self.sample_rate, self.steps)

    def declare(self, declared: Declaration) -> None:
        """Keep ``declared`` (a registration's)."""
        self.source, self.declared_noise = declared.source, declared.noise_multiplier
        self.sample_rate, self.steps = declared.sample_rate, declared.steps

    def spent(self, epsilon: float, delta: float) -> None:
        """The client says it has spent ``epsilon`` (at ``delta``): keep the largest."""
        self.epsilon = max(self.epsilon, epsilon)
        if delta:
            self.delta = delta


def _check_spend(epsilon: float, delta: float) -> None:
    """Check that a reported privacy spend is a number the coordinator can keep.

    Raises
    ------
    InvalidArgumentError
        A NaN or negative epsilon, or a delta outside [0, 1). ``+inf`` is honest: a client
        training without DP noise has no finite epsilon.
    """
    if math.isnan(epsilon) or epsilon < 0 or not 0 <= delta < 1:
        raise InvalidArgumentError("epsilon must be >= 0 (inf: no DP), delta in [0, 1)")


class ClientRegistry:
    """The registered clients of one run; thread-safe.

    Parameters
    ----------
    tls
        The deployment's TLS settings: without TLS (``insecure``) the enrolment key in
        ``tls.directory`` must exist, since tokens are then the only proof of identity.
    num_params
        The run's model size; a client with another model is refused.
    liveness_s
        A client not heard from for this long is not live (not drawn for a cohort).
    on_change
        Called after each registration (the coordinator wakes its cohort wait).
    ledger
        The server's privacy ledger (None: the clients' own figures only).

    Raises
    ------
    ConfigError
        Without TLS and without an enrolment key: no client could prove an identity.
    """

    def __init__(
        self,
        tls: TlsConfig,
        *,
        num_params: int,
        liveness_s: float,
        on_change: Callable[[], None] | None = None,
        ledger: PrivacyLedger | None = None,
    ) -> None:
        #: the server's privacy ledger: the authority for each identity's epsilon
        self.ledger = ledger
        self._tls_directory = tls.directory
        # Checks the enrolment tokens of clients that have no certificate (TLS off, Flower).
        self._enrolment_key: bytes | None = None
        if tls.insecure or (tls.directory / ENROLMENT_KEY_FILE).exists():
            self._enrolment_key = load_enrolment_key(tls.directory)  # a clear error if absent
        self._num_params = num_params
        self._liveness_s = liveness_s
        #: called after each registration (the coordinator wakes its cohort wait)
        self.on_change = on_change
        self._lock = threading.Lock()
        self._clients: dict[str, RegisteredClient] = {}
        self._missed: set[str] = set()  # missed a deadline, not heard from since

    @property
    def clients(self) -> Mapping[str, RegisteredClient]:
        """The registered clients by client id (a read-only view)."""
        return MappingProxyType(self._clients)

    def __len__(self) -> int:
        return len(self._clients)

    # ------------------------------------------------------------------ authentication
    def register(
        self,
        name: str,
        num_examples: int,
        num_params: int,
        signing_key: bytes = b"",
        *,
        identity: str | None = None,
        enrolment_token: str = "",
        epsilon: float = 0.0,
        delta: float = 0.0,
        declared: Declaration | None = None,
    ) -> tuple[str, bytes]:
        """Register a client; returns its client id and a fresh credential.

        The client id is the client's provisioned identity: ``identity``, the common name of
        the caller's verified certificate under mutual TLS (the servicer passes it), or else
        the name that ``enrolment_token`` proves (:mod:`crypto.enrolment`). Registering an
        identity again (a restarted client) returns the same id with a new credential, and
        ``signing_key`` (the client's Ed25519 public key) replaces the one registered before.
        ``epsilon`` (at ``delta``) is what the client's ledger says it has spent already, and
        ``declared`` its data source and one round's DP-SGD (what the server's ledger records
        for each round released with it). A new signing key for a known identity, or a spend
        below the server's figure, is a WARNING (the server's figure stands).

        Raises
        ------
        UnauthenticatedError
            Neither a certificate identity nor a valid enrolment token.
        InvalidArgumentError
            A weak signing key, another model size, no training examples, an epsilon or
            delta out of range, or a declaration no accountant can compose.
        """
        _check_spend(epsilon, delta)
        declared = declared or Declaration()
        try:
            declared.check()
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        if is_weak_key(signing_key):
            raise InvalidArgumentError("registration needs a valid 32-byte Ed25519 signing key")
        if num_params != self._num_params:
            raise InvalidArgumentError(
                f"client model has {num_params} parameters, the run's model has {self._num_params}"
            )
        if num_examples < 1:
            raise InvalidArgumentError("a client needs at least one training example")
        client_id, how = self._identify(identity, enrolment_token)
        issued = secrets.token_bytes(32)
        with self._lock:
            known = self._clients.get(client_id)
            if known is not None:
                known.name = name or client_id
                known.num_examples = num_examples
                known.signing_key = signing_key.hex()
                known.credential_hash = hashlib.sha256(issued).hexdigest()
                known.last_seen = time.time()
                known.declare(declared)
                self._missed.discard(client_id)
            else:
                self._clients[client_id] = RegisteredClient(
                    name=name or client_id,
                    num_examples=num_examples,
                    signing_key=signing_key.hex(),
                    credential_hash=hashlib.sha256(issued).hexdigest(),
                )
                self._clients[client_id].declare(declared)
            self._clients[client_id].spent(epsilon, delta)
        self._second_opinion(client_id, signing_key, epsilon)
        if self.on_change is not None:
            self.on_change()
        _log.info(
            "%s %s by %s (%s, %d examples)",
            "re-registered" if known is not None else "registered",
            client_id,
            how,
            name,
            num_examples,
        )
        return client_id, issued

    def check_in(self, client_id: str, credential: bytes, *, epsilon: float, delta: float) -> None:
        """A client asks for a task: authenticate it, mark it live, keep its spend.

        Raises
        ------
        InvalidArgumentError
            An epsilon or delta out of range.
        UnknownClientError, UnauthenticatedError
            An id nobody registered, or a missing or wrong credential.
        """
        _check_spend(epsilon, delta)
        with self._lock:
            client = self._authenticated(client_id, credential)
            client.last_seen = time.time()
            self._missed.discard(client_id)
            client.spent(epsilon, delta)
        if self.ledger is not None:
            self.ledger.second_opinion(client_id, epsilon)

    def record_report(
        self,
        client_id: str,
        credential: bytes,
        *,
        epsilon: float,
        delta: float,
        bytes_pushed: int,
        budget_exhausted: bool,
        noise_multiplier: float | None = None,
    ) -> None:
        """A client reports a round: keep its spend, its bytes, whether its budget is out.

        Also the DP noise multiplier it trains with (``None``: not said, the last one stays).

        Raises
        ------
        InvalidArgumentError
            An epsilon, delta, noise multiplier or byte count out of range.
        UnknownClientError, UnauthenticatedError
            An id nobody registered, or a missing or wrong credential.
        """
        _check_spend(epsilon, delta)
        if not 0 <= bytes_pushed <= _MAX_REPORTED_BYTES:
            raise InvalidArgumentError(f"bytes_pushed must be in [0, {_MAX_REPORTED_BYTES}]")
        if noise_multiplier is not None and not noise_multiplier >= 0:
            raise InvalidArgumentError("noise_multiplier must be >= 0 (0: no DP noise)")
        with self._lock:
            client = self._authenticated(client_id, credential)
            client.spent(epsilon, delta)
            if noise_multiplier is not None:
                client.noise_multiplier = noise_multiplier
            client.bytes_pushed += bytes_pushed
            client.rounds += 1
            client.exhausted = client.exhausted or budget_exhausted
        if self.ledger is not None:
            self.ledger.second_opinion(client_id, epsilon)

    def _second_opinion(self, client_id: str, signing_key: bytes, epsilon: float) -> None:
        """A registration's warnings: a new signing key, a spend below the server's figure."""
        if self.ledger is None:
            return
        replaced = self.ledger.note_key(client_id, signing_key.hex())
        if replaced is not None:
            self.ledger.warn(
                client_id,
                f"{client_id} registered with a new signing key (a new state folder?); the "
                f"server's ledger of its released rounds stands (epsilon "
                f"{self.ledger.epsilon(client_id):.4f})",
            )
        self.ledger.second_opinion(client_id, epsilon, when="registered with")

    def _identify(self, identity: str | None, enrolment_token: str) -> tuple[str, str]:
        """The client id of a registration and how it was proven (certificate or token)."""
        if identity:
            return identity, "certificate"
        if not enrolment_token:
            raise UnauthenticatedError(
                "registration refused: present a client certificate of the deployment (mutual "
                "TLS) or, without TLS, the enrolment token from `fedps certs`"
            )
        if self._enrolment_key is None:
            raise UnauthenticatedError(
                "registration refused: this coordinator has no enrolment key to check tokens "
                f"({self._tls_directory / ENROLMENT_KEY_FILE}; `fedps certs` makes it)"
            )
        return verify_token(self._enrolment_key, enrolment_token), "enrolment token"

    def _authenticated(self, client_id: str, credential: bytes) -> RegisteredClient:
        client = self._clients.get(client_id)
        if client is None:
            raise UnknownClientError(f"unknown client {client_id!r}; register first")
        digest = hashlib.sha256(credential).hexdigest()
        if not credential or not hmac.compare_digest(digest, client.credential_hash):
            raise UnauthenticatedError(f"missing or wrong credential for {client_id!r}")
        return client

    # ------------------------------------------------------------------ cohorts
    def live(self) -> list[str]:
        """The ids of the clients heard from lately that still have privacy budget.

        And that missed no deadline since (:meth:`mark_missed`).
        """
        now = time.time()
        with self._lock:
            heard = [
                (cid, c.declaration())
                for cid, c in self._clients.items()
                if not c.exhausted
                and not c.excluded
                and now - c.last_seen < self._liveness_s
                and cid not in self._missed
            ]
        return [cid for cid, declared in heard if not self._spent_by_ledger(cid, declared)]

    def _spent_by_ledger(self, client_id: str, declared: Declaration) -> bool:
        return self.ledger is not None and self.ledger.spent_out(client_id, declared)

    def spent_out(self, client_id: str) -> bool:
        """Whether the server's ledger says one more round takes ``client_id`` past the target."""
        with self._lock:
            client = self._clients.get(client_id)
            declared = client.declaration() if client is not None else None
        return declared is not None and self._spent_by_ledger(client_id, declared)

    def spent_clients(self) -> list[str]:
        """The registered clients the server's ledger stopped: out of budget, whatever they say."""
        return [cid for cid in sorted(self.clients) if self.spent_out(cid)]

    def mark_missed(self, client_ids: Iterable[str], *, deadline: float) -> None:
        """Leave ``client_ids``, who did not report by ``deadline``, out of :meth:`live`.

        They were in a cohort and did not report by ``deadline`` (``time.time()``): each stays out
        until it asks for a task or registers again. A client heard from after ``deadline`` is alive
        and stays live.
        """
        with self._lock:
            missed = sorted(
                cid
                for cid in client_ids
                if cid in self._clients and self._clients[cid].last_seen < deadline
            )
            self._missed.update(missed)
        if missed:
            _log.info(
                "left out of cohorts until they ask for a task: %s (missed a deadline)",
                ", ".join(missed),
            )

    def exclude(self, client_ids: Iterable[str]) -> None:
        """Leave ``client_ids`` (blamed on evidence by the key holder) out of every later cohort."""
        with self._lock:
            fresh = sorted(
                c for c in client_ids if c in self._clients and not self._clients[c].excluded
            )
            for c in fresh:
                self._clients[c].excluded = True
        if fresh:
            _log.warning(
                "excluded from every later cohort: %s (blamed on evidence by the key holder)",
                ", ".join(fresh),
            )

    def usable(self) -> int:
        """How many registered clients still have privacy budget (theirs and the ledger's)."""
        with self._lock:
            left = [
                (cid, c.declaration())
                for cid, c in self._clients.items()
                if not (c.exhausted or c.excluded)
            ]
        return sum(1 for cid, declared in left if not self._spent_by_ledger(cid, declared))

    def declarations(self, client_ids: Iterable[str]) -> dict[str, Declaration]:
        """What each registered one of ``client_ids`` declared, by client id."""
        with self._lock:
            return {c: self._clients[c].declaration() for c in client_ids if c in self._clients}

    def record_released(
        self,
        run_id: str,
        round_: int,
        contributors: Iterable[str],
        noise_multiplier: float = 0.0,
        *,
        stop: threading.Event,
    ) -> bool:
        """Record round ``round_`` in the privacy ledger, retried until written.

        ``contributors``: who the key holder applied it with (none: nothing released), each
        with what it declared; at client level every registered client counts the round.
        Returns False only if ``stop`` is set first (a restarted coordinator records the round:
        the key holder repeats its answer).
        """
        if self.ledger is None:  # no server-side ledger: the clients' own figures only
            return True
        ledger = self.ledger
        return write_until_written(
            lambda: ledger.record_round(
                run_id,
                round_,
                contributors=self.declarations(contributors),
                members=self.declarations(self.clients),
                noise_multiplier=noise_multiplier,
            ),
            retry_on=PeerUnavailableError,  # e.g. a full disk: nothing was recorded
            failure=lambda exc: f"round {round_}: {exc}",
            stop=stop,
        )

    def most_examples(self, cohort: Iterable[str]) -> int:
        """The largest example count among the registered members of ``cohort``."""
        with self._lock:
            return max(
                (self._clients[c].num_examples for c in cohort if c in self._clients), default=0
            )

    def signing_keys(self, cohort: Iterable[str]) -> dict[str, bytes]:
        """The Ed25519 public key of each member of ``cohort``, by client id, sorted."""
        with self._lock:
            return {c: bytes.fromhex(self._clients[c].signing_key) for c in sorted(cohort)}

    # ------------------------------------------------------------------ privacy and traffic
    @property
    def max_epsilon(self) -> tuple[float, float]:
        """The largest epsilon of any client (:attr:`client_epsilons`), with its delta."""
        if self.ledger is None:
            with self._lock:
                worst = max(self._clients.values(), key=lambda c: c.epsilon, default=None)
                return (worst.epsilon, worst.delta) if worst else (0.0, 0.0)
        return max(self.client_epsilons.values(), default=0.0), self.ledger.delta

    @property
    def client_epsilons(self) -> dict[str, float]:
        """Each client's epsilon, by client id: the figure every report shows.

        The server's ledger's (its released rounds, every identity it recorded), or the
        largest the client reported where that is more; without a ledger the client's own.
        """
        reported = self.reported_epsilons
        if self.ledger is None:
            return reported
        server = self.ledger.epsilons()
        return {
            cid: max(server.get(cid, 0.0), reported.get(cid, 0.0))
            for cid in sorted({*server, *reported})
        }

    @property
    def reported_epsilons(self) -> dict[str, float]:
        """The largest epsilon each registered client reported itself, by client id."""
        with self._lock:
            return {cid: c.epsilon for cid, c in self._clients.items()}

    @property
    def warnings(self) -> list[str]:
        """The privacy warnings the operator should see (the latest), oldest first."""
        return self.ledger.warned()[0] if self.ledger is not None else []

    def flagged_clients(self) -> list[str]:
        """The clients a privacy warning named, sorted."""
        return self.ledger.warned()[1] if self.ledger is not None else []

    @property
    def client_noise_multipliers(self) -> dict[str, float]:
        """The noise multiplier each client last reported, by client id."""
        with self._lock:
            return {
                cid: c.noise_multiplier
                for cid, c in self._clients.items()
                if c.noise_multiplier is not None
            }

    @property
    def client_rounds(self) -> dict[str, int]:
        """How many rounds each registered client reported an update for, by client id."""
        with self._lock:
            return {cid: c.rounds for cid, c in self._clients.items()}

    @property
    def bytes_pushed(self) -> int:
        """Bytes of encrypted updates the clients report having pushed."""
        with self._lock:
            return sum(c.bytes_pushed for c in self._clients.values())

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, dict[str, object]]:
        """Every client's record, JSON-ready (what a checkpoint keeps)."""
        with self._lock:
            return {cid: asdict(c) for cid, c in self._clients.items()}

    def load_state_dict(self, state: Mapping[str, Mapping[str, object]]) -> None:
        """Replace the clients with those of :meth:`state_dict`, all of them live now."""
        clients = {cid: RegisteredClient(**c) for cid, c in state.items()}  # type: ignore[arg-type]
        for client in clients.values():
            client.last_seen = time.time()
        with self._lock:
            self._clients = clients
            self._missed.clear()
