"""The ``fedps`` command: typer commands and nothing they compose.

Each command parses its options and calls the layer below: :mod:`fedps.runtime` (roles, local
clusters, deployments, the demo, status, export), :mod:`fedps.experiments`,
:mod:`fedps.bench` and :mod:`fedps.dashboard`. Nothing imports this package but the entry
point.
"""

from fedps.cli.app import app, main

__all__ = ["app", "main"]
