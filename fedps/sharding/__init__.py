"""How a model is laid out on the shards.

Model <-> flat vector <-> blocks (:mod:`~fedps.sharding.blocks`) and the consistent-hash ring that
places blocks on shards (:mod:`~fedps.sharding.hash_ring`), and the mask of shared random-k
sparsification (:mod:`~fedps.sharding.sparse_mask`).
"""

from fedps.sharding.blocks import BlockLayout
from fedps.sharding.hash_ring import HashRing
from fedps.sharding.sparse_mask import SparseMask, mask_seed, sent_blocks, upload_layout

__all__ = ["BlockLayout", "HashRing", "SparseMask", "mask_seed", "sent_blocks", "upload_layout"]
