"""Which PS shard owns a fused row key.

Every runtime that routes keys (the native client, offline restore, tests) must map keys
identically; `REFERENCE_VECTORS` pins the mapping and tests check the native implementation
and the pure-Python one below against it.

With ``k`` the key's int64 bit pattern read as uint64 and ``S`` the shard count:

* ``modulo``: ``k mod S``
* ``hash``: ``fmix64(k) mod S``
* ``fast_range``: ``(fmix64(k) * S) >> 64`` (Lemire's multiply-shift reduction)

``fmix64`` is MurmurHash3's 64-bit finaliser; it differs from the store's internal SplitMix64
routing, so the keys of one PS shard still spread over every internal shard of its store.
"""

from __future__ import annotations

import numbers
from typing import get_args

import torch

from torchrec_bagpipe import config
from torchrec_bagpipe._native import C

__all__ = ["KINDS", "REFERENCE_KEYS", "REFERENCE_VECTORS", "Partitioner", "reference_shard_of"]

KINDS: tuple[str, ...] = get_args(config.Partitioner)  # BagPipeConfig.partitioner

_MASK = (1 << 64) - 1

# Keys and their expected shards for S in (2, 3, 8); shared with csrc/tests/test_wire.cc.
REFERENCE_KEYS = (0, 1, 2, 3, 7, 63, 64, 1000, 123456789, 2**31 - 1, 2**40 + 5, 2**62 + 12345,
                  -1, -(2**63))
REFERENCE_VECTORS: dict[tuple[str, int], tuple[int, ...]] = {
    ("modulo", 2): (0, 1, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 0),
    ("hash", 2): (0, 0, 1, 0, 1, 0, 0, 1, 0, 1, 0, 0, 1, 1),
    ("fast_range", 2): (0, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 1),
    ("modulo", 3): (0, 1, 2, 0, 1, 0, 1, 1, 0, 1, 0, 1, 0, 2),
    ("hash", 3): (0, 2, 0, 2, 1, 1, 2, 0, 2, 1, 2, 0, 1, 0),
    ("fast_range", 3): (0, 2, 0, 0, 1, 0, 0, 2, 1, 1, 2, 2, 1, 1),
    ("modulo", 8): (0, 1, 2, 3, 7, 7, 0, 0, 5, 7, 5, 1, 7, 0),
    ("hash", 8): (0, 4, 7, 6, 5, 4, 6, 1, 6, 1, 0, 0, 1, 3),
    ("fast_range", 8): (0, 5, 1, 0, 3, 0, 2, 5, 4, 4, 5, 6, 3, 4),
}


def _fmix64(k: int) -> int:
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & _MASK
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & _MASK
    k ^= k >> 33
    return k


def reference_shard_of(kind: str, num_shards: int, key: int) -> int:
    """The shard of one key, in pure Python (the specification the native code follows)."""
    k = key & _MASK
    if kind == "modulo":
        return k % num_shards
    if kind == "hash":
        return _fmix64(k) % num_shards
    if kind == "fast_range":
        return (_fmix64(k) * num_shards) >> 64
    raise ValueError(f"partitioner must be one of {list(KINDS)}, got {kind!r}")


class Partitioner:
    """Maps int64 keys to PS shards (see the module docstring for the exact functions)."""

    def __init__(self, kind: str = "modulo", num_shards: int = 1) -> None:
        if kind not in KINDS:
            raise ValueError(f"partitioner must be one of {list(KINDS)}, got {kind!r}")
        if isinstance(num_shards, bool) or not isinstance(num_shards, numbers.Integral):
            raise TypeError(f"num_shards must be an int, got {type(num_shards).__name__}")
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        self.kind = kind
        self.num_shards = int(num_shards)

    def __repr__(self) -> str:
        return f"Partitioner(kind={self.kind!r}, num_shards={self.num_shards})"

    def shard_of(self, keys: torch.Tensor) -> torch.Tensor:
        """The shard of each key (int64 tensor of the same length)."""
        if not isinstance(keys, torch.Tensor) or keys.dtype != torch.int64:
            raise TypeError("keys must be an int64 torch.Tensor")
        if keys.dim() != 1:
            raise ValueError(f"keys must be 1-D, got shape {tuple(keys.shape)}")
        if keys.device.type != "cpu":
            raise TypeError(f"keys must be a CPU tensor, got device {keys.device}")
        k = keys.detach().contiguous()
        out = torch.empty_like(k)
        C.partition_assign(self.kind, self.num_shards, k.numpy(), out.numpy())
        return out

    def split(self, keys: torch.Tensor) -> list[torch.Tensor]:
        """Positions of the keys of each shard, in input order within a shard."""
        shards = self.shard_of(keys)
        order = torch.argsort(shards, stable=True)
        counts = torch.bincount(shards, minlength=self.num_shards).tolist()
        return list(torch.split(order, counts))
