"""Model <-> flat vector <-> parameter blocks.

The global model is one flat float vector: every trainable parameter of the
``torch.nn.Module`` in ``named_parameters()`` order, flattened. The vector is cut into blocks
of ``values_per_block`` values (the CKKS scheme's N, so one block is one ciphertext); the last
block is zero-padded. Block ``b`` lives on the shard the hash ring assigns it to.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fedps.errors import ConfigError, InvalidArgumentError

if TYPE_CHECKING:  # torch is imported where a model is used: servers without one skip it
    import torch

__all__ = ["BlockLayout", "flatten_model", "group_mask", "load_flat"]


@dataclass(frozen=True)
class BlockLayout:
    """How a flat vector of ``num_params`` values is cut into blocks.

    Raises
    ------
    InvalidArgumentError
        ``num_params`` or ``values_per_block`` is not positive.
    """

    num_params: int
    values_per_block: int

    def __post_init__(self) -> None:
        if self.num_params < 1 or self.values_per_block < 1:
            raise InvalidArgumentError("num_params and values_per_block must be positive")

    @property
    def num_blocks(self) -> int:
        """Number of blocks (the last one zero-padded)."""
        return -(-self.num_params // self.values_per_block)

    def block_of(self, vector: np.ndarray, block: int) -> np.ndarray:
        """Block ``block`` of ``vector`` as ``values_per_block`` values (zero-padded)."""
        if not 0 <= block < self.num_blocks:
            raise InvalidArgumentError(f"block {block} out of range [0, {self.num_blocks})")
        start = block * self.values_per_block
        part = vector[start : start + self.values_per_block]
        if part.size == self.values_per_block:
            return part
        out = np.zeros(self.values_per_block, dtype=vector.dtype)
        out[: part.size] = part
        return out

    def join(self, blocks: dict[int, np.ndarray]) -> np.ndarray:
        """Assemble the flat vector from every block (float64).

        Raises
        ------
        InvalidArgumentError
            If a block is missing or has the wrong length.
        """
        if len(blocks) < self.num_blocks:  # checked first: never build a huge set
            raise InvalidArgumentError(f"missing blocks: got {len(blocks)} of {self.num_blocks}")
        missing = set(range(self.num_blocks)) - set(blocks)
        if missing or len(blocks) != self.num_blocks:
            raise InvalidArgumentError(f"missing or unexpected blocks: {sorted(missing)[:10]}")
        out = np.empty(self.num_blocks * self.values_per_block, dtype=np.float64)
        for b in range(self.num_blocks):
            values = blocks[b]
            if values.shape != (self.values_per_block,):
                raise InvalidArgumentError(f"block {b} has shape {values.shape}")
            out[b * self.values_per_block : (b + 1) * self.values_per_block] = values
        return out[: self.num_params]


def flatten_model(model: torch.nn.Module) -> np.ndarray:
    """The model's trainable parameters as one flat float64 vector."""
    import torch

    with torch.no_grad():
        parts = [p.detach().reshape(-1).to(torch.float64) for p in model.parameters()]
        return torch.cat(parts).cpu().numpy() if parts else np.zeros(0)


def load_flat(model: torch.nn.Module, vector: np.ndarray) -> None:
    """Copy a flat vector into the model's trainable parameters, in place.

    Raises
    ------
    InvalidArgumentError
        If the vector's length is not the model's parameter count.
    """
    import torch

    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    if vector.shape != (total,):
        raise InvalidArgumentError(f"model has {total} parameters, vector has {vector.shape}")
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            chunk = torch.from_numpy(np.ascontiguousarray(vector[offset : offset + n]))
            p.copy_(chunk.reshape(p.shape).to(p.dtype))
            offset += n


def group_mask(model: torch.nn.Module, patterns: list[str]) -> np.ndarray:
    """Which values of the flat vector belong to parameters named like one of ``patterns``.

    Names are ``model.named_parameters()`` names (``"2.weight"``), matched with ``fnmatch``;
    the result is a boolean vector in :func:`flatten_model` order.

    Raises
    ------
    ConfigError
        If a pattern matches no parameter (a typo would silently change nothing).
    """
    named = list(model.named_parameters())
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n, _ in named)]
    if unmatched:
        names = ", ".join(n for n, _ in named)
        raise ConfigError(f"parameter pattern(s) {unmatched} match none of: {names}")
    parts = [
        np.full(p.numel(), any(fnmatch.fnmatchcase(name, pat) for pat in patterns), dtype=bool)
        for name, p in named
    ]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=bool)
