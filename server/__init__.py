"""fedps server roles, one subpackage each.

The key holder, the parameter-server shards and the coordinator.

Each role is a plain handler with a thin gRPC servicer beside it (:mod:`server.keyholder`,
:mod:`server.shard`, :mod:`server.coordinator`); :mod:`server.serve` wires them into servers.
Flower interop lives in :mod:`server.flower`. The coordinator evaluates models (torch), so key
holder and shard processes never import it and never load torch.
"""

import fedps  # noqa: F401  # first: its import quiets gRPC core's logging before grpc loads
