"""A Python process fedps starts (crypto/python_child.py) runs the parent's fedps and nothing
of the working directory."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import fedps
from crypto.python_child import child_environment, python_command


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
