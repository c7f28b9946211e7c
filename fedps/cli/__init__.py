"""The operator's face of fedps: the ``fedps`` command and the tools behind it.

This is the one package allowed to import ``clients/`` and ``server/``: it starts every role
(:mod:`fedps.cli.deployment`), runs the demo, the privacy-accuracy experiments and the
benchmarks, and reads a running cluster's status.
"""

from fedps.cli.app import app, main

__all__ = ["app", "main"]
