"""Compressed rounds end to end on loopback: real clients (Opacus), real CKKS, real servers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from clients.error_feedback import RESIDUAL_FILE, ErrorFeedback
from crypto.quantized_packing import QuantizedPacking
from fedps.sharding.sparse_mask import SparseMask
from server.keyholder.keyholder import KeyHolder
from tests.conftest import RecordingClient, run_clients, start_cluster

pytestmark = pytest.mark.integration

_TRAINING = {"rounds": 2, "clients": 2, "min_quorum": 2, "deadline_s": 30.0, "lr": 0.3}


def _masks(keyholder: KeyHolder, rounds: int) -> list[SparseMask]:
    """The masks of rounds 1..``rounds`` (the key holder keeps their commit phases)."""
    masks = [keyholder.mask(r) for r in range(1, rounds + 1)]
    return [m for m in masks if m is not None]


def _average(sent: list[tuple[float, np.ndarray]]) -> np.ndarray:
    """The weighted average of ``(weight, update)`` pairs."""
    weights = np.array([w for w, _ in sent])
    average: np.ndarray = weights @ np.stack([d for _, d in sent]) / weights.sum()
    return average


@pytest.mark.parametrize("masked_training", [False, True])
def test_a_compressed_round_applies_the_selected_coordinates_of_every_update(
    tmp_path: Path, masked_training: bool
) -> None:
    # Prepare: density 0.1; with masked training, the clients train the mask alone
    compression = {"density": 0.1, "masked_training": masked_training}
    privacy = {"clipping": "per_sample"} if masked_training else {}
    cluster = start_cluster(tmp_path, training=_TRAINING, compression=compression, privacy=privacy)
    try:
        clients = [RecordingClient.open(cluster.config, index=i) for i in range(2)]
        initial = cluster.coordinator.evaluator.initial_vector()

        # Execute
        run_clients(clients)

        # Assert: each round moved the coordinates of its mask by the average of what the
        # clients trained there, and no other coordinate
        masks = _masks(cluster.keyholder, 2)
        expected = initial.copy()
        for round_, mask in enumerate(masks, start=1):
            average = _average([c.sent[round_] for c in clients])
            expected = expected + mask.scatter(mask.gather(average))
        applied = cluster.keyholder.params
        assert applied is not None
        touched = np.zeros(applied.size, dtype=bool)
        for mask in masks:
            touched[mask.indices()] = True
        assert np.array_equal(applied[~touched], initial[~touched])
        np.testing.assert_allclose(applied, expected, atol=1e-4)
        assert not np.array_equal(masks[0].indices(), masks[1].indices())
        assert all(m.size < applied.size for m in masks)
        if masked_training:  # what each client trained was its round's mask, nothing else
            for round_, mask in enumerate(masks, start=1):
                trained = np.zeros(applied.size, dtype=bool)
                trained[mask.indices()] = True
                assert all(not c.sent[round_][1][~trained].any() for c in clients)
    finally:
        cluster.stop()


def test_error_feedback_carries_what_a_round_did_not_send(tmp_path: Path) -> None:
    # Prepare
    compression = {"density": 0.1, "error_feedback": True}
    cluster = start_cluster(tmp_path, training=_TRAINING, compression=compression)
    try:
        clients = [RecordingClient.open(cluster.config, index=i) for i in range(2)]
        initial = cluster.coordinator.evaluator.initial_vector()

        # Execute
        run_clients(clients)

        # Assert: round 2 sent its own update plus round 1's unsent part; the residual is what
        # round 2 left, kept in the client's state folder
        first, second = _masks(cluster.keyholder, 2)
        expected = initial.copy()
        residuals: list[np.ndarray] = []
        totals: list[tuple[float, np.ndarray]] = []
        for client in clients:
            _, delta = client.sent[1]
            left = delta.copy()
            left[first.indices()] = 0.0
            weight2, delta2 = client.sent[2]
            total = delta2 + left
            totals.append((weight2, total))
            residual = total.copy()
            residual[second.indices()] = 0.0
            residuals.append(residual)
            feedback = client.pipeline.feedback
            assert feedback is not None
            np.testing.assert_array_equal(feedback.residual, residual)
            directory = client.state.directory
            assert directory is not None and (directory / RESIDUAL_FILE).exists()
            np.testing.assert_array_equal(
                ErrorFeedback(residual.size, directory).residual, residual
            )
        expected = expected + first.scatter(first.gather(_average([c.sent[1] for c in clients])))
        expected = expected + second.scatter(second.gather(_average(totals)))
        applied = cluster.keyholder.params
        assert applied is not None
        np.testing.assert_allclose(applied, expected, atol=1e-4)
    finally:
        cluster.stop()


class _RecordingPacking(QuantizedPacking):
    """A client's packing that keeps what it quantized, round after round."""

    quantized: list[np.ndarray]

    def quantize(self, values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        out = super().quantize(values, rng)
        self.quantized.append(out.copy())
        return out


def _recording(client: RecordingClient) -> _RecordingPacking:
    """Make ``client`` keep what it quantizes."""
    packing = client.session.packing
    assert packing is not None
    recording = _RecordingPacking(
        **{f.name: getattr(packing, f.name) for f in dataclasses.fields(packing)}
    )
    object.__setattr__(recording, "quantized", [])
    client.session.packing = recording
    return recording


@pytest.mark.parametrize("compression", [{"bits": 8}, {"bits": 8, "density": 0.1}])
def test_a_quantized_run_applies_exactly_the_sum_of_the_quantized_updates(
    tmp_path: Path, compression: dict[str, object]
) -> None:
    # Prepare
    cluster = start_cluster(tmp_path, training=_TRAINING, compression=compression)
    try:
        clients = [RecordingClient.open(cluster.config, index=i) for i in range(2)]
        packings = [_recording(c) for c in clients]
        initial = cluster.coordinator.evaluator.initial_vector()

        # Execute
        run_clients(clients)

        # Assert: each round applied the dequantized sum of what the clients quantized (exact
        # integers: decoding errs by nothing), within one step of the unquantized average
        packing = packings[0]
        expected = initial.copy()
        for round_ in (1, 2):
            mask = cluster.keyholder.mask(round_)
            summed = np.sum([p.quantized[round_ - 1] for p in packings], axis=0)
            applied_delta = packing.dequantize(summed, 2) / 2
            average = _average([c.sent[round_] for c in clients])
            sent = average if mask is None else mask.gather(average)
            assert np.abs(applied_delta - sent).max() <= packing.step
            expected = expected + (applied_delta if mask is None else mask.scatter(applied_delta))
        applied = cluster.keyholder.params
        assert applied is not None
        np.testing.assert_allclose(applied, expected, rtol=0, atol=1e-6)
        assert not np.allclose(applied, initial)
        # two values to a coefficient: the 3 blocks of the model travel as 2 (1 with the mask)
        assert cluster.keyholder.layout.num_blocks == 3
        assert cluster.keyholder.commits.num_blocks == (1 if "density" in compression else 2)
    finally:
        cluster.stop()
