"""Encryptions of zero drawn in worker processes (crypto/zero_worker.py): they encrypt as the
ones drawn in this process do, and a worker never runs the parent's script again."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from crypto import BlockEncryptor, CkksParams, SecretContext, unpack_block
from tests.role_processes import HANG_S

ROOT = Path(__file__).resolve().parents[2]


def test_blocks_encrypted_with_workers_and_background_zeros_decrypt() -> None:
    # Prepare: two parallel workers, and one drawing in the background
    keys = SecretContext.generate(CkksParams())
    n = keys.public.params.values_per_block
    vector = np.linspace(-0.5, 0.5, 6 * n)
    encryptor = BlockEncryptor(keys.public, workers=2)
    try:
        encryptor.precompute(4)  # split over the two workers
        encryptor.precompute_in_background(8)
        # Execute
        blocks = encryptor.encrypt(vector)
    finally:
        encryptor.close()
    # Assert
    decrypted = np.concatenate(
        [keys.decrypt(unpack_block(keys.public, blocks[b])) for b in range(6)]
    )
    np.testing.assert_allclose(decrypted, vector, atol=1e-4)


def test_a_script_without_a_main_guard_runs_once(tmp_path: Path) -> None:
    # Prepare: a user's script that draws zeros in workers and counts its own runs
    runs = tmp_path / "runs.txt"
    script = tmp_path / "user_script.py"
    script.write_text(
        textwrap.dedent(
            f"""
            from pathlib import Path
            from crypto import BlockEncryptor, CkksParams, SecretContext

            with Path({str(runs)!r}).open("a") as out:
                out.write("ran\\n")
            keys = SecretContext.generate(CkksParams())
            encryptor = BlockEncryptor(keys.public, workers=2)
            encryptor.precompute_in_background(2)
            encryptor.precompute(4)
            encryptor.encrypt([0.5] * 10)
            encryptor.close()
            """
        )
    )
    # Execute
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        check=False,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    # Assert: the script ran once, and nothing failed in a worker
    assert done.returncode == 0, done.stderr
    assert runs.read_text() == "ran\n"
    assert "Traceback" not in done.stderr


def test_a_users_crypto_module_in_the_working_directory_does_not_reach_a_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the user's own crypto.py where the client runs (the ``fedps`` command never
    # puts the working directory on its path, so only the workers could pick it up)
    (tmp_path / "crypto.py").write_text('raise SystemExit("the user\'s crypto.py ran")\n')
    monkeypatch.chdir(tmp_path)
    keys = SecretContext.generate(CkksParams())
    encryptor = BlockEncryptor(keys.public, workers=2)
    try:
        # Execute: draw zeros in worker processes started from that directory
        encryptor.precompute(4)
        encryptor.precompute_in_background(6)  # as a client does between rounds
        block = encryptor.encrypt(np.full(4, 0.25))[0]
    finally:
        encryptor.close()
    # Assert: the worker ran fedps's package (before: "the zero worker exited (1)")
    np.testing.assert_allclose(
        keys.decrypt(unpack_block(keys.public, block))[:4], [0.25] * 4, atol=1e-4
    )
