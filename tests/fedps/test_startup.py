"""A role's start (fedps/startup.py): loaded with the garbage collector paused, then frozen."""

from __future__ import annotations

import gc
import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest

from fedps.startup import loading, root_logging_kept


@pytest.fixture(autouse=True)
def _collector_restored() -> Iterator[None]:
    """This process's collector as it was: running, nothing frozen by the test."""
    yield
    gc.unfreeze()
    gc.enable()


def test_the_collector_is_paused_in_the_block_and_what_it_made_is_frozen_after() -> None:
    # Prepare
    gc.unfreeze()
    # Execute
    with loading():
        paused = not gc.isenabled()
        # long-lived objects, as a role's set-up makes them
        made: list[list[int]] = [[] for _ in range(1000)]
    # Assert
    assert paused and gc.isenabled()
    assert gc.get_freeze_count() >= len(made)
    assert all(o is not made for o in gc.get_objects())  # left out of every collection


def test_a_paused_collector_stays_paused_and_an_error_still_freezes() -> None:
    # Prepare
    gc.unfreeze()
    gc.disable()
    # Execute
    with pytest.raises(RuntimeError), loading():
        raise RuntimeError("a role that fails to start")
    # Assert
    assert not gc.isenabled() and gc.get_freeze_count() > 0


def test_root_logging_kept_keeps_basic_config_out_and_removes_what_the_block_added() -> None:
    # Prepare: a root logger without handlers, as a Flower app's (pytest's put back after)
    root = logging.getLogger()
    saved, root.handlers = root.handlers, []
    try:
        # Execute: the block configures logging, as Opacus's import does, and adds a handler
        with root_logging_kept():
            logging.basicConfig()
            during = [h for h in root.handlers if not isinstance(h, logging.NullHandler)]
            root.addHandler(logging.StreamHandler())
        # Assert: basicConfig printed nothing even during the block; nothing is left after it
        assert during == []
        assert root.handlers == []
    finally:
        root.handlers = saved


def test_a_client_imports_opacus_without_configuring_the_root_logger() -> None:
    # Prepare: a fresh process, as a Flower app's, whose logging is not configured
    script = (
        "import logging, sys\n"
        "import clients.flower.flower_client\n"
        "assert 'opacus' in sys.modules\n"
        "print(len(logging.getLogger().handlers))\n"
    )
    # Execute
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    # Assert: no handler of Opacus's, so Flower's records are printed once, by Flower
    assert result.returncode == 0, result.stderr
    assert result.stdout == "0\n"
