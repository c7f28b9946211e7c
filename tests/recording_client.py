"""A real client process that records what it pushes, for a replay after it was killed.

``python -m tests.recording_client CONFIG INDEX STATE_DIR OUT_DIR`` runs
:class:`~tests.conftest.RecordingClient` on the client state in ``STATE_DIR`` (its identity and
privacy ledger survive a restart) and writes, before each push, the round's weight and delta
to ``OUT_DIR/sent-ROUND.npz`` and, after each push, the rounds every owning shard
acknowledged to ``OUT_DIR/acknowledged.json``. :func:`load_recorded` reads them back.
"""

from __future__ import annotations

import io
import json
import signal
import sys
from pathlib import Path

import numpy as np

from clients.edge_client import PreparedPush
from crypto.files import write_atomic
from fedps.config import load_config
from fedps.provisioning import setup_tls
from tests.conftest import RecordingClient
from tests.process_cluster import Recorded

__all__ = ["load_recorded"]


class _FileRecordingClient(RecordingClient):
    #: where it writes what it sent and which shards acknowledged it (set once opened)
    out: Path

    def prepare(self, round_: int, version: int, delta: np.ndarray) -> PreparedPush | None:
        prepared = super().prepare(round_, version, delta)
        buffer = io.BytesIO()
        np.savez(buffer, weight=np.array([self.weight]), delta=delta)
        write_atomic(self.out / f"sent-{round_}.npz", buffer.getvalue())
        return prepared

    def acknowledged_by(self, round_: int, sid: str) -> None:
        super().acknowledged_by(round_, sid)
        path = self.out / "acknowledged.json"
        before = set(json.loads(path.read_text())["acknowledged"]) if path.exists() else set()
        acknowledged = sorted(before | self.acknowledged)  # with the killed process's
        recorded = {"client_id": self.client_id, "acknowledged": acknowledged}
        write_atomic(self.out / "acknowledged.json", json.dumps(recorded).encode())


def load_recorded(out: Path) -> Recorded:
    """What a recording client process wrote to ``out``."""
    acknowledged = json.loads((out / "acknowledged.json").read_text())
    recorded = Recorded(acknowledged["client_id"], acknowledged=set(acknowledged["acknowledged"]))
    for path in out.glob("sent-*.npz"):
        with np.load(path) as data:
            round_ = int(path.stem.split("-")[1])
            recorded.sent[round_] = (float(data["weight"][0]), data["delta"])
    return recorded


def main(argv: list[str]) -> None:
    config_path, index, state_dir, out = argv
    config = load_config(Path(config_path))
    setup_tls(config.tls, f"client-{index}")  # its own certificate under mutual TLS
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    client = _FileRecordingClient.open(config, index=int(index), state_dir=Path(state_dir))
    client.out = Path(out)
    client.run(timeout_s=3600)


if __name__ == "__main__":
    main(sys.argv[1:])
