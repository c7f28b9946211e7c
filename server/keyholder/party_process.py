"""A key-holder party as its own process: its folder, its key generation, then its checks.

``fedps keyholder --party i`` serves :class:`PartyProcess` ``i``. Its state folder (0700) is
``STATE_DIR/party-i``; it holds what only this party has: its share of the joint key
(``share.key``, 0600), its signing key, the ledger of the rounds it decrypted, and what it
shares with every party: the joint public context (``public.ctx``), every party's signing key
(``parties.json``) and the combiner's (``combiner.pub``, pinned on first use).

On a first start the parties generate the key together, each over the network
(:mod:`.party_key_generation`), with no process ever holding another's share:

1. each party asks every other one who it is (:meth:`PartyProcess.hello`: its signing key and a
   fresh random nonce); the common seed is the hash of every party's nonce, in index order;
2. each party deals: it sends party ``k`` (at the address the configuration gives it, over
   mutual TLS where the receiver checks the ``party-j`` certificate of the sender) its public
   share and the Shamir share of its secret it dealt to ``k``, with the digest of the seed it
   used (a party refuses a deal under another seed);
3. once it holds every party's deal, it writes its share and the joint public context, and
   serves partial decryptions (:class:`~.keyholder_party.KeyHolderParty`).

A restarted party reads its folder and serves at once. A key generation interrupted before every
party wrote its share does not resume (the deals lived in memory): remove the parties' folders
and start them again.

A key rotation is the same generation again, numbered, asked by the combiner
(:meth:`PartyProcess.rekey`), with a nonce of its own for each rotation; its share waits in
``next/`` until the combiner adopts the new context (:meth:`PartyProcess.adopt`,
:mod:`.party_rotation`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from crypto import CkksParams, PublicContext
from crypto.files import private_directory, write_atomic
from crypto.signing import BlockSigner, verify_block
from crypto.threshold import KeyShare
from fedps.errors import FedPSError, NotReadyError, PolicyError
from fedps.rpc.keyholder_party_messages import (
    AdoptRequest,
    DecryptionRequest,
    PartyCanaries,
    PartyDeal,
    PartyHello,
    RekeyRequest,
)
from fedps.rpc.keyholder_party_stub import KeyHolderPartyStub
from server.keyholder.keyholder_party import KeyHolderParty, RoundSource
from server.keyholder.party_key_generation import (
    PUBLIC_CONTEXT_FILE,
    SHARE_FILE,
    PartyKeyGeneration,
)
from server.keyholder.party_rotation import NEXT_DIR, adopt_next, finish_adopting, load_next

__all__ = ["PARTIES_FILE", "PartyProcess", "PartySettings", "party_folder"]

_log = logging.getLogger("fedps")

#: Every party's Ed25519 public key, by index, in the party's folder.
PARTIES_FILE = "parties.json"
_SIGNING_FILE = "signing.key"
_COMBINER_FILE = "combiner.pub"
_WAIT_LOG_S = 10.0  # how often a waiting key generation says whom it waits for


def party_folder(state_dir: Path, index: int) -> Path:
    """The state folder of party ``index`` under the cluster's ``state_dir``."""
    return state_dir / f"party-{index}"


@dataclass(frozen=True)
class PartySettings:
    """What one party needs to know of the cluster.

    Attributes
    ----------
    index
        This party's index in ``1..P``.
    addresses
        Every party's address, by index (this one's included).
    threshold
        T.
    params
        The scheme parameters of the joint key.
    min_quorum
        The fewest contributors of an aggregate the party decrypts.
    lambda_bits
        The statistical security of its flooding.
    """

    index: int
    addresses: Mapping[int, str]
    threshold: int
    params: CkksParams
    min_quorum: int
    lambda_bits: int


