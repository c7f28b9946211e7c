"""The run's CKKS parameters from its configuration (``[he]``, ``[compression]``, the mode).

:class:`crypto.params.CkksParams` knows nothing of the configuration (``crypto/`` imports
nothing of ours but :mod:`fedps.errors`); the roles, the CLI and the tools build the run's
parameters here, so that all of them agree.
"""

from __future__ import annotations

from crypto.params import ASYNC_WEIGHT_BITS, CkksParams
from crypto.quantized_packing import QuantizedPacking
from fedps.config import FedPSConfig, HEConfig

__all__ = ["ckks_params", "ckks_params_from", "quantized_packing", "upload_fields"]


def ckks_params(config: FedPSConfig) -> CkksParams:
    """The run's parameters: ``[he]``, plus headroom for staleness multipliers in async mode.

    The multipliers are integer weights of up to ``2**ASYNC_WEIGHT_BITS``. With
    ``compression.bits`` the parameters are the quantized packing's (:func:`quantized_packing`).
    """
    packing = quantized_packing(config)
    if packing is not None:
        return packing.params
    extra = ASYNC_WEIGHT_BITS if config.training.mode == "async" else 0
    return ckks_params_from(config.he, extra_bits=extra)


def quantized_packing(config: FedPSConfig) -> QuantizedPacking | None:
    """The run's quantized packing (None without ``compression.bits``).

    Raises
    ------
    ConfigError
        The packing holds no field or sends no fewer bytes per value than plain packing
        (:meth:`crypto.quantized_packing.QuantizedPacking.derive`).
    """
    bits = config.compression.bits
    if bits is None:
        return None
    he = config.he
    return QuantizedPacking.derive(
        bits=bits,
        max_clients=he.max_clients,
        max_abs_value=he.max_abs_value,
        plain=ckks_params_from(he),
    )


def upload_fields(config: FedPSConfig) -> int:
    """Values per coefficient of an update: the packing's fields, or 1 (one real value)."""
    packing = quantized_packing(config)
    return 1 if packing is None else packing.fields


def ckks_params_from(he: HEConfig, *, extra_bits: int = 0) -> CkksParams:
    """Parameters fixed in the ``[he]`` section, or derived from its workload fields.

    See :meth:`crypto.params.CkksParams.for_workload`.
    """
    if he.poly_modulus_degree is not None:
        assert he.coeff_modulus_bits is not None and he.scale_bits is not None
        return CkksParams(
            poly_modulus_degree=he.poly_modulus_degree,
            coeff_modulus_bits=he.coeff_modulus_bits,
            scale_bits=he.scale_bits,
        )
    return CkksParams.for_workload(
        max_clients=he.max_clients,
        max_abs_value=he.max_abs_value,
        precision=he.precision,
        extra_bits=extra_bits,
    )
