"""fedps server roles: the key holder, parameter-server shards and the coordinator.

Each role is a plain handler (:class:`KeyHolder`, :class:`Shard`,
:class:`~server.coordinator.Coordinator`) with a thin gRPC servicer beside it;
:mod:`server.serve` wires them into servers and :mod:`server.deployment` starts them as
processes. The coordinator evaluates models (torch), so it is imported from its module and
only in its own process; key holder and shard processes never load torch.
"""

from server.keyholder import KeyHolder
from server.shard import Shard

__all__ = ["KeyHolder", "Shard"]
