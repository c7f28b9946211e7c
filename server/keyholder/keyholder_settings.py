"""What the key holder decides by: every policy knob, in one frozen record.

:func:`server.serve.keyholder_settings` makes it from the configuration;
:meth:`server.keyholder.keyholder.KeyHolder.open` builds a key holder from it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from crypto import CkksParams
from crypto.quantized_packing import QuantizedPacking
from fedps.errors import InvalidArgumentError
from fedps.learning.accounting import ClientLevelNoise

__all__ = ["KeyHolderSettings"]


@dataclass(frozen=True)
class KeyHolderSettings:
    """The key holder's policy, from the configuration.

    Parameters
    ----------
    params
        CKKS parameters for a first start (a key holder with keys keeps its own).
    min_quorum
        Fewest distinct clients an aggregate must contain to be decrypted
        (``training.min_quorum``).
    encrypted
        False: updates travel and are summed in plaintext (``he.enabled``; a baseline only).
    max_clients
        Most contributors one aggregate may sum (``he.max_clients``).
    max_abs_value
        The clipping bound of every value a client sends (``he.max_abs_value``): a decrypted
        sum beyond what its contributors' clipping allows is refused.
    flood_bits
        Noise flooding of each released sum, in bits above the worst-case decryption error
        (``security.flood_bits``; :func:`crypto.release.flood_and_round`).
    rotate_every_rounds
        A new CKKS key pair once this many rounds are applied (``security.rotate_every_rounds``;
        0: never).
    staleness
        The staleness function of asynchronous mode (None: synchronous rounds).
    max_staleness
        The oldest model version, in versions behind, an asynchronous update may train.
    weight_bounds
        The range every client's declared aggregation weight must lie in (``(1, 1)``:
        uniform weights).
    max_detections
        Detected tamperings by one shard after which no round is decrypted any more.
    max_shard_misses
        Fetches of one shard's aggregates in a row that miss ``shard_deadline_s`` after which
        a round is refused (:class:`~fedps.errors.ShardStalledError`) until the shard answers.
    shard_deadline_s
        The deadline of each fetch of a shard's aggregates.
    client_noise
        Client-level DP (:func:`fedps.learning.accounting.client_level_noise`, the clients' own
        calibration): top each round's sum up to the full noise and divide by the fixed cohort
        size. None at example level.
    density
        Shared random-k sparsification (``compression.density``): the fraction of each update
        sent under the round's mask (:class:`fedps.sharding.sparse_mask.SparseMask`); 1: all.
    packing
        Quantized packing (``compression.bits``): each decrypted sum is rounded to the integer
        it must be, split into its fields and dequantized
        (:class:`crypto.quantized_packing.QuantizedPacking`) instead of flooded. None: one real
        value per coefficient.
    parties
        Key-holder parties (``keyholder.parties``): 1, this key holder holds the key; more, it
        is the combiner of ``parties`` parties (:mod:`server.keyholder.joint_keys`).
    threshold
        How many parties decrypt together (``keyholder.threshold``, resolved: 1..parties).
    lambda_bits
        The statistical security of each party's flooding (``keyholder.lambda_bits``).

    Raises
    ------
    InvalidArgumentError
        A quorum below 1, client-level noise or compressed updates with asynchronous updates,
        a density outside (0, 1], or a packing without encryption or with other parameters.
    """

    params: CkksParams
    min_quorum: int
    encrypted: bool = True
    max_clients: int = 1 << 30
    max_abs_value: float = 1.0
    flood_bits: int = 4
    rotate_every_rounds: int = 10
    staleness: Callable[[int], float] | None = None
    max_staleness: int = 0
    weight_bounds: tuple[float, float] = (1.0, 1.0)
    max_detections: int = 3
    max_shard_misses: int = 3
    shard_deadline_s: float = 60.0  # a restarting shard fails a fetch, then a retry
    client_noise: ClientLevelNoise | None = None
    density: float = 1.0
    packing: QuantizedPacking | None = None
    parties: int = 1
    threshold: int = 1
    lambda_bits: int = 16

    def __post_init__(self) -> None:
        if self.min_quorum < 1:
            raise InvalidArgumentError("min_quorum must be at least 1")
        if self.client_noise is not None and self.staleness is not None:
            raise InvalidArgumentError("client-level noise needs synchronous rounds")
        if not 0 < self.density <= 1:
            raise InvalidArgumentError(f"density must be in (0, 1], got {self.density}")
        if self.density < 1 and self.staleness is not None:
            raise InvalidArgumentError("sparsified updates need synchronous rounds")
        if self.packing is not None and (self.staleness is not None or not self.encrypted):
            raise InvalidArgumentError("quantized packing needs encrypted synchronous rounds")
        if self.packing is not None and self.packing.params != self.params:
            raise InvalidArgumentError("quantized packing needs its own CKKS parameters")

    @property
    def fields(self) -> int:
        """Values per coefficient of an update (1 without quantized packing)."""
        return 1 if self.packing is None else self.packing.fields
