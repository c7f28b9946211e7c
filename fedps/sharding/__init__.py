"""How a model is laid out on the shards.

Model <-> flat vector <-> blocks (:mod:`~fedps.sharding.blocks`) and the consistent-hash ring that
places blocks on shards (:mod:`~fedps.sharding.hash_ring`).
"""

from fedps.sharding.blocks import BlockLayout
from fedps.sharding.hash_ring import HashRing

__all__ = ["BlockLayout", "HashRing"]
