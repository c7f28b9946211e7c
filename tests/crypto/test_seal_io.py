"""The SEAL scratch directory (crypto/_seal_io.py): private, per process, removed at exit."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from crypto import _seal_io

REPO_ROOT = Path(__file__).resolve().parents[2]

# Serialise a public context (through the scratch directory), fork a child that exits
# normally (running the exit handlers it inherited), then exit: print the directory and
# whether it survived the child.
_SCRIPT = """
import os, sys
from crypto import CkksParams, SecretContext, _seal_io
from fedps.ckks_params import ckks_params
from fedps.config import load_config
keys = SecretContext.generate(ckks_params(load_config()))
assert keys.public.serialize()
root = _seal_io.scratch_root()
pid = os.fork()
if pid == 0:
    sys.exit(0)
os.waitpid(pid, 0)
print(root, os.path.isdir(root))
"""


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_scratch_directory_is_private_and_per_process() -> None:
    # Execute
    root = Path(_seal_io.scratch_root())

    # Assert
    assert root.is_dir()
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert _seal_io.scratch_root() == str(root)


def test_scratch_directory_is_removed_at_exit() -> None:
    # Execute
    result = _python(_SCRIPT)

    # Assert: the child left its parent's directory alone; the parent's exit removed it
    assert result.returncode == 0, result.stderr[-2000:]
    root, survived_child = result.stdout.split()
    assert survived_child == "True"
    assert Path(root).name.startswith("fedps-seal-")
    assert not Path(root).exists()


def test_the_directory_of_a_killed_process_goes_with_the_next_process_start() -> None:
    # Prepare: a process makes its directory and is SIGKILLed (no exit handler runs)
    killed = _python(
        "import os, signal; from crypto import _seal_io; "
        "print(_seal_io.scratch_root(), flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    )
    orphan = Path(killed.stdout.strip())
    ours = Path(_seal_io.scratch_root())  # a live process's directory stays
    assert killed.returncode == -9 and orphan.is_dir(), killed.stderr[-2000:]
    assert orphan.name.startswith("fedps-seal-") and orphan.name.split("-")[2].isdigit()

    # Execute: the next process makes its own directory
    result = _python("from crypto import _seal_io; print(_seal_io.scratch_root())")

    # Assert: the killed one's is gone, the live one's is not
    assert result.returncode == 0, result.stderr[-2000:]
    assert not orphan.exists()
    assert ours.is_dir()
