"""A user's ``server.py`` (or ``crypto/``, ``clients``) in the working directory, first on
``sys.path``, hides fedps's top-level package of that name: importing fedps says so in one line,
and the ``fedps`` command prints only that line and exits with status 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]


def _python(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run this Python in ``cwd`` (first on its path) with fedps's checkout importable."""
    env = {**os.environ, "PYTHONPATH": str(_ROOT)}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_import_names_the_file_that_hides_a_package(tmp_path: Path) -> None:
    # Prepare
    (tmp_path / "server.py").write_text("print('the user server')\n")

    # Execute
    result = _python(tmp_path, "-c", "import fedps")

    # Assert
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last == (
        "fedps._layout.ShadowedPackageError: your file ./server.py hides fedps's 'server' "
        "package; rename it or run fedps from another directory"
    )
    assert "the user server" not in result.stdout  # found, never imported


def test_cli_prints_one_line_and_exits_2(tmp_path: Path) -> None:
    # Prepare
    (tmp_path / "server.py").write_text("")

    # Execute
    result = _python(tmp_path, "-m", "fedps.cli", "--help")

    # Assert
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == (
        "fedps: error: your file ./server.py hides fedps's 'server' package; rename it or run "
        "fedps from another directory\n"
    )


@pytest.mark.parametrize("name", ["crypto", "clients"])
def test_a_package_folder_hides_too(tmp_path: Path, name: str) -> None:
    # Prepare
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("")

    # Execute
    result = _python(tmp_path, "-m", "fedps.cli", "--help")

    # Assert
    assert result.returncode == 2
    assert result.stderr.startswith(f"fedps: error: your folder ./{name} hides fedps's '{name}'")
    assert "Traceback" not in result.stderr


def test_unrelated_files_and_plain_folders_do_not_stop_fedps(tmp_path: Path) -> None:
    # Prepare: a folder without __init__.py is a namespace portion, which a regular package
    # later on the path wins over
    (tmp_path / "task.py").write_text("")
    (tmp_path / "server").mkdir()

    # Execute
    result = _python(tmp_path, "-c", "import fedps, server; print(server.__file__)")

    # Assert
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == _ROOT / "server" / "__init__.py"