class PartyProcess:
    """Party ``settings.index`` in its folder: key generation first, then its checked answers.

    Parameters
    ----------
    settings
        The party's view of the cluster.
    folder
        Its state folder.
    source
        The coordinator and the shards as the party asks them, given the joint public context.
    combiner_key
        Fetches the combiner's Ed25519 public key (asked once, then pinned in the folder).
    """

    def __init__(
        self,
        settings: PartySettings,
        folder: Path,
        *,
        source: Callable[[PublicContext], RoundSource],
        combiner_key: Callable[[PublicContext], bytes],
    ) -> None:
        self.settings = settings
        self.folder = folder
        self._source = source
        self._combiner_key = combiner_key
        self._nonces = {0: secrets.token_bytes(32)}  # by generation (0: the first)
        self._lock = threading.Lock()
        self._signer: BlockSigner | None = None
        self._share: KeyShare | None = None
        self._public: PublicContext | None = None
        self._party_keys: dict[int, bytes] = {}
        self._party: KeyHolderParty | None = None
        self._generation: PartyKeyGeneration | None = None
        self._generation_number = 0  # which generation ``_generation`` is (0: the first)
        self._seed_digest = b""
        self._pending: dict[int, PartyDeal] = {}  # deals before this party's seed, by sender
        self._rekey: tuple[int, threading.Event] | None = None  # a rotation's number, its stop
        self._next: tuple[KeyShare, PublicContext] | None = None  # its share, not adopted yet
        self._peers: Mapping[int, KeyHolderPartyStub] = {}
        self._stop = threading.Event()

    @property
    def index(self) -> int:
        """The party's index in ``1..P``."""
        return self.settings.index

    @property
    def ready(self) -> bool:
        """Whether the party holds its share (its key generation finished, or was read back)."""
        return self._share is not None

    def open(self) -> PartyProcess:
        """Create the folder (0700) and the signing key; read the share back if there is one."""
        private_directory(self.folder)
        self._signer = BlockSigner.load_or_create(self.folder / _SIGNING_FILE)
        finish_adopting(self.folder)  # a rotation's adopt that a stop interrupted
        self._next = load_next(self.folder)
        if (self.folder / SHARE_FILE).exists():
            share = KeyShare.load(self.folder / SHARE_FILE)
            public = PublicContext.from_bytes((self.folder / PUBLIC_CONTEXT_FILE).read_bytes())
            keys = json.loads((self.folder / PARTIES_FILE).read_text())
            self._set_keys(share, public, {int(j): bytes.fromhex(k) for j, k in keys.items()})
            _log.info("party %d: key share read back from %s", self.index, self.folder)
        return self

    def connect(self, peers: Mapping[int, KeyHolderPartyStub], stop: threading.Event) -> None:
        """The other parties (for the key generations) and what stops them (the process's)."""
        self._peers, self._stop = dict(peers), stop

    def hello(self, generation: int = 0) -> PartyHello:
        """Who this party is, with its nonce of ``generation``; its joint context(s) once made.

        A rotation's nonce exists only once the combiner asked this party for that rotation
        (:meth:`rekey`): a caller naming another rotation cannot move the party on, nor make it
        refuse the combiner's next rotation as one that is over.

        Raises
        ------
        PolicyError
            ``generation`` is a rotation older than the last one asked about.
        NotReadyError
            ``generation`` is a later rotation than the one the combiner asked for (the peer
            asks again once the combiner's request arrived).
        """
        public, waiting = self._public, self._next
        with self._lock:
            if generation not in self._nonces:
                if generation < max(self._nonces):  # an old rotation's: never handed out again
                    raise PolicyError(f"party {self.index}: rotation {generation} is over")
                if self._rekey is None or self._rekey[0] != generation:
                    raise NotReadyError(
                        f"party {self.index} was not asked for rotation {generation} (yet)"
                    )
                self._nonces = {0: self._nonces[0], generation: secrets.token_bytes(32)}
            nonce = self._nonces[generation]
            keygen = self._generation if self._generation_number == generation else None
            commitment = keygen.commitment if keygen is not None else b""
        return PartyHello(
            self.index,
            self._require_signer().public_key,
            nonce,
            public.serialize() if public is not None else b"",
            waiting[1].serialize() if waiting is not None else b"",
            commitment,
        )

    def rekey(self, request: RekeyRequest) -> bool:
        """Start rotation ``request.generation``'s key generation; whether it started.

        The current share stays in use; the new one waits in ``next/`` for :meth:`adopt`.

        Raises
        ------
        PolicyError
            The request is not the combiner's, or replaces another context than this party's.
        NotReadyError
            The party has no share yet.
        """
        public = self._require_public()
        if not verify_block(self._pinned_combiner_key(public), request.digest(), request.signature):
            raise PolicyError("the rekey is not signed by the combiner")
        if request.context_id != public.context_id:
            raise PolicyError(f"party {self.index} is not on context {request.context_id[:16]}")
        with self._lock:
            if self._rekey is not None and self._rekey[0] >= request.generation:
                return False
            if self._rekey is not None:
                self._rekey[1].set()  # an unfinished one is given up
            stop = threading.Event()
            self._rekey, self._next, self._generation = (request.generation, stop), None, None
        for name in (SHARE_FILE, PUBLIC_CONTEXT_FILE):
            (self.folder / NEXT_DIR / name).unlink(missing_ok=True)
        threading.Thread(target=_either, args=(self._stop, stop), daemon=True).start()
        threading.Thread(
            target=self.generate,
            args=(self._peers, stop, request.generation),
            name=f"rekey-{request.generation}",
            daemon=True,
        ).start()
        _log.info("party %d: key rotation %d started", self.index, request.generation)
        return True

    def adopt(self, request: AdoptRequest) -> bool:
        """Replace the share by the rotation's new one; whether anything changed.

        Raises
        ------
        PolicyError
            The request is not the combiner's, or this party holds no new share of that context.
        NotReadyError
            The party has no share yet.
        """
        public = self._require_public()
        if not verify_block(self._pinned_combiner_key(public), request.digest(), request.signature):
            raise PolicyError("the adopt is not signed by the combiner")
        if request.context_id == public.context_id:
            return False
        with self._lock:
            waiting = self._next
            if waiting is None or waiting[1].context_id != request.context_id:
                raise PolicyError(
                    f"party {self.index} holds no new share of context {request.context_id[:16]}"
                )
            adopt_next(self.folder)
            self._share, self._public, self._next = waiting[0], waiting[1], None
            self._party = None  # rebuilt on the new share at the next request; the old dropped
        _log.info(
            "party %d: adopted the rotated joint context %s", self.index, request.context_id[:16]
        )
        return True

    def receive_deal(self, deal: PartyDeal, caller: str | None) -> None:
        """Party ``deal.sender``'s deal to this party, from the certificate ``caller``.

        ``caller`` is the common name of the caller's verified certificate, ``None`` without TLS.

        Raises
        ------
        PolicyError
            The caller is not party ``deal.sender``, the deal is under another seed, or this
            party's key generation finished.
        """
        if caller is not None and caller != f"party-{deal.sender}":
            raise PolicyError(f"certificate {caller!r} may not deal as party {deal.sender}")
        with self._lock:
            if self.ready and self._rekey is None:
                raise PolicyError(f"party {self.index}'s key generation finished already")
            if self._generation is None:
                self._pending[deal.sender] = deal
            else:
                self._apply(deal)

    def _apply(self, deal: PartyDeal) -> None:
        """Hand a deal to the generation (under the lock)."""
        generation = self._generation
        assert generation is not None
        if deal.seed_digest != self._seed_digest:
            raise PolicyError(f"party {deal.sender} dealt under another common seed")
        generation.receive(
            deal.sender,
            public_share=PartyDeal.poly(deal.public_share),
            dealt=PartyDeal.poly(deal.dealt),
        )

    def generate(
        self, peers: Mapping[int, KeyHolderPartyStub], stop: threading.Event, generation: int = 0
    ) -> None:
        """Run the key generation with ``peers`` (every other party) until done or ``stop``.

        Each step is retried while a party is unreachable (it may start later), with one
        line every few seconds naming those waited for. ``generation`` above 0: a rotation's
        (:meth:`rekey`), written into ``next/``.
        """
        hellos = self._hellos(peers, stop, generation)
        if hellos is None:
            return
        signer = self._require_signer()
        mine = self.hello(generation).nonce
        nonces = {self.index: mine, **{j: h.nonce for j, h in hellos.items()}}
        rotation = generation.to_bytes(8, "little") if generation else b""
        seed = hashlib.sha256(
            b"fedps-party-keygen-v1" + rotation + b"".join(nonces[j] for j in sorted(nonces))
        ).digest()
        s = self.settings
        keygen = PartyKeyGeneration(
            self.index, parties=len(s.addresses), threshold=s.threshold, params=s.params, seed=seed
        )
        keygen.start()
        seed_digest = hashlib.sha256(seed).digest()
        with self._lock:
            self._generation, self._seed_digest = keygen, seed_digest
            self._generation_number = generation
            pending, self._pending = self._pending, {}
            for deal in pending.values():
                if deal.seed_digest == seed_digest:  # others: an earlier generation's
                    self._apply(deal)

        def commit(j: int, stub: KeyHolderPartyStub) -> bool:
            answer = stub.hello(generation)
            if answer.party != j or not answer.commitment:  # not started yet: asked again
                return False
            with self._lock:
                keygen.commit(j, answer.commitment)
            return True

        # every party's commitment before anything of this one's public share leaves
        if self._gather_each(peers, stop, "commitment", commit) is None:
            return
        public_share = keygen.public_share.astype("<u8").tobytes()

        def send(j: int, stub: KeyHolderPartyStub) -> bool:
            dealt = keygen.dealt_to(j).astype("<u8").tobytes()
            stub.deal(PartyDeal(self.index, seed_digest, public_share, dealt))
            return True

        if self._gather_each(peers, stop, "deal", send) is None:
            return
        folder = self.folder / NEXT_DIR if generation else self.folder
        while not stop.is_set():
            with self._lock:  # a later rotation's rekey sets ``stop`` under this lock
                if stop.is_set():
                    return
                try:
                    share, public = keygen.finish(folder)
                except NotReadyError:
                    share = None
                except PolicyError as exc:  # a party dealt another share than it committed
                    _log.error(
                        "party %d: key generation %d refused: %s", self.index, generation, exc
                    )
                    return
            if share is not None:
                break
            stop.wait(0.05)
        else:
            return
        if generation:
            with self._lock:
                if stop.is_set():  # a later rotation started since: its share, not this one
                    return
                self._next, self._generation = (share, public), None
            _log.info(
                "party %d: key rotation %d made context %s; it waits for the combiner",
                self.index,
                generation,
                public.context_id[:16],
            )
            return
        keys = {self.index: signer.public_key, **{j: h.signing_key for j, h in hellos.items()}}
        payload = json.dumps({str(j): k.hex() for j, k in sorted(keys.items())})
        write_atomic(self.folder / PARTIES_FILE, payload.encode())
        with self._lock:
            self._set_keys(share, public, keys)
            self._generation = None
        _log.info(
            "party %d: key generation finished (%d-of-%d), joint context %s",
            self.index,
            s.threshold,
            len(s.addresses),
            public.context_id[:16],
        )

    def _hellos(
        self, peers: Mapping[int, KeyHolderPartyStub], stop: threading.Event, generation: int
    ) -> dict[int, PartyHello] | None:
        """Every peer's hello of ``generation``; None on ``stop``."""
        answers: dict[int, PartyHello] = {}

        def step(j: int, stub: KeyHolderPartyStub) -> bool:
            answer = stub.hello(generation)
            if answer.party != j:
                raise PolicyError(f"the party at {self.settings.addresses[j]} is not party {j}")
            answers[j] = answer
            return True

        return answers if self._gather_each(peers, stop, "hello", step) is not None else None

    def _gather_each(
        self,
        peers: Mapping[int, KeyHolderPartyStub],
        stop: threading.Event,
        what: str,
        step: Callable[[int, KeyHolderPartyStub], bool],
    ) -> set[int] | None:
        """Retry ``step`` for every peer until each returned True; None on ``stop``."""
        done: set[int] = set()
        said = time.monotonic()
        while not stop.is_set():
            for j, stub in peers.items():
                if j not in done:
                    try:
                        if step(j, stub):
                            done.add(j)
                    except FedPSError as exc:  # not up yet, or refused: asked again
                        _log.debug("party %d: %s of party %d: %s", self.index, what, j, exc)
            if len(done) == len(peers):
                return done
            if time.monotonic() - said > _WAIT_LOG_S:
                said = time.monotonic()
                waiting = sorted(set(peers) - done)
                _log.info(
                    "party %d: key generation waits for parties %s (%s)", self.index, waiting, what
                )
            stop.wait(0.2)
        return None

    def _set_keys(self, share: KeyShare, public: PublicContext, keys: dict[int, bytes]) -> None:
        self._share, self._public, self._party_keys = share, public, keys

    def _require_public(self) -> PublicContext:
        if self._public is None:
            raise NotReadyError(f"party {self.index}'s key generation has not finished")
        return self._public

    def _require_signer(self) -> BlockSigner:
        if self._signer is None:
            raise NotReadyError(f"party {self.index} is not open")
        return self._signer

    def _ready_party(self) -> KeyHolderParty:
        """The party's checks and share, built at the first request (after the combiner's key)."""
        with self._lock:
            if self._party is not None:
                return self._party
            share, public = self._share, self._public
            if share is None or public is None:
                raise NotReadyError(f"party {self.index}'s key generation has not finished")
            self._party = KeyHolderParty(
                share,
                public,
                combiner_key=self._pinned_combiner_key(public),
                signer=self._require_signer(),
                party_keys=self._party_keys,
                source=self._source(public),
                state_dir=self.folder,
                min_quorum=self.settings.min_quorum,
                lambda_bits=self.settings.lambda_bits,
            )
            return self._party

    def _pinned_combiner_key(self, public: PublicContext) -> bytes:
        path = self.folder / _COMBINER_FILE
        if path.exists():
            return bytes.fromhex(path.read_text().strip())
        key = self._combiner_key(public)
        write_atomic(path, key.hex().encode() + b"\n")
        return key

    def canary_partial(self, request: DecryptionRequest) -> PartyCanaries:
        """:meth:`KeyHolderParty.canary_partial`, once the party has its share."""
        return self._ready_party().canary_partial(request)

    def partial_decrypt(self, request: DecryptionRequest) -> np.ndarray:
        """:meth:`KeyHolderParty.partial_decrypt`, once the party has its share."""
        return self._ready_party().partial_decrypt(request)

    def prepare(self, request: DecryptionRequest) -> bool:
        """:meth:`KeyHolderParty.prepare`, once the party has its share."""
        return self._ready_party().prepare(request)


def _either(outer: threading.Event, inner: threading.Event) -> None:
    """Set ``inner`` once ``outer`` is set (return once ``inner`` is)."""
    while not inner.wait(0.5):
        if outer.is_set():
            inner.set()
