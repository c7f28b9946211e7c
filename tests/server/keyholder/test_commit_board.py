"""The key holder's commitment board, without gRPC: phases, refusals and its durable log."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from crypto.signed_update import SignedUpdate
from crypto.signing import BlockSigner, update_digest
from fedps.errors import InvalidArgumentError, RoundClosedError, UnknownClientError
from server.keyholder.commit_board import CommitBoard

Q = (1 << 45) - 229
BLOCKS = 3
RUN, CONTEXT = "run", "ctx"


def _board(
    directory: Path,
    bounds: tuple[float, float] = (0.1, 1.0),
    *,
    masked: bool = False,
    secret: bytes = b"s" * 32,
) -> CommitBoard:
    return CommitBoard(
        directory,
        secret=secret,
        num_blocks=BLOCKS,
        modulus=Q,
        sketch_count=1,
        weight_bounds=bounds,
        fsync=False,
        masked=masked,
    )


def _update(
    signer: BlockSigner,
    client: str,
    round_: int = 1,
    weight: float = 0.5,
    *,
    mask: tuple[bytes, ...] = (),
) -> SignedUpdate:
    roots = [os.urandom(32) for _ in range(BLOCKS)] + list(mask)
    nonce = os.urandom(16)
    digest = update_digest(
        run_id=RUN,
        round_=round_,
        client_id=client,
        context_id=CONTEXT,
        weight=weight,
        nonce=nonce,
        roots=roots,
        version=0,
    )
    return SignedUpdate(
        client_id=client,
        weight=weight,
        nonce=nonce,
        signature=signer.sign(digest),
        roots=tuple(roots),
        version=0,
    )


def _sketches(value: int = 7) -> bytes:
    return np.full(BLOCKS, value, dtype="<u8").tobytes()


def test_a_phase_survives_a_restart_even_under_another_configuration(tmp_path: Path) -> None:
    # Prepare: alice committed (weight 0.5) and the phase froze
    alice, bob = BlockSigner(), BlockSigner()
    board = _board(tmp_path)
    board.open(1, 0, RUN, CONTEXT, {"alice": alice.public_key, "bob": bob.public_key})
    board.commit(1, _update(alice, "alice"), _sketches())
    board.close(1, freeze=True)
    board.close_log()

    # Execute: restart with uniform weights only (what was accepted stays accepted)
    again = _board(tmp_path, bounds=(1.0, 1.0))

    # Assert
    phase = again.phase(1)
    assert sorted(phase.commitments) == ["alice"] and phase.frozen
    assert phase.commitments["alice"].sketches.tolist() == [[7, 7, 7]]
    assert again.seed(1) == board.seed(1)
    with pytest.raises(RoundClosedError, match="too late"):
        again.commit(1, _update(bob, "bob", weight=1.0), _sketches())


def test_commitments_are_refused_for_what_they_are(tmp_path: Path) -> None:
    # Prepare
    alice = BlockSigner()
    board = _board(tmp_path)
    with pytest.raises(RoundClosedError, match="not open"):
        board.commit(1, _update(alice, "alice"), _sketches())
    board.open(1, 0, RUN, CONTEXT, {"alice": alice.public_key})

    # Execute / Assert
    with pytest.raises(UnknownClientError):
        board.commit(1, _update(alice, "mallory"), _sketches())
    with pytest.raises(InvalidArgumentError, match="bounds"):
        board.commit(1, _update(alice, "alice", weight=5.0), _sketches())
    with pytest.raises(InvalidArgumentError, match="below the modulus"):
        board.commit(1, _update(alice, "alice"), _sketches(Q))
    with pytest.raises(InvalidArgumentError, match="signed"):
        board.commit(1, _update(BlockSigner(), "alice"), _sketches())
    with pytest.raises(InvalidArgumentError, match="at most"):
        board.challenge_seed(1, "x" * 1000)


def test_the_challenge_changes_with_the_cohort(tmp_path: Path) -> None:
    # Prepare: round 1 opened for alice, then (before any freeze) reopened for bob
    alice, bob = BlockSigner(), BlockSigner()
    board = _board(tmp_path)
    board.open(1, 0, RUN, CONTEXT, {"alice": alice.public_key})
    first = board.challenge_seed(1, "alice")

    # Execute
    board.open(1, 0, RUN, CONTEXT, {"bob": bob.public_key})

    # Assert: a member of the first cohort learnt nothing about the second's challenge
    assert board.challenge_seed(1, "bob") != first
    with pytest.raises(UnknownClientError):
        board.challenge_seed(1, "alice")


def test_a_masked_board_takes_only_commitments_under_the_rounds_mask(tmp_path: Path) -> None:
    # Prepare: sparsified updates; round 1 open for alice
    alice = BlockSigner()
    board = _board(tmp_path, masked=True)
    board.open(1, 0, RUN, CONTEXT, {"alice": alice.public_key})
    mask = board.mask_seed(1)

    # Execute / Assert: no mask, another mask, then the round's
    with pytest.raises(InvalidArgumentError, match="mask seed"):
        board.commit(1, _update(alice, "alice"), _sketches())
    with pytest.raises(InvalidArgumentError, match="another mask"):
        board.commit(1, _update(alice, "alice", mask=(os.urandom(32),)), _sketches())
    board.commit(1, _update(alice, "alice", mask=(mask,)), _sketches())
    assert board.close(1, freeze=True) == (["alice"], True)


def test_the_mask_seed_is_fresh_every_round_and_keyed_by_the_secret(tmp_path: Path) -> None:
    # Prepare: the same cohort on two boards of other secrets
    alice = BlockSigner()
    boards = [_board(tmp_path / name, masked=True, secret=os.urandom(32)) for name in ("a", "b")]
    for board in boards:
        for round_ in (1, 2):
            board.open(round_, 0, RUN, CONTEXT, {"alice": alice.public_key})

    # Execute
    seeds = {board.mask_seed(r) for board in boards for r in (1, 2)}

    # Assert: four rounds, four seeds; none is the challenge it comes from
    assert len(seeds) == 4
    assert not seeds & {board.seed(r) for board in boards for r in (1, 2)}
