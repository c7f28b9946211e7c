"""The sweeper: what a process leaves when it is killed is cleaned up after it."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from crypto.python_child import child_environment, python_command
from fedps.errors import FedPSError
from fedps.runtime.sweeper import temporary_folder
from tests.processes_left import kill_left, marked_environment, processes_left
from tests.waiting import HANG_S

# A parent (as fedps demo) with a temporary folder and a child that ignores SIGTERM (a role
# whose stop hangs): prints the folder, then waits to be killed.
_PARENT = """
import subprocess, sys, time
from crypto.python_child import child_environment, python_command
from fedps.runtime.sweeper import temporary_folder
with temporary_folder("fedps-test-") as folder:
    code = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); signal.pause()"
    subprocess.Popen(python_command("-c", code), env=child_environment())
    print(folder, flush=True)
    time.sleep(3600)
"""


def test_a_killed_process_leaves_no_child_and_no_temporary_folder(tmp_path: Path) -> None:
    # Prepare
    env, mark = marked_environment({"TMPDIR": str(tmp_path)})
    parent = subprocess.Popen(
        python_command("-c", _PARENT),
        env=child_environment(env),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        folder = Path(parent.stdout.readline().strip())
        assert folder.is_dir()

        # Execute
        parent.kill()
        parent.wait(HANG_S)
        killed_at = time.monotonic()

        # Assert: the child that ignored SIGTERM was killed after the grace, then the folder
        # was removed, well within 5 s
        while (processes_left(mark) or folder.exists()) and time.monotonic() < killed_at + 5:
            time.sleep(0.05)
        assert not processes_left(mark), [str(p) for p in processes_left(mark)]
        assert not folder.exists()
    finally:
        kill_left(mark)


def test_a_folder_is_removed_at_the_end_of_its_block() -> None:
    # Execute
    with temporary_folder("fedps-test-") as folder:
        (folder / "state").mkdir()
    # Assert
    assert not folder.exists()


def test_a_failed_block_keeps_only_the_logs() -> None:
    # Prepare / Execute: a run failed with its logs, state and certificates in the folder
    with (
        pytest.raises(FedPSError),
        temporary_folder("fedps-test-", keep_on_error="state/logs") as folder,
    ):
        for name in ("state/logs/keyholder.log", "state/keyholder/key", "certs/ca.key"):
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(name)
        raise FedPSError("the run failed")
    # Assert: the logs are there, nothing else
    try:
        kept = sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
        assert kept == ["state", "state/logs", "state/logs/keyholder.log"]
    finally:
        shutil.rmtree(folder)
