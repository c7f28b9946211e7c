"""fedps: a secure federated parameter server.

This package is the shared core every role uses: configuration, the wire protocol, the hash
ring, model <-> vector <-> blocks, datasets, partitioners, models and the CLI.
"""

from fedps.errors import FedPSError

__all__ = ["FedPSError"]
__version__ = "0.1.0"
