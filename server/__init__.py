"""fedps server roles: the key holder, parameter-server shards and the coordinator.

Each role is a plain handler (:class:`KeyHolder`, :class:`Shard`, :class:`Coordinator`) with a
thin gRPC servicer beside it; :mod:`server.serve` wires them into servers and
:mod:`server.deployment` starts them as processes.
"""

from server.coordinator import Coordinator
from server.keyholder import KeyHolder
from server.shard import Shard

__all__ = ["Coordinator", "KeyHolder", "Shard"]
