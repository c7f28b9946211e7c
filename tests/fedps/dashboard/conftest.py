"""The dashboard tests' cluster (nothing listens: every role shows as down) and launcher."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fedps.config import FedPSConfig, load_config
from fedps.dashboard import RunLauncher, RunStore, StatusCollector
from fedps.runtime.deployment import local_cluster

INSECURE = {"tls": {"insecure": True, "enabled": False}}


@pytest.fixture
def config(tmp_path: Path) -> FedPSConfig:
    """A cluster on free loopback ports where nothing listens."""
    return load_config(None, cluster=local_cluster(tmp_path / "state"), **INSECURE)


@pytest.fixture
def collector(config: FedPSConfig) -> Iterator[StatusCollector]:
    collector = StatusCollector(config, call_s=0.2)
    collector.poll_once()
    yield collector
    collector.stop()


@pytest.fixture
def launcher(tmp_path: Path) -> RunLauncher:
    return RunLauncher(None, base_overrides=INSECURE, state_root=tmp_path / "ui")


@pytest.fixture
def store(tmp_path: Path) -> RunStore:
    """An empty run store in the dashboard's state folder."""
    return RunStore.open(tmp_path / "ui" / "dashboard")
