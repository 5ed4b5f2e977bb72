"""Criteo click logs as TorchRec `Batch`es: the raw TSV files and TorchRec-style NPY files.

TSV rows are `label \\t 13 integer features \\t 26 hex categorical features` (Kaggle and
1TB formats; empty fields read as 0). NPY files are the per-day arrays TorchRec's
preprocessing writes: `*_dense.npy` (N x 13), `*_sparse.npy` (N x 26), `*_labels.npy`
(N or N x 1).

Both readers: dense features become `log(max(x, 0) + 1)` (float32), categorical values
are taken modulo the table size of their feature, and batch j of the global stream goes
to rank `j % world_size`, so ranks see disjoint data and every rank gets the same number
of full batches (a trailing partial round is dropped, so ranks never fall out of step).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset
from torchrec.datasets.criteo import (
    CAT_FEATURE_COUNT,
    DEFAULT_CAT_NAMES,
    INT_FEATURE_COUNT,
)
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["CriteoNPYDataset", "CriteoTSVDataset", "arrays_to_batch"]


def arrays_to_batch(dense: np.ndarray, sparse: np.ndarray, labels: np.ndarray,
                    num_embeddings_per_feature: Sequence[int] | None) -> Batch:
    """One `Batch` from raw Criteo arrays (dense N x 13, sparse N x 26, labels N)."""
    n = dense.shape[0]
    if sparse.shape != (n, CAT_FEATURE_COUNT) or dense.shape != (n, INT_FEATURE_COUNT):
        raise ValueError(
            f"expected dense ({n}, {INT_FEATURE_COUNT}) and sparse ({n}, {CAT_FEATURE_COUNT}), "
            f"got {dense.shape} and {sparse.shape}"
        )
    dense_t = torch.from_numpy(np.log(np.maximum(dense.astype(np.float64), 0.0) + 1.0))
    ids = torch.from_numpy(np.ascontiguousarray(sparse.astype(np.int64, copy=False).T))
    if num_embeddings_per_feature is not None:
        mods = torch.tensor(list(num_embeddings_per_feature), dtype=torch.int64).unsqueeze(1)
        ids = torch.remainder(ids, mods)
    return Batch(
        dense_features=dense_t.to(torch.float32),
        sparse_features=KeyedJaggedTensor(
            keys=list(DEFAULT_CAT_NAMES),
            values=ids.reshape(-1),
            lengths=torch.ones(CAT_FEATURE_COUNT * n, dtype=torch.int32),
            stride=n,
        ),
        labels=torch.from_numpy(labels.reshape(-1).astype(np.float32)),
    )


def _check_sizes(num_embeddings_per_feature: Sequence[int] | None) -> list[int] | None:
    if num_embeddings_per_feature is None:
        return None
    sizes = [int(x) for x in num_embeddings_per_feature]
    if len(sizes) != CAT_FEATURE_COUNT or min(sizes) < 1:
        raise ValueError(f"num_embeddings_per_feature must be {CAT_FEATURE_COUNT} sizes >= 1")
    return sizes


class CriteoTSVDataset(IterableDataset):
    """Streams Criteo TSV files (in order) as batches of this rank."""

    def __init__(self, paths: Sequence[str], batch_size: int,
                 num_embeddings_per_feature: Sequence[int] | None = None,
                 rank: int = 0, world_size: int = 1, limit_batches: int | None = None) -> None:
        super().__init__()
        self.paths = [os.fspath(p) for p in paths]
        for p in self.paths:
            if not os.path.isfile(p):
                raise FileNotFoundError(f"Criteo TSV file not found: {p}")
        if batch_size < 1 or not 0 <= rank < world_size:
            raise ValueError("batch_size must be >= 1 and 0 <= rank < world_size")
        self.batch_size = batch_size
        self.sizes = _check_sizes(num_embeddings_per_feature)
        self.rank = rank
        self.world_size = world_size
        self.limit_batches = limit_batches

    def _rows(self) -> Iterator[tuple[int, list[int], list[int], int]]:
        width = 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT
        for path in self.paths:
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    fields = line.rstrip("\n").split("\t")
                    if len(fields) != width:
                        raise ValueError(
                            f"{path}:{lineno}: expected {width} tab-separated fields, "
                            f"got {len(fields)}"
                        )
                    try:
                        label = int(fields[0] or "0")
                        dense = [int(x or "0") for x in fields[1 : 1 + INT_FEATURE_COUNT]]
                        cats = [int(x or "0", 16) for x in fields[1 + INT_FEATURE_COUNT :]]
                    except ValueError as e:
                        raise ValueError(f"{path}:{lineno}: malformed field ({e})") from None
                    yield label, dense, cats, lineno

    def __iter__(self) -> Iterator[Batch]:
        buf: list[tuple[int, list[int], list[int]]] = []
        j = 0
        round_batches: list[Batch | None] = []
        for label, dense, cats, _ in self._rows():
            buf.append((label, dense, cats))
            if len(buf) < self.batch_size:
                continue
            mine = j % self.world_size == self.rank
            round_batches.append(self._batch(buf) if mine else None)
            buf = []
            j += 1
            if len(round_batches) == self.world_size:
                yield from (b for b in round_batches if b is not None)
                round_batches = []
                if self.limit_batches is not None and j // self.world_size >= self.limit_batches:
                    return

    def _batch(self, rows: list[tuple[int, list[int], list[int]]]) -> Batch:
        labels = np.array([r[0] for r in rows], dtype=np.float32)
        dense = np.array([r[1] for r in rows], dtype=np.float64)
        sparse = np.array([r[2] for r in rows], dtype=np.int64)
        return arrays_to_batch(dense, sparse, labels, self.sizes)


class CriteoNPYDataset(IterableDataset):
    """Batches of this rank from TorchRec-style NPY files (memory-mapped)."""

    def __init__(self, dense_paths: Sequence[str], sparse_paths: Sequence[str],
                 labels_paths: Sequence[str], batch_size: int,
                 num_embeddings_per_feature: Sequence[int] | None = None,
                 rank: int = 0, world_size: int = 1, limit_batches: int | None = None) -> None:
        super().__init__()
        if not (len(dense_paths) == len(sparse_paths) == len(labels_paths)) or not dense_paths:
            raise ValueError("dense, sparse and labels paths must be non-empty lists of one length")
        if batch_size < 1 or not 0 <= rank < world_size:
            raise ValueError("batch_size must be >= 1 and 0 <= rank < world_size")
        self.files = list(zip(dense_paths, sparse_paths, labels_paths))
        self.batch_size = batch_size
        self.sizes = _check_sizes(num_embeddings_per_feature)
        self.rank = rank
        self.world_size = world_size
        self.limit_batches = limit_batches
        self._arrays = []
        total = 0
        for d, s, lab in self.files:
            dense = np.load(d, mmap_mode="r")
            sparse = np.load(s, mmap_mode="r")
            labels = np.load(lab, mmap_mode="r")
            if not (dense.shape[0] == sparse.shape[0] == labels.shape[0]):
                raise ValueError(f"row counts differ between {d}, {s} and {lab}")
            self._arrays.append((dense, sparse, labels))
            total += dense.shape[0]
        self.total_rows = total
        rounds = total // (batch_size * world_size)
        if limit_batches is not None:
            rounds = min(rounds, limit_batches)
        self.num_batches = rounds

    def __len__(self) -> int:
        return self.num_batches

    def _slice(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        offset = 0
        for dense, sparse, labels in self._arrays:
            n = dense.shape[0]
            lo, hi = max(start, offset), min(stop, offset + n)
            if lo < hi:
                parts.append((dense[lo - offset : hi - offset], sparse[lo - offset : hi - offset],
                              labels[lo - offset : hi - offset]))
            offset += n
        return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                np.concatenate([np.asarray(p[2]).reshape(-1) for p in parts]))

    def __iter__(self) -> Iterator[Batch]:
        for j in range(self.num_batches):
            start = (j * self.world_size + self.rank) * self.batch_size
            dense, sparse, labels = self._slice(start, start + self.batch_size)
            yield arrays_to_batch(dense, sparse, labels, self.sizes)
