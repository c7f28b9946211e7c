"""The ``[compression]`` section (:class:`CompressionConfig`), part of :mod:`fedps.config`.

A module of its own for its spelling as one word (``fedps bench --compression``, an
experiment's compression axis): :meth:`CompressionConfig.from_setting` and
:attr:`CompressionConfig.setting`.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = ["CompressionConfig"]

_COMPRESSION_SETTING = re.compile(
    r"^(?:(?P<density>[0-9]*\.?[0-9]+)(?P<ef>\+ef)?(?P<mt>\+mt)?)?(?:(?(density)\+)(?P<bits>[0-9]+)bit)?$"
)


class CompressionConfig(BaseModel):
    """Shared random-k sparsification and quantized packing of the clients' updates.

    Each round every client sends the same ``ceil(density x blocks)`` ciphertexts, filled with
    the coordinates a mask picks (the same for every client, from a seed the key holder
    releases with the round); the key holder scatters the decrypted sum back. With ``bits``,
    each value sent is quantized to ``bits`` bits (stochastic rounding) and several are packed
    into one ciphertext coefficient (:mod:`crypto.quantized_packing`). Off by default
    (``density = 1``, no ``bits``: every coordinate, one real value per coefficient). See
    docs/compression.md.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    density: float = Field(
        1.0, gt=0, le=1, description="fraction of the update's values sent each round (1: all)"
    )
    error_feedback: bool = Field(
        False,
        description="clients keep the unsent part of each (noised) update and add it to the "
        "next one",
    )
    masked_training: bool = Field(
        False,
        description="clients train only the coordinates the round's mask sends (DP-SGD clips "
        "each example's gradient on them, and the rest of the model stays as pulled); needs "
        "a density below 1 and per-sample clipping",
    )
    bits: int | None = Field(
        None,
        ge=1,
        le=16,
        description="quantize each value sent to this many bits and pack several to a "
        "ciphertext coefficient (none: one real value per coefficient)",
    )

    @model_validator(mode="after")
    def _check(self) -> CompressionConfig:
        if self.masked_training and self.density >= 1.0:
            raise ValueError(
                "compression.masked_training trains the round's mask: set a density below 1"
            )
        return self

    @property
    def enabled(self) -> bool:
        """Whether updates are sparsified (``density`` below 1)."""
        return self.density < 1.0

    @property
    def quantized(self) -> bool:
        """Whether values are quantized and packed (``bits`` given)."""
        return self.bits is not None

    @property
    def setting(self) -> str:
        """The section as one word (:meth:`from_setting`): ``1``, ``0.1+ef``, ``0.2+mt+8bit``."""
        parts = [f"{self.density:g}"] if self.density != 1.0 or self.bits is None else []
        if self.error_feedback:
            parts.append("ef")
        if self.masked_training:
            parts.append("mt")
        if self.bits is not None:
            parts.append(f"{self.bits}bit")
        return "+".join(parts)

    @classmethod
    def from_setting(cls, text: str) -> CompressionConfig:
        """The section a word gives (``DENSITY[+ef][+mt]``, ``Bbit``, ``DENSITY[+ef][+mt]+Bbit``).

        Raises
        ------
        ValueError
            If ``text`` is not spelt so, or gives a density outside (0, 1] or bits the section
            refuses.
        """
        match = _COMPRESSION_SETTING.match(text.strip())
        if match is None or not (match["density"] or match["bits"]):
            raise ValueError(
                f"{text!r}: give DENSITY[+ef][+mt], Bbit or DENSITY[+ef][+mt]+Bbit, "
                "e.g. 0.2+mt+8bit"
            )
        fields: dict[str, object] = {
            "density": float(match["density"] or 1.0),
            "error_feedback": match["ef"] is not None,
            "masked_training": match["mt"] is not None,
        }
        if match["bits"]:
            fields["bits"] = int(match["bits"])
        try:
            return cls.model_validate(fields)
        except ValidationError as exc:
            raise ValueError(f"{text!r}: {exc.errors()[0]['msg']}") from None
