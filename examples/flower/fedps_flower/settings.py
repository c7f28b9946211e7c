"""The fedps configuration of this app, named by the run config's ``fedps-config`` key."""

from __future__ import annotations

from pathlib import Path

from flwr.app import Context

from fedps.config import FedPSConfig, load_config

APP_DIR = Path(__file__).resolve().parent.parent


def fedps_config(context: Context, key: str = "fedps-config") -> FedPSConfig:
    """Load the TOML file the run config names (relative paths: from the app directory)."""
    path = Path(str(context.run_config.get(key, "fedps.toml")))
    return load_config(path if path.is_absolute() else APP_DIR / path)
