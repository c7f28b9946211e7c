"""The core install is a server's: a shard and a key holder run without any extra, and what
needs one says which, in one line.

The roles run as real processes in which every module an extra installs is missing (a
``sitecustomize`` on their path refuses to import them, as a fresh ``pip install fedps``
would), so an import of torch or Opacus anywhere on their path stops them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fedps.extras import EXTRA_OF
from fedps.rpc.shard_stub import ShardStub
from tests.role_processes import HANG_S, last_line, wait_listening, write_local_config

REPO_ROOT = Path(__file__).resolve().parents[1]

_BLOCKER = f"""
import sys
from importlib.abc import MetaPathFinder

class _NotInstalled(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {sorted(EXTRA_OF)!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
"""


def _core_env(tmp_path: Path) -> dict[str, str]:
    """An environment whose Python cannot import anything an extra installs."""
    site = tmp_path / "core-only"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_BLOCKER)
    return {**os.environ, "PYTHONPATH": str(site), "PYTHONUNBUFFERED": "1"}


def _fedps(env: dict[str, str], *args: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "fedps.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def test_the_core_dependencies_hold_no_training_flower_ui_or_plotting() -> None:
    # Prepare
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    core = {d.split("=")[0].split(">")[0].split("<")[0].strip() for d in project["dependencies"]}
    extras = project["optional-dependencies"]
    # Assert: none of the heavy packages in the core; each in the extra the code names
    for heavy in ("torch", "opacus", "scikit-learn", "flwr", "starlette", "uvicorn", "matplotlib"):
        assert heavy not in core
    for module, extra in EXTRA_OF.items():
        name = {"sklearn": "scikit-learn", "flwr": "flwr"}.get(module, module)
        assert any(d.startswith(name) for d in extras[extra]), (module, extra)
    assert set(extras["all"][0].split("[")[1].rstrip("]").split(",")) == {
        "client",
        "flower",
        "ui",
        "experiments",
    }


@pytest.mark.slow
@pytest.mark.integration
def test_a_shard_and_a_key_holder_serve_without_any_extra(tmp_path: Path) -> None:
    # Prepare
    path, config = write_local_config(tmp_path)
    env = _core_env(tmp_path)
    # Execute: both roles, in processes where torch, Opacus, Flower ... cannot be imported
    keyholder = _fedps(env, "keyholder", "--config", str(path), log=tmp_path / "kh.log")
    shard = _fedps(env, "shard", "--index", "0", "--config", str(path), log=tmp_path / "s.log")
    try:
        wait_listening(config.cluster.keyholder, keyholder)
        wait_listening(config.cluster.shards[0], shard)
        client = ShardStub("shard-0", config.cluster.shards[0])
        try:
            status = client.get_status(timeout_s=30)
        finally:
            client.close()
        # Assert: both serve
        assert status.shard_id == "shard-0"
        assert keyholder.poll() is None and shard.poll() is None
    finally:
        for proc in (keyholder, shard):
            proc.terminate()
            proc.wait(HANG_S)
    logs = (tmp_path / "kh.log").read_text() + (tmp_path / "s.log").read_text()
    assert "ModuleNotFoundError" not in logs and "Traceback" not in logs, logs


@pytest.mark.integration
def test_a_client_without_the_client_extra_says_which_in_one_line(tmp_path: Path) -> None:
    # Prepare
    path, _ = write_local_config(tmp_path)
    env = _core_env(tmp_path)
    # Execute
    done = subprocess.run(
        [sys.executable, "-m", "fedps.cli", "client", "--config", str(path), "--index", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=HANG_S,
        check=False,
    )
    # Assert: exit 2 and one line naming the extra, no traceback
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert last_line(done.stderr) == (
        "fedps: error: torch is not installed: this needs fedps's [client] extra "
        "(pip install 'fedps[client]', or 'fedps[all]' for everything)"
    )


def test_the_python_api_without_the_client_extra_names_it(tmp_path: Path) -> None:
    # Execute: `import fedps` works on the core install; its training API needs [client]
    done = subprocess.run(
        [sys.executable, "-c", "import fedps\nfedps.run_client"],
        capture_output=True,
        text=True,
        env=_core_env(tmp_path),
        timeout=HANG_S,
        check=False,
    )
    # Assert
    assert done.returncode == 1
    assert last_line(done.stderr).startswith(
        "fedps.extras.MissingExtraError: torch is not installed: this needs fedps's [client]"
    ), done.stderr
