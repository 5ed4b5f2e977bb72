"""Multi-hot Criteo: the MLPerf DLRM v2 synthetic multi-hot files and one-hot -> multi-hot.

TorchRec ships no reader for these; TorchRec's DLRM example (`torchrec_dlrm/`) defines both,
and this module follows its formats and arithmetic:

* `MultiHotCriteoDataset` reads the materialized dataset: `day_{i}_dense.npy`,
  `day_{i}_labels.npy` and `day_{i}_sparse_multi_hot.npz`, an uncompressed npz whose member
  ``"{f}.npy"`` is feature f's int32 ``N x m_f`` id matrix (ids already hashed into the
  tables). Stages, val/test halves, batch sizes, rank assignment and `shuffle_batches`
  follow `torchrec.datasets.criteo.InMemoryBinaryCriteoIterDataPipe` (`rank_batch_rows`
  computes its batch schedule); with `mmap_mode` the npz members are memory-mapped.
* `MultiHot` turns one-hot batches into multi-hot ones as `--multi_hot_sizes` does: per
  table a lookup table whose row i is ``[i, r_1 .. r_{m-1}]``, the r drawn once from numpy's
  global generator seeded 0 (uniform ids, or ``pareto(a=0.25)`` cast to int32 modulo the
  table size), so every rank — and the materialization script — builds the same tables.
  It can count id frequencies before and after the expansion (`--collect_multi_hot_freqs_
  stats`) and save them as TorchRec's example does.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, DEFAULT_CAT_NAMES
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["MultiHot", "MultiHotCriteoDataset", "load_npz_member", "rank_batch_rows"]

DISTRIBUTIONS = ("uniform", "pareto")


def rank_batch_rows(total_rows: int, batch_size: int, rank: int, world_size: int,
                    drop_last: bool) -> list[tuple[int, int]]:
    """Row ranges [start, stop) of this rank's batches in a stream of `total_rows` rows, as
    `InMemoryBinaryCriteoIterDataPipe` deals them: global batch j goes to rank
    ``j % world_size``; full batches first, then (unless `drop_last`) one last round that
    splits the remaining rows evenly over the ranks (the first ranks take one more)."""
    if batch_size < 1 or not 0 <= rank < world_size:
        raise ValueError("batch_size must be >= 1 and 0 <= rank < world_size")
    full = total_rows // batch_size // world_size * world_size
    last = np.zeros(world_size, dtype=np.int64)
    remainder = total_rows % (world_size * batch_size)
    if not drop_last and remainder > 0:
        if remainder < world_size:
            if full == 0:
                raise ValueError(
                    f"{total_rows} rows cannot give each of {world_size} ranks a batch"
                )
            full -= world_size  # the last full round absorbs the few remaining rows
            last += batch_size
        else:
            last += remainder // world_size
        last[: remainder % world_size] += 1
    sizes = [batch_size] * full + ([int(x) for x in last] if last[0] > 0 else [])
    bounds = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    return [(int(bounds[j]), int(bounds[j + 1])) for j in range(rank, len(sizes), world_size)]


def load_npz_member(path: str, member: str, mmap: bool) -> np.ndarray:
    """One array of an npz file; with `mmap`, memory-mapped in place (the member must be
    stored uncompressed, as `np.savez` writes it)."""
    if not mmap:
        with np.load(path) as npz:
            return npz[member.removesuffix(".npy")]
    with zipfile.ZipFile(path) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise KeyError(f"{path} has no member {member!r}") from None
        if info.compress_type != zipfile.ZIP_STORED:
            raise ValueError(f"{path}:{member} is compressed; --mmap_mode needs np.savez files")
    with open(path, "rb") as f:
        # The local file header: 30 fixed bytes, then the name and the extra field.
        f.seek(info.header_offset + 26)
        name_len, extra_len = np.frombuffer(f.read(4), dtype="<u2")
        f.seek(info.header_offset + 30 + int(name_len) + int(extra_len))
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        offset = f.tell()
    return np.memmap(path, dtype=dtype, mode="r", shape=shape, offset=offset,
                     order="F" if fortran else "C")


class MultiHotCriteoDataset(IterableDataset):
    """Batches of this rank from MLPerf-style multi-hot Criteo files (see module doc).

    Args mirror `InMemoryBinaryCriteoIterDataPipe`: `stage` ("train": every file; "val" /
    "test": the first / second half of the first file), the three path lists, batch size,
    rank and world size, `drop_last`, `shuffle_batches` (rows of each batch permuted with
    numpy's global generator, which `seed` seeds at construction as TorchRec's reader does)
    and `mmap_mode`.
    """

    def __init__(self, stage: str, dense_paths: Sequence[str], sparse_paths: Sequence[str],
                 labels_paths: Sequence[str], batch_size: int, rank: int, world_size: int,
                 drop_last: bool = False, shuffle_batches: bool = False,
                 seed: int | None = None, mmap_mode: bool = False) -> None:
        super().__init__()
        if stage not in ("train", "val", "test"):
            raise ValueError(f"stage must be train, val or test, got {stage!r}")
        if not (len(dense_paths) == len(sparse_paths) == len(labels_paths)) or not dense_paths:
            raise ValueError("dense, sparse and labels paths must be non-empty lists of one length")
        np.random.seed(seed)
        self.shuffle_batches = shuffle_batches
        m = "r" if mmap_mode else None
        self._files = []
        for d, s, lab in zip(dense_paths, sparse_paths, labels_paths):
            dense = np.load(d, mmap_mode=m)
            labels = np.load(lab, mmap_mode=m)
            sparse = [load_npz_member(os.fspath(s), f"{f}.npy", mmap_mode)
                      for f in range(CAT_FEATURE_COUNT)]
            for f, arr in enumerate(sparse):
                if arr.dtype != np.int32 or arr.ndim != 2 or len(arr) != len(dense):
                    raise ValueError(
                        f"{s}: feature {f} must be an int32 N x m array with N = {len(dense)} "
                        f"rows, got {arr.dtype} {arr.shape}"
                    )
            if len(labels) != len(dense):
                raise ValueError(f"row counts differ between {d}, {s} and {lab}")
            self._files.append((dense, sparse, labels))
        if stage != "train":
            dense, sparse, labels = self._files[0]
            half = (len(dense) + 1) // 2
            cut = slice(0, half) if stage == "val" else slice(half, None)
            self._files[0] = (dense[cut], [a[cut] for a in sparse], labels[cut])
        self.multi_hot_sizes = [int(a.shape[1]) for a in self._files[0][1]]
        self._starts = np.concatenate([[0], np.cumsum([len(f[0]) for f in self._files])])
        self._batches = rank_batch_rows(int(self._starts[-1]), batch_size, rank, world_size,
                                        drop_last)

    def __len__(self) -> int:
        return len(self._batches)

    def _rows(self, start: int, stop: int) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
        parts = []
        for i, (dense, sparse, labels) in enumerate(self._files):
            lo = max(start, int(self._starts[i])) - int(self._starts[i])
            hi = min(stop, int(self._starts[i + 1])) - int(self._starts[i])
            if lo < hi:
                parts.append((dense[lo:hi], [a[lo:hi] for a in sparse], labels[lo:hi]))
        dense = np.concatenate([p[0] for p in parts])
        sparse = [np.concatenate([p[1][f] for p in parts]) for f in range(CAT_FEATURE_COUNT)]
        labels = np.concatenate([p[2] for p in parts])
        return dense, sparse, labels

    def __iter__(self) -> Iterator[Batch]:
        for start, stop in self._batches:
            dense, sparse, labels = self._rows(start, stop)
            if self.shuffle_batches:
                order = np.random.permutation(len(dense))
                dense, labels = dense[order], labels[order]
                sparse = [a[order] for a in sparse]
            yield _multi_hot_batch(dense, sparse, labels)


def _multi_hot_batch(dense: np.ndarray, sparse: list[np.ndarray], labels: np.ndarray) -> Batch:
    n = len(dense)
    sizes = [int(a.shape[1]) for a in sparse]
    return Batch(
        dense_features=torch.from_numpy(np.ascontiguousarray(dense)),
        sparse_features=KeyedJaggedTensor(
            keys=list(DEFAULT_CAT_NAMES),
            values=torch.from_numpy(np.concatenate([a.reshape(-1) for a in sparse])),
            lengths=torch.tensor(sizes, dtype=torch.int32).repeat_interleave(n),
            stride=n,
        ),
        labels=torch.from_numpy(np.ascontiguousarray(labels).reshape(-1)),
    )


class MultiHot:
    """One-hot -> multi-hot expansion of Criteo batches (see module doc).

    `convert(batch, count)` maps each feature's ids through its lookup table; with
    `collect_freqs_stats` and `count`, id frequencies before and after are accumulated.
    """

    def __init__(self, multi_hot_sizes: Sequence[int], num_embeddings_per_feature: Sequence[int],
                 collect_freqs_stats: bool = False, dist_type: str = "uniform") -> None:
        if dist_type not in DISTRIBUTIONS:
            raise ValueError(f"multi-hot distribution must be one of {DISTRIBUTIONS}, got "
                             f"{dist_type!r}")
        sizes = [int(m) for m in multi_hot_sizes]
        tables = [int(n) for n in num_embeddings_per_feature]
        if len(sizes) != len(tables) or min(sizes) < 1 or min(tables) < 1:
            raise ValueError(
                f"multi_hot_sizes ({len(sizes)} values) must match the {len(tables)} tables and "
                "be >= 1"
            )
        self.dist_type = dist_type
        self.multi_hot_sizes = sizes
        self.num_embeddings_per_feature = tables
        self.collect_freqs_stats = collect_freqs_stats
        # One draw sequence from numpy's global generator seeded 0: identical on every rank
        # and in the materialization script.
        np.random.seed(0)
        self.tables: list[torch.Tensor] = []
        for n, m in zip(tables, sizes):
            if dist_type == "uniform":
                extra = np.random.randint(0, n, size=(n, m - 1))
            else:
                extra = np.random.pareto(a=0.25, size=(n, m - 1)).astype(np.int32) % n
            table = np.concatenate([np.arange(n)[:, None], extra], axis=1)
            self.tables.append(torch.from_numpy(table).int())
        self.freqs_pre_hash = [np.zeros(n) for n in tables]
        self.freqs_post_hash = [np.zeros(n) for n in tables]

    def convert(self, batch: Batch, count: bool = False) -> Batch:
        """The multi-hot batch of a one-hot `batch` (one id per sample and feature)."""
        kjt = batch.sparse_features
        n = kjt.stride()
        keys = kjt.keys()
        if len(keys) != len(self.tables) or kjt.values().numel() != n * len(keys):
            raise ValueError(
                f"MultiHot converts one-hot batches of {len(self.tables)} features, got "
                f"{len(keys)} features with {kjt.values().numel()} ids for {n} samples"
            )
        ids = kjt.values().reshape(len(keys), n)
        values = []
        for f, table in enumerate(self.tables):
            multi = torch.nn.functional.embedding(ids[f].to(torch.int64), table).reshape(-1)
            values.append(multi)
            if self.collect_freqs_stats and count:
                for freqs, seen in ((self.freqs_pre_hash[f], ids[f]),
                                    (self.freqs_post_hash[f], multi)):
                    idx, cnt = np.unique(seen.numpy(), return_counts=True)
                    freqs[idx] += cnt
        lengths = torch.tensor(self.multi_hot_sizes, dtype=torch.int32).repeat_interleave(n)
        return Batch(
            dense_features=batch.dense_features,
            sparse_features=KeyedJaggedTensor(keys=keys, values=torch.cat(values),
                                              lengths=lengths, stride=n),
            labels=batch.labels,
        )

    def save_freqs_stats(self, rank: int, directory: str = ".") -> list[str]:
        """Writes ``stats_{pre,post}_hash_{rank}_{dist}.npy`` (a dict feature index -> counts
        per id) as TorchRec's example does; returns the paths."""
        paths = []
        for when, freqs in (("pre", self.freqs_pre_hash), ("post", self.freqs_post_hash)):
            path = os.path.join(directory, f"stats_{when}_hash_{rank}_{self.dist_type}.npy")
            np.save(path, {str(k): v for k, v in enumerate(freqs)})
            paths.append(path)
        return paths
