"""Homomorphic encryption for fedps: addition-only CKKS on raw SEAL ciphertexts.

The key holder owns a :class:`SecretContext`; clients and shards hold only its
:class:`PublicContext`. Clients encrypt with :class:`BlockEncryptor`; shards validate and add
packed blocks with :class:`CiphertextSum` without ever touching a secret key.
"""

from crypto.block_encryptor import BlockEncryptor, num_blocks
from crypto.ciphertext_sum import (
    CiphertextSum,
    PlainSum,
    new_sum,
    pack_sums,
    unpack_block,
    unpack_blocks,
)
from crypto.params import CkksParams
from crypto.plain_context import PLAINTEXT_CONTEXT_ID, PlainContext
from crypto.public_context import PublicContext
from crypto.secret_context import SecretContext

__all__ = [
    "PLAINTEXT_CONTEXT_ID",
    "BlockEncryptor",
    "CiphertextSum",
    "CkksParams",
    "PlainContext",
    "PlainSum",
    "PublicContext",
    "SecretContext",
    "new_sum",
    "num_blocks",
    "pack_sums",
    "unpack_block",
    "unpack_blocks",
]
