"""Transforms of TorchRec `Batch` streams: row selection and negative undersampling.

`Undersample` implements dlrm_main's ``--undersampling_rate`` (TorchRec's script declares
the flag but never reads it): each training batch keeps every row labelled 1 and each row
labelled 0 with probability `rate`. The draw for batch j of rank r depends on
(seed, r, j) only, so every pass over the data (a prescan pass and the training pass, or
every epoch) drops the same rows. A batch keeps at least one row (its first) so no step
is empty; batches therefore vary in size, as TorchRec's last batches do.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["MappedBatches", "Undersample", "select_rows"]


def select_rows(batch: Batch, rows: torch.Tensor) -> Batch:
    """The samples `rows` (int64 indices into the batch, in that order) of `batch`."""
    kjt = batch.sparse_features
    n = kjt.stride()
    keys = kjt.keys()
    lengths = kjt.lengths().reshape(len(keys), n)
    offsets = kjt.offsets()[:-1].reshape(len(keys), n)
    picked_lengths = lengths[:, rows]
    starts = offsets[:, rows].reshape(-1)
    counts = picked_lengths.reshape(-1).to(torch.int64)
    # Each picked sample's ids are values[start : start + length]: repeat each start by its
    # length and add 0, 1, ... within the run.
    first = torch.repeat_interleave(starts.to(torch.int64), counts)
    run_starts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    index = first + torch.arange(first.numel(), dtype=torch.int64) - run_starts
    weights = kjt.weights_or_none()
    return Batch(
        dense_features=batch.dense_features[rows],
        sparse_features=KeyedJaggedTensor(
            keys=keys,
            values=kjt.values()[index],
            weights=weights[index] if weights is not None else None,
            lengths=picked_lengths.reshape(-1),
            stride=int(rows.numel()),
        ),
        labels=batch.labels[rows],
    )


def _mix(*xs: int) -> int:
    h = 0x2545F4914F6CDD1D
    for x in xs:
        h = (h ^ (x & 0xFFFFFFFFFFFFFFFF)) * 0x100000001B3 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return h & ((1 << 63) - 1)


class Undersample:
    """Iterable over `batches` with label-0 rows kept with probability `rate` (see module
    doc). `len()` is that of `batches` (no batch is dropped)."""

    def __init__(self, batches: Iterable[Batch], rate: float, seed: int, rank: int) -> None:
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"undersampling rate must be in (0, 1], got {rate}")
        self.batches = batches
        self.rate = float(rate)
        self.seed = int(seed)
        self.rank = int(rank)

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Batch]:
        for j, batch in enumerate(self.batches):
            g = torch.Generator().manual_seed(_mix(self.seed, self.rank, j))
            labels = batch.labels.reshape(-1)
            keep = (labels != 0) | (torch.rand(labels.numel(), generator=g) < self.rate)
            if not bool(keep.any()):
                keep[0] = True
            if bool(keep.all()):
                yield batch
            else:
                yield select_rows(batch, torch.nonzero(keep).reshape(-1))


class MappedBatches:
    """`fn` applied to every batch of `batches`, re-iterable, with `len()` (TorchRec's
    example's ``RestartableMap``)."""

    def __init__(self, fn: Any, batches: Iterable[Any]) -> None:
        self.fn = fn
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        for batch in self.batches:
            yield self.fn(batch)
