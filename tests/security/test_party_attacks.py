"""A shard with ``T - 1`` key-holder parties against the other parties, as real processes.

P = 3 parties, T = 2, each its own ``fedps keyholder --party`` process. The coalition is a
shard (it stores every client's ciphertext and sums any set of them) and party 1 (its share
and its folder); it even holds the combiner's signing key, so every request it sends is signed
as the combiner's. (Its shard serves what it holds: a shard that serves another aggregate
together with the combiner is the row "the combiner and one shard" of docs/security.md.) It
tries to read one client's update of a finished round: with party 1's share alone, and by
asking parties 2 and 3 themselves for one client's ciphertext (a one-client "aggregate"), a
sub-cohort of the round, a replay of an older round with another aggregate, and a request
party 1 signed. Each party refuses on its own check and nothing of the update is recovered.
(The control: parties 1 and 2's shares together do decrypt it.) The coalition is even given
the victim's pad seeds (crypto.blinding), so that the shares alone are what is tested.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from crypto import PublicContext
from crypto import threshold as th
from crypto.blinding import Blinding
from crypto.ckks_encoder import CkksEncoder
from crypto.signing import BlockSigner
from fedps.config import FedPSConfig
from fedps.errors import FedPSError, PolicyError
from fedps.rpc.keyholder_party_messages import DecryptionRequest
from fedps.rpc.keyholder_party_stub import KeyHolderPartyStub
from fedps.runtime.deployment import Deployment
from server.keyholder.party_key_generation import PUBLIC_CONTEXT_FILE, SHARE_FILE
from server.keyholder.party_process import party_folder
from server.serve import party_round_source
from tests.conftest import RecordingClient, run_clients
from tests.party_processes import THRESHOLD, party_config
from tests.process_cluster import wait_for_round

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.attack]

ROUNDS, CLIENTS = 2, 3
VICTIM = "client-0"


@dataclass
class Run:
    """A finished run whose servers still serve, and what the victim pushed."""

    config: FedPSConfig
    public: PublicContext
    victim: dict[int, np.ndarray]  # round -> the victim's update
    members: tuple[str, ...]
    victim_pads: dict[int, bytes]  # round -> the victim's pad seed


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    tmp_path = tmp_path_factory.mktemp("party-attacks")
    config, path = party_config(tmp_path, rounds=ROUNDS, clients=CLIENTS)
    deployment = Deployment(path, config)
    try:
        deployment.start_servers()
        clients = [RecordingClient.open(config, index=i) for i in range(CLIENTS)]
        run_clients(clients)
        wait_for_round(config, ROUNDS, finished=True)
        folder = party_folder(config.cluster.state_dir, 1)
        public = PublicContext.from_bytes((folder / PUBLIC_CONTEXT_FILE).read_bytes())
        victim = next(c for c in clients if c.client_id == VICTIM)
        members = tuple(sorted(c.client_id for c in clients))
        updates = {r: d for r, (_, d) in victim.sent.items()}
        yield Run(config, public, updates, members, dict(victim.pad_seeds))
    finally:
        deployment.stop()


def _stolen(run: Run, round_: int, contributors: list[str]) -> tuple[list[int], np.ndarray]:
    """What the shards hold of ``contributors``' pushes to ``round_``, summed: blocks, rows."""
    return party_round_source(run.config, run.public).aggregate(round_, contributors)


def _share(run: Run, index: int) -> th.KeyShare:
    return th.KeyShare.load(party_folder(run.config.cluster.state_dir, index) / SHARE_FILE)


def _decrypt(run: Run, rows: np.ndarray, shares: list[th.KeyShare], length: int) -> np.ndarray:
    """``c0 + sum c1 lambda_j sh_j`` with the coalition's ``shares``, decoded (no flooding)."""
    n = run.public.params.poly_modulus_degree
    participants = sorted({s.index for s in shares} | {1, 2})[:THRESHOLD]
    partials = [
        th.partial_decryption(s, rows[:, n:], participants=participants, sigma=0.0) for s in shares
    ]
    plain = th.combine(rows[:, :n], partials, run.public.modulus)
    decoded = CkksEncoder(run.public.params, run.public.modulus).decode(plain)
    values: np.ndarray = decoded.reshape(-1)[:length]
    return values


def _correlation(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(a, b)[0, 1])


def test_a_shard_with_one_party_share_reads_nothing_of_one_update(run: Run) -> None:
    # Prepare: the victim's stored ciphertext of the last round, as the shards hold it
    update = run.victim[ROUNDS]
    blocks, padded = _stolen(run, ROUNDS, [VICTIM])
    blinding = Blinding(run.public.params, run.public.modulus)
    rows = blinding.remove(padded, blocks, [(run.victim_pads[ROUNDS], 1)])
    # Execute: the coalition's share alone; the control: T shares
    alone = _decrypt(run, rows, [_share(run, 1)], update.size)
    together = _decrypt(run, rows, [_share(run, 1), _share(run, 2)], update.size)
    # Assert: the control recovers the update, one share nothing of it
    assert _correlation(together, update) > 0.99
    assert abs(_correlation(alone, update)) < 0.1


def _request(
    signer: BlockSigner, round_: int, contributors: tuple[str, ...], aggregate: bytes
) -> DecryptionRequest:
    participants = (2, 3)
    digest = th.request_digest(round_, contributors, participants, aggregate)
    return DecryptionRequest(round_, contributors, participants, aggregate, signer.sign(digest))


def _combiner(run: Run) -> BlockSigner:
    """The combiner's signing key (the coalition holds it: the strongest case)."""
    return BlockSigner.load_or_create(
        run.config.cluster.state_dir / "keyholder" / "keys" / "signing.key"
    )


#: What the coalition asks, and the line of the party's own check that refuses it.
def _asks(run: Run) -> dict[str, tuple[DecryptionRequest, str]]:
    combiner = _combiner(run)
    one = (VICTIM,)
    sub = run.members[:2]
    victim_digest = th.aggregate_digest(*_stolen(run, ROUNDS, [VICTIM]))
    sub_digest = th.aggregate_digest(*_stolen(run, ROUNDS, list(sub)))
    old_victim = th.aggregate_digest(*_stolen(run, 1, [VICTIM]))
    party1 = BlockSigner.load_or_create(
        party_folder(run.config.cluster.state_dir, 1) / "signing.key"
    )
    return {
        "one stored ciphertext": (
            _request(combiner, ROUNDS, one, victim_digest),
            "fewer than the minimum",
        ),
        "sub-cohort": (
            _request(combiner, ROUNDS, sub, sub_digest),
            "not the 3 the coordinator closed the round with",
        ),
        "replay of round 1 with one client's ciphertext": (
            _request(combiner, 1, run.members, old_victim),
            "not the one the combiner verified",
        ),
        "signed by party 1, not the combiner": (
            _request(party1, ROUNDS, run.members, victim_digest),
            "not signed by the combiner",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "one stored ciphertext",
        "sub-cohort",
        "replay of round 1 with one client's ciphertext",
        "signed by party 1, not the combiner",
    ],
)
def test_the_other_parties_refuse_what_the_round_did_not_close(run: Run, case: str) -> None:
    # Prepare
    request, refusal = _asks(run)[case]
    n = run.public.params.poly_modulus_degree
    for j in (2, 3):
        party = KeyHolderPartyStub(run.config.cluster.parties[j - 1], n=n)
        try:
            # Execute / Assert: the canaries and the partial, each refused by the party itself
            with pytest.raises(PolicyError, match=refusal):
                party.canary_partial(request)
            with pytest.raises(FedPSError):
                party.partial_decrypt(request)
        finally:
            party.close()
