"""``fedps bench --parties P``: key generation and one round's decryption, P parties against one.

Both settings run in one process, alternating, on the platform's scheme (the default
configuration's CKKS parameters) and an aggregate of ``clients`` encrypted updates of a model of
``size`` parameters (1M by default, the ``mlp1m`` model's order):

- **key generation**: one key holder's :meth:`crypto.SecretContext.generate` and save, against
  the P parties' collective generation (each party's
  :class:`~server.keyholder.party_key_generation.PartyKeyGeneration` start, every deal
  received, each finish writing its share and the joint context), all parties in this process
  one after the other: the work, not the network;
- **decryption**: one key holder's :meth:`crypto.SecretContext.open` (the canary check and the
  decryption of every block), against the combiner's
  :meth:`~server.keyholder.joint_keys.JointKeys.open_round` with ``T`` in-process parties
  (:class:`~server.keyholder.keyholder_party.KeyHolderParty`), each doing what it does for a
  round: unpacking the shards' packed sums it fetched, hashing them, its canaries, its check of
  the joint canaries, its flooded partial; then the combination and the decoding. The
  combiner asks the participants at once (threads of this process); no gRPC, no transfer.
  After each measurement the bench waits until every party has drawn its next round's
  flooding (:class:`crypto.partial_decryptor.PartialDecryptor`), as it does while a round
  trains: the first repeat draws it during the round, the later ones take it drawn.

Each figure is the median of ``repeats`` runs; the ratio is P parties over one key holder.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Collection
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from crypto import BlockEncryptor, CiphertextSum, CkksParams, PublicContext, SecretContext
from crypto.ciphertext_sum import pack_sums, unpack_blocks
from crypto.signing import BlockSigner
from crypto.threshold import KeyShare
from fedps.ckks_params import ckks_params
from fedps.config import load_config
from fedps.errors import InvalidArgumentError
from server.keyholder.joint_keys import JointKeys
from server.keyholder.keyholder_party import KeyHolderParty
from server.keyholder.party_key_generation import (
    PUBLIC_CONTEXT_FILE,
    SHARE_FILE,
    generate_in_one_process,
)

__all__ = ["render_parties", "run_parties_bench"]

_LAMBDA = 16
_SEED = b"fedps bench: the parties' common seed"
_DRAW_WAIT_S = 60.0


class _Shards:
    """The round's packed sums, as a party fetches and unpacks them."""

    def __init__(self, public: PublicContext, packed: list[bytes], contributors: list[str]) -> None:
        self._public, self._packed, self._contributors = public, packed, frozenset(contributors)

    def closed_contributors(self, round_: int) -> frozenset[str]:
        """Every round closed with the bench's clients."""
        return self._contributors

    def aggregate(self, round_: int, contributors: Collection[str]) -> tuple[list[int], np.ndarray]:
        """The sums, unpacked as the party unpacks what the shards send."""
        return list(range(len(self._packed))), unpack_blocks(self._public, self._packed)


def _generate_parties(params: CkksParams, parties: int, threshold: int, root: Path) -> None:
    """The collective key generation, every party in turn, each writing into its folder."""
    generations = generate_in_one_process(params, parties=parties, threshold=threshold, seed=_SEED)
    for j, generation in generations.items():
        generation.finish(root / f"party-{j}")


def _generate_one(params: CkksParams, directory: Path) -> None:
    """One key holder's key generation, saved as it saves it."""
    SecretContext.generate(params).save(directory)


