"""The parameter-server shard: plaintext model blocks out, encrypted update blocks in."""

from server.shard.shard import Shard
from server.shard.shard_servicer import ShardServicer

__all__ = ["Shard", "ShardServicer"]
