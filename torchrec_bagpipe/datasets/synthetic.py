"""Synthetic Criteo-like click data with power-law (Zipf) id popularity.

TorchRec's `RandomRecDataset` draws ids uniformly and cycles a few cached batches, which
makes every cache look useless or perfect. This dataset has what caching depends on:

* per feature, popularity rank k in [0, n) has probability ∝ 1 / (k + 1)^alpha (alpha set
  by flag; 0 is uniform), drawn by inverting the continuous power-law CDF;
* hot ids are scattered over the id space by a per-feature bijection
  `id = (a * k + b) mod n` with gcd(a, n) = 1, so popularity is not id order;
* 26 categorical features (`cat_0` .. `cat_25`) and 13 dense ones, like Criteo; optional
  multi-hot bags (`multi_hot_sizes`: ids per sample per feature);
* labels are drawn from a hidden logistic model of the features: a linear function of the
  dense features plus, per categorical feature, a click effect of each of its
  `HIDDEN_IDS_PER_FEATURE` most popular ids (the mean over a multi-hot bag; rarer ids have
  none), so what a model learns from the training stream carries over to held-out data;
* the hidden model (the id scatter and the click effects) depends on the seed only; the
  samples depend on (seed, stream, rank, batch index): streams of one seed (e.g. 0 train,
  1 validation, 2 test) are different samples of the same distribution, every rank sees
  different data, and iterating twice gives identical batches (the prescan pass and the
  training pass see the same trace);
* optionally a drifting stream (`drift` > 0): the hot set moves through that fraction of
  each table's key space over the epoch's batches (batch j draws its popularity ranks shifted
  by floor(j * n * drift / num_batches) mod n), as in a time-ordered trace; the label model
  sees the ids' static ranks, so `label_logits` stays exact.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import IterableDataset
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = [
    "HIDDEN_IDS_PER_FEATURE", "PowerLawCriteoDataset", "power_law_ranks", "scatter_ids",
    "unscatter_ids",
]

_MASK63 = (1 << 63) - 1
# Popularity ranks per feature that carry a click effect in the hidden label model.
HIDDEN_IDS_PER_FEATURE = 1024


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


def _scatter_coefficients(n: int, salt: int) -> tuple[int, int]:
    """(a, b) of the bijection k -> (a * k + b) mod n, gcd(a, n) = 1."""
    if n >= 1 << 31:
        raise ValueError(f"scatter_ids supports tables below 2^31 rows, got {n}")
    if n == 1:
        return 1, 0
    a = 1 + _mix(salt, 1) % (n - 1)
    while math.gcd(a, n) != 1:
        a = a % (n - 1) + 1
    return a, _mix(salt, 2) % n


def scatter_ids(ranks: torch.Tensor, n: int, salt: int) -> torch.Tensor:
    """A bijection of [0, n) (n < 2^31) scattering consecutive ranks over the id space."""
    a, b = _scatter_coefficients(n, salt)
    # a, k < 2^31 keeps a * k < 2^62: no int64 overflow.
    return (ranks * a + b) % n


def unscatter_ids(ids: torch.Tensor, n: int, salt: int) -> torch.Tensor:
    """The inverse of `scatter_ids`: popularity ranks of ids in [0, n)."""
    a, b = _scatter_coefficients(n, salt)
    a_inv = pow(a, -1, n) if n > 1 else 0
    return ((ids - b) % n) * a_inv % n


class PowerLawCriteoDataset(IterableDataset):
    """Batches of TorchRec `Batch` (dense, KJT of 26 categorical features, labels).

    Args:
        num_embeddings_per_feature: table size per categorical feature (26 for Criteo; any
            length works, feature names are `cat_i`).
        batch_size: samples per batch on this rank.
        num_batches: batches per epoch on this rank.
        zipf_alpha: power-law exponent of id popularity (0: uniform; Criteo is ~1.05-1.2).
        seed: fixes the hidden model (id scatter, label model); with (stream, rank, batch
            index) it fixes every batch.
        rank, world_size: this rank's stream (different ids, labels and dense values).
        multi_hot_sizes: ids per sample per feature (default 1: one-hot like Criteo).
        num_dense: dense features (13 like Criteo).
        stream: which sample stream of the seed's distribution (e.g. 0 train, 1 validation,
            2 test): same hidden model, different samples.
        drift: fraction of each table's key space the hot set moves through over the
            `num_batches` batches (0: a stationary stream; in [0, 1]).
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
        stream: int = 0,
        drift: float = 0.0,
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
        if stream < 0:
            raise ValueError(f"stream must be >= 0, got {stream}")
        if not 0.0 <= drift <= 1.0:
            raise ValueError(f"drift must be in [0, 1], got {drift}")
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
        self.stream = int(stream)
        self.drift = float(drift)
        # The hidden label model: a function of the seed only (shared by every stream).
        g = torch.Generator().manual_seed(_mix(self.seed, 0xD))
        self._dense_w = torch.randn(self.num_dense, generator=g, dtype=torch.float64)
        self._id_effect = [
            torch.randn(min(n, HIDDEN_IDS_PER_FEATURE), generator=g, dtype=torch.float64) * 0.5
            for n in self.num_embeddings_per_feature
        ]
        self._salts = [_mix(self.seed, 0xF, f) for f in range(nf)]
        self._lengths = torch.tensor(
            [m for m in self.multi_hot_sizes for _ in range(self.batch_size)], dtype=torch.int32
        )

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[Batch]:
        for j in range(self.num_batches):
            yield self.batch(j)

    def batch(self, j: int) -> Batch:
        """Batch j of this rank (pure function of seed, stream, rank and j)."""
        if self.stream == 0:  # stream 0 keeps the sample stream of earlier versions
            g = torch.Generator().manual_seed(_mix(self.seed, self.rank, j))
        else:
            g = torch.Generator().manual_seed(_mix(self.seed, 0x5, self.stream, self.rank, j))
        b = self.batch_size
        values = []
        ranks_per_feature = []
        for f, (n, m) in enumerate(zip(self.num_embeddings_per_feature, self.multi_hot_sizes)):
            u = torch.rand(b * m, generator=g, dtype=torch.float64)
            ranks = power_law_ranks(u, n, self.zipf_alpha)
            if self.drift:
                ranks = (ranks + self.shift(j, n)) % n
            values.append(scatter_ids(ranks, n, self._salts[f]))
            ranks_per_feature.append(ranks)
        dense = torch.rand(b, self.num_dense, generator=g, dtype=torch.float64)
        logit = self._logits(dense, ranks_per_feature)
        labels = torch.rand(b, generator=g, dtype=torch.float64) < torch.sigmoid(logit)
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

    def shift(self, j: int, n: int) -> int:
        """The drift of batch j's popularity ranks in a table of n rows."""
        return int(j * n * self.drift // max(1, self.num_batches)) % n

    def label_logits(self, batch: Batch) -> torch.Tensor:
        """The hidden model's click logits (float64, one per sample) of a batch of this
        dataset's shape: the labels are Bernoulli(sigmoid(logit)) draws. REQUIRES: the batch's
        ids lie in the tables and each feature has `multi_hot_sizes` ids per sample."""
        kjt = batch.sparse_features
        if list(kjt.keys()) != self.keys:
            raise ValueError(f"batch keys {kjt.keys()} are not this dataset's {self.keys}")
        b = kjt.stride()
        ranks = []
        for f, (key, n, m) in enumerate(
            zip(self.keys, self.num_embeddings_per_feature, self.multi_hot_sizes)
        ):
            ids = kjt[key].values().to(torch.int64)
            if ids.numel() != b * m:
                raise ValueError(f"feature {key!r} has {ids.numel()} ids, expected {b} x {m}")
            ranks.append(unscatter_ids(ids, n, self._salts[f]))
        return self._logits(batch.dense_features.to(torch.float64), ranks)

    def _logits(self, dense: torch.Tensor, ranks: list[torch.Tensor]) -> torch.Tensor:
        b = dense.shape[0]
        logit = (dense - 0.5) @ self._dense_w - 1.0
        for effect, r, m in zip(self._id_effect, ranks, self.multi_hot_sizes):
            hot = r < effect.numel()
            per_id = torch.where(hot, effect[r.clamp(max=effect.numel() - 1)], 0.0)
            logit = logit + per_id.view(b, m).mean(1)
        return logit
