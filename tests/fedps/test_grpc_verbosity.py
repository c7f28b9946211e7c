"""gRPC core's INFO lines are off by default: importing fedps (or a role's package) sets
``GRPC_VERBOSITY=ERROR`` before grpc loads, unless the user set it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
_SHOW = "import os, grpc; print(os.environ.get('GRPC_VERBOSITY'), os.environ.get('GRPC_TRACE'))"


def _fresh(first: str, env: dict[str, str]) -> str:
    """What a fresh process that imports ``first`` and then grpc sees."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("GRPC_")}
    result = subprocess.run(
        [sys.executable, "-c", f"import {first}; {_SHOW}"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, "PYTHONPATH": str(_ROOT), **env},
        cwd=_ROOT,
        check=True,
    )
    return result.stdout.strip()


@pytest.mark.parametrize("first", ["fedps", "server.serve", "clients"])
def test_grpc_logs_only_errors_by_default(first: str) -> None:
    assert _fresh(first, {}) == "ERROR None"


def test_a_user_s_verbosity_is_kept() -> None:
    assert _fresh("fedps", {"GRPC_VERBOSITY": "DEBUG", "GRPC_TRACE": "http"}) == "DEBUG http"
