"""A Python process fedps starts (crypto/python_child.py).

It runs the parent's fedps and nothing of the working directory, and stops once its parent is
gone.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import fedps
from crypto.python_child import PARENT_VARIABLE, child_environment, python_command
from tests.waiting import HANG_S, wait_for


def test_a_child_started_with_p_imports_this_fedps_and_nothing_of_the_working_directory(
    tmp_path: Path,
) -> None:
    # Prepare: a working directory with the user's own fedps.py; a child that finds packages
    # only through PYTHONPATH (-S: no site-packages, so no installed fedps either)
    (tmp_path / "fedps.py").write_text('raise SystemExit("the user\'s fedps.py ran")\n')
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "import fedps; print(fedps.__file__)"

    # Execute: as fedps starts a role or an encryption worker
    child = subprocess.run(
        python_command("-S", "-c", code),
        cwd=tmp_path,
        env=child_environment(env),
        capture_output=True,
        text=True,
        timeout=120,
    )

    # Assert: the fedps of this process (a checkout that is not installed included)
    assert child.returncode == 0, child.stderr
    assert Path(child.stdout.strip()) == Path(fedps.__file__).resolve()


# A parent that starts a watched child, prints the child's pid, then waits to be killed.
_PARENT = """
import subprocess, sys, time
from crypto.python_child import child_environment, python_command
child = subprocess.Popen(
    python_command("-c", sys.argv[1]), env=child_environment(), stdin=subprocess.DEVNULL
)
print(child.pid, flush=True)
time.sleep(3600)
"""
# The watched child: stops on SIGTERM only (the default action), after watching its parent.
_CHILD = """
import signal
from crypto.python_child import watch_parent
watch_parent(poll_s=0.05)
while True:
    signal.pause()
"""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie of a reaped child counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_child_stops_once_its_parent_is_killed() -> None:
    # Prepare: a parent process (as fedps demo or up) with a watched child (as a role)
    parent = subprocess.Popen(
        python_command("-c", _PARENT, _CHILD),
        env=child_environment(),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert _alive(child)

    # Execute: the parent is SIGKILLed (it can clean nothing up)
    parent.kill()
    parent.wait(timeout=HANG_S)

    # Assert: the child saw it and stopped by itself
    wait_for(lambda: not _alive(child), "the orphaned child stops")


def test_watching_takes_the_parent_out_of_the_environment() -> None:
    # Prepare: this process as a child of a fedps process
    env = child_environment()
    code = (
        "import os; from crypto.python_child import watch_parent, PARENT_VARIABLE; "
        "watch_parent(); print(PARENT_VARIABLE in os.environ)"
    )

    # Execute
    child = subprocess.run(
        python_command("-c", code), env=env, capture_output=True, text=True, timeout=HANG_S
    )

    # Assert: what it starts in turn is not watched against its parent
    assert env[PARENT_VARIABLE] == str(os.getpid())
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "False"