def _aggregate(public: PublicContext, size: int, clients: int) -> list[bytes]:
    """``clients`` updates of ``size`` values encrypted under ``public``, summed, packed."""
    rng = np.random.default_rng(0)
    encryptor = BlockEncryptor(public)
    per_block = public.params.values_per_block
    blocks = -(-size // per_block)
    sums = [CiphertextSum(public) for _ in range(blocks)]
    for _ in range(clients):
        vector = np.zeros(blocks * per_block)
        vector[:size] = rng.uniform(-0.01, 0.01, size)
        for block, data in encryptor.encrypt(vector).items():
            sums[block].add_packed(data)
    return pack_sums(sums)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _joint_keys(
    root: Path, public: PublicContext, source: _Shards, parties: int, threshold: int
) -> tuple[JointKeys, dict[int, KeyHolderParty]]:
    """The combiner over the parties generated in ``root``, asking them in this process."""
    combiner = BlockSigner()
    signers = {j: BlockSigner() for j in range(1, parties + 1)}
    keys = {j: s.public_key for j, s in signers.items()}
    members = {
        j: KeyHolderParty(
            KeyShare.load(root / f"party-{j}" / SHARE_FILE),
            public,
            combiner_key=combiner.public_key,
            signer=signers[j],
            party_keys=keys,
            source=source,
            state_dir=root / f"party-{j}",
            min_quorum=2,
            lambda_bits=_LAMBDA,
        )
        for j in signers
    }
    joint = JointKeys(public, members, threshold=threshold, signer=combiner, lambda_bits=_LAMBDA)
    return joint, members


def run_parties_bench(
    *,
    parties: int = 3,
    threshold: int = 2,
    size: int = 1_000_000,
    clients: int = 2,
    repeats: int = 3,
    console: Console,
) -> dict[str, Any]:
    """Time key generation and one round's decryption, ``parties`` against one key holder.

    Parameters
    ----------
    parties
        P (above 1).
    threshold
        T.
    size
        The model's parameters.
    clients
        The updates the aggregate sums (at least 2: a party decrypts no fewer).
    repeats
        Runs of each setting, alternating.
    console
        Where progress is printed.

    Returns
    -------
    dict
        ``{"parties", "threshold", "size", "clients", "blocks", "repeats", "keygen_s": {"1",
        "P"}, "decrypt_s": {"1", "P"}, "keygen_ratio", "decrypt_ratio", "runs"}`` (medians in
        seconds; ``runs`` every measurement).

    Raises
    ------
    InvalidArgumentError
        ``parties`` not above 1, ``threshold`` not in ``1..parties``, fewer than 2 clients or
        no repeat.
    """
    if parties < 2 or not 1 <= threshold <= parties or clients < 2 or repeats < 1:
        raise InvalidArgumentError("--parties P above 1, 1 <= T <= P, 2+ clients, 1+ repeats")
    params = ckks_params(load_config(None))
    key = f"{parties}"
    runs: dict[str, dict[str, list[float]]] = {"keygen_s": {}, "decrypt_s": {}}
    with tempfile.TemporaryDirectory(prefix="fedps-parties-bench-") as tmp:
        root = Path(tmp)
        single = SecretContext.generate(params)
        single_rows = unpack_blocks(single.public, _aggregate(single.public, size, clients))
        _generate_parties(params, parties, threshold, root / "keys")
        public = PublicContext.from_bytes(
            (root / "keys" / "party-1" / PUBLIC_CONTEXT_FILE).read_bytes()
        )
        packed = _aggregate(public, size, clients)
        contributors = [f"client-{i}" for i in range(clients)]
        shards = _Shards(public, packed, contributors)
        joint, members = _joint_keys(root / "keys", public, shards, parties, threshold)
        joint_rows = unpack_blocks(public, packed)
        joint_c0 = joint_rows[:, : params.poly_modulus_degree]  # no pads: unblinded clients
        blocks = list(range(len(single_rows)))
        console.print(
            f"{parties} parties (any {threshold}) against one key holder: {size:,} parameters, "
            f"{len(blocks)} blocks, {repeats} repeats, alternating"
        )
        for r in range(1, repeats + 1):
            measured: dict[tuple[str, str], Callable[[], object]] = {
                ("keygen_s", "1"): partial(_generate_one, params, root / f"one-{r}"),
                ("keygen_s", key): partial(
                    _generate_parties, params, parties, threshold, root / f"parties-{r}"
                ),
                ("decrypt_s", "1"): partial(single.open, single_rows, noise_weight=clients),
                ("decrypt_s", key): partial(
                    joint.open_round, r, contributors, blocks, joint_rows, c0=joint_c0
                ),
            }
            for (what, setting), fn in measured.items():
                runs[what].setdefault(setting, []).append(_timed(fn))
                for member in members.values():  # the time between two rounds
                    member.wait_drawn(_DRAW_WAIT_S)
            console.print(
                f"repeat {r}: "
                + ", ".join(f"{w} P={s} {v[-1]:.3f}" for w in runs for s, v in runs[w].items())
            )
    medians = {w: {s: statistics.median(v) for s, v in runs[w].items()} for w in runs}
    return {
        "parties": parties,
        "threshold": threshold,
        "size": size,
        "clients": clients,
        "blocks": len(blocks),
        "repeats": repeats,
        "keygen_s": medians["keygen_s"],
        "decrypt_s": medians["decrypt_s"],
        "keygen_ratio": medians["keygen_s"][key] / medians["keygen_s"]["1"],
        "decrypt_ratio": medians["decrypt_s"][key] / medians["decrypt_s"]["1"],
        "runs": runs,
    }


def render_parties(result: dict[str, Any]) -> str:
    """The bench's two lines: key generation and decryption, P parties against one."""
    p = str(result["parties"])
    lines = [
        f"{result['parties']} key-holder parties (any {result['threshold']}) against one key "
        f"holder, {result['size']:,} parameters ({result['blocks']} blocks), median of "
        f"{result['repeats']}:"
    ]
    for what, name in (("keygen", "key generation"), ("decrypt", "one round's decryption")):
        seconds = result[f"{what}_s"]
        lines.append(
            f"  {name}: {seconds['1']:.3f} s one key holder, {seconds[p]:.3f} s parties "
            f"({result[f'{what}_ratio']:.2f}x)"
        )
    return "\n".join(lines)
