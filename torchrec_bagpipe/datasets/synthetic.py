"""Synthetic Criteo-like click data with power-law (Zipf) id popularity.

TorchRec's `RandomRecDataset` draws ids uniformly and cycles a few cached batches, which
makes every cache look useless or perfect. This dataset has what caching depends on:

* per feature, popularity rank k in [0, n) has probability ∝ 1 / (k + 1)^alpha (alpha set
  by flag; 0 is uniform), drawn by inverting the continuous power-law CDF;
* hot ids are scattered over the id space by a per-feature bijection
  `id = (a * k + b) mod n` with gcd(a, n) = 1, so popularity is not id order;
* 26 categorical features (`cat_0` .. `cat_25`) and 13 dense ones, like Criteo; optional
  multi-hot bags (`multi_hot_sizes`: ids per sample per feature);
* labels follow a fixed logistic model of the dense features and of a per-feature "click
  affinity" of the sampled ids, so training has something to learn;
* deterministic by seed, different data on every rank: batch j of rank r depends only on
  (seed, r, j), so iterating twice gives identical batches (the prescan pass and the
  training pass see the same trace).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import IterableDataset
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["PowerLawCriteoDataset", "power_law_ranks", "scatter_ids"]

_MASK63 = (1 << 63) - 1


def _mix(*xs: int) -> int:
    """A splitmix64-style hash of integers (deterministic seeds for sub-streams)."""
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h ^= (x + 0x9E3779B97F4A7C15 + (h << 6) + (h >> 2)) & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & _MASK63


def power_law_ranks(u: torch.Tensor, n: int, alpha: float) -> torch.Tensor:
    """Maps uniforms u in [0, 1) to popularity ranks in [0, n) with P(k) ∝ (k+1)^-alpha
    (continuous inverse CDF, floored)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    u = u.to(torch.float64)
    if alpha == 0.0:
        x = u * n
    elif abs(alpha - 1.0) < 1e-9:
        x = torch.exp(u * math.log(n + 1.0)) - 1.0
    else:
        e = 1.0 - alpha
        top = (n + 1.0) ** e
        x = (1.0 + u * (top - 1.0)) ** (1.0 / e) - 1.0
    return x.floor().clamp_(0, n - 1).to(torch.int64)


def scatter_ids(ranks: torch.Tensor, n: int, salt: int) -> torch.Tensor:
    """A bijection of [0, n) (n < 2^31) scattering consecutive ranks over the id space."""
    if n >= 1 << 31:
        raise ValueError(f"scatter_ids supports tables below 2^31 rows, got {n}")
    if n == 1:
        return torch.zeros_like(ranks)
    a = 1 + _mix(salt, 1) % (n - 1)
    while math.gcd(a, n) != 1:
        a = a % (n - 1) + 1
    b = _mix(salt, 2) % n
    # a, k < 2^31 keeps a * k < 2^62: no int64 overflow.
    return (ranks * a + b) % n


class PowerLawCriteoDataset(IterableDataset):
    """Batches of TorchRec `Batch` (dense, KJT of 26 categorical features, labels).

    Args:
        num_embeddings_per_feature: table size per categorical feature (26 for Criteo; any
            length works, feature names are `cat_i`).
        batch_size: samples per batch on this rank.
        num_batches: batches per epoch on this rank.
        zipf_alpha: power-law exponent of id popularity (0: uniform; Criteo is ~1.05-1.2).
        seed: the dataset's seed; with (rank, batch index) it fixes every batch.
        rank, world_size: this rank's stream (different ids, labels and dense values).
        multi_hot_sizes: ids per sample per feature (default 1: one-hot like Criteo).
        num_dense: dense features (13 like Criteo).
    """

    def __init__(
        self,
        num_embeddings_per_feature: Sequence[int],
        batch_size: int,
        num_batches: int,
        zipf_alpha: float = 1.05,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        multi_hot_sizes: Sequence[int] | None = None,
        num_dense: int = len(DEFAULT_INT_NAMES),
    ) -> None:
        super().__init__()
        self.num_embeddings_per_feature = [int(n) for n in num_embeddings_per_feature]
        if not self.num_embeddings_per_feature or min(self.num_embeddings_per_feature) < 1:
            raise ValueError("num_embeddings_per_feature must be a non-empty list of sizes >= 1")
        if batch_size < 1 or num_batches < 0:
            raise ValueError("batch_size must be >= 1 and num_batches >= 0")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, {world_size})")
        if zipf_alpha < 0:
            raise ValueError(f"zipf_alpha must be >= 0, got {zipf_alpha}")
        nf = len(self.num_embeddings_per_feature)
        self.multi_hot_sizes = [int(m) for m in (multi_hot_sizes or [1] * nf)]
        if len(self.multi_hot_sizes) != nf or min(self.multi_hot_sizes) < 1:
            raise ValueError(f"multi_hot_sizes must be {nf} values >= 1")
        self.keys = (
            list(DEFAULT_CAT_NAMES) if nf == len(DEFAULT_CAT_NAMES)
            else [f"cat_{i}" for i in range(nf)]
        )
        self.batch_size = int(batch_size)
        self.num_batches = int(num_batches)
        self.zipf_alpha = float(zipf_alpha)
        self.seed = int(seed)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.num_dense = int(num_dense)
        g = torch.Generator().manual_seed(_mix(self.seed, 0xD))
        self._dense_w = torch.randn(self.num_dense, generator=g, dtype=torch.float64) * 0.5
        self._lengths = torch.tensor(
            [m for m in self.multi_hot_sizes for _ in range(self.batch_size)], dtype=torch.int32
        )

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[Batch]:
        for j in range(self.num_batches):
            yield self.batch(j)

    def batch(self, j: int) -> Batch:
        """Batch j of this rank (pure function of seed, rank and j)."""
        g = torch.Generator().manual_seed(_mix(self.seed, self.rank, j))
        b = self.batch_size
        values = []
        affinity = torch.zeros(b, dtype=torch.float64)
        for f, (n, m) in enumerate(zip(self.num_embeddings_per_feature, self.multi_hot_sizes)):
            u = torch.rand(b * m, generator=g, dtype=torch.float64)
            ranks = power_law_ranks(u, n, self.zipf_alpha)
            ids = scatter_ids(ranks, n, _mix(self.seed, 0xF, f))
            values.append(ids)
            # Popular ids click a little more: a deterministic per-feature signal.
            affinity += (1.0 / (1.0 + ranks.view(b, m).to(torch.float64))).mean(1)
        dense = torch.rand(b, self.num_dense, generator=g, dtype=torch.float64)
        logit = dense @ self._dense_w + 4.0 * affinity / len(values) - 1.0
        labels = (torch.rand(b, generator=g, dtype=torch.float64) < torch.sigmoid(logit))
        kjt = KeyedJaggedTensor(
            keys=self.keys,
            values=torch.cat(values),
            lengths=self._lengths.clone(),
            stride=b,
        )
        return Batch(
            dense_features=dense.to(torch.float32),
            sparse_features=kjt,
            labels=labels.to(torch.float32),
        )
