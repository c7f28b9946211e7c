"""The committed generated gRPC code must match the .proto sources."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_up_to_date() -> None:
    # Prepare: the generator must use this interpreter's grpc_tools
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    # Execute
    result = subprocess.run(
        ["bash", str(ROOT / "fedps/proto/generate.sh"), "--check"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    # Assert
    assert result.returncode == 0, result.stderr
