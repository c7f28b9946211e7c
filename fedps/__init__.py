"""fedps: a secure federated parameter server.

This package is the shared core every role uses: configuration, the wire protocol, the hash
ring, model <-> vector <-> blocks, datasets, partitioners, models and the CLI.
"""

from fedps._layout import check_layout

check_layout()  # first: a user's server.py must not hide fedps's server/ package

from fedps.errors import FedPSError  # noqa: E402

__all__ = ["FedPSError"]
__version__ = "0.1.0"
