"""The DLRM example's data: what each stage feeds the model, by dlrm_main's flags.

* ``--in_memory_binary_criteo_path DIR``: TorchRec's preprocessed NPY files through
  `torchrec.datasets.criteo.InMemoryBinaryCriteoIterDataPipe` (its day order, val/test halves,
  hashing by table size, ``--shuffle_batches``, ``--shuffle_training_set``, ``--mmap_mode``,
  ``--drop_last_training_batch``); the layout per ``--dataset_name`` is in
  `torchrec_bagpipe.datasets.criteo`.
* ``--criteo_tsv_paths A,B,..``: raw TSV files, converted by TorchRec's own
  `BinaryCriteoUtils.tsv_to_npys` into a private temporary directory per process, then read
  as above (small experiments; preprocess large data once with TorchRec's script).
* ``--synthetic_multi_hot_criteo_path DIR``: the MLPerf multi-hot files as TorchRec's example
  reads them (`torchrec_bagpipe.datasets.MultiHotCriteoDataset`).
* none of these: the synthetic power-law dataset (`PowerLawCriteoDataset`, ``--zipf_alpha``):
  ``limit_*_batches`` batches per stage (10 when unset), streams 0/1/2 of one hidden model.

Then, as TorchRec's example: a `DataLoader` (``--pin_memory``); ``--undersampling_rate`` on
the training stage (`Undersample`); ``--multi_hot_sizes`` expands one-hot batches
(`MultiHot`, counting id frequencies of training batches with
``--collect_multi_hot_freqs_stats``).
"""

from __future__ import annotations

import argparse
import atexit
import tempfile
from typing import Any

from torch.utils.data import DataLoader
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, InMemoryBinaryCriteoIterDataPipe

from torchrec_bagpipe.datasets import (
    MappedBatches,
    MultiHot,
    MultiHotCriteoDataset,
    PowerLawCriteoDataset,
    Undersample,
    convert_tsvs,
    stage_files,
)
from torchrec_bagpipe.datasets.criteo import MULTI_HOT_SPARSE

__all__ = ["RAW_CRITEO_IDS", "STAGES", "SYNTHETIC_RAW_IDS", "get_dataloader", "make_multi_hot",
           "table_sizes"]

STAGES = ("train", "val", "test")
SYNTHETIC_DEFAULT_BATCHES = 10
_STREAM = {"train": 0, "val": 1, "test": 2}
_converted: dict[tuple[str, ...], str] = {}
# --virtual_tables: the id space of a table (Criteo's categorical values are 32-bit hex, read
# by TorchRec's preprocessing as they are) and the raw ids the synthetic data draws from.
RAW_CRITEO_IDS = 1 << 32
SYNTHETIC_RAW_IDS = (1 << 31) - 1


def table_sizes(args: argparse.Namespace) -> list[int]:
    """Rows of each of the 26 tables (``--num_embeddings_per_feature`` or
    ``--num_embeddings``); also the hashes applied to Criteo ids. With ``--virtual_tables``
    the id space of raw Criteo ids (nothing is hashed)."""
    if getattr(args, "virtual_tables", False):
        return [RAW_CRITEO_IDS] * len(DEFAULT_CAT_NAMES)
    if args.num_embeddings_per_feature is not None:
        return list(args.num_embeddings_per_feature)
    return [args.num_embeddings] * len(DEFAULT_CAT_NAMES)


def _npy_root(args: argparse.Namespace) -> str:
    if args.in_memory_binary_criteo_path is not None:
        return args.in_memory_binary_criteo_path
    key = (args.dataset_name, *args.criteo_tsv_paths)
    if key not in _converted:
        tmp = tempfile.TemporaryDirectory(prefix="criteo_npy_")
        atexit.register(tmp.cleanup)
        _converted[key] = convert_tsvs(args.criteo_tsv_paths, tmp.name, args.dataset_name)
    return _converted[key]


def _dataset(args: argparse.Namespace, stage: str, rank: int, world: int) -> Any:
    batch_size = args.batch_size
    if stage != "train" and args.test_batch_size is not None:
        batch_size = args.test_batch_size
    drop_last = bool(args.drop_last_training_batch) if stage == "train" else False
    if args.in_memory_binary_criteo_path is not None or args.criteo_tsv_paths is not None:
        files = stage_files(_npy_root(args), args.dataset_name, stage)
        return InMemoryBinaryCriteoIterDataPipe(
            files.reader_stage, files.dense, files.sparse, files.labels,
            batch_size=batch_size, rank=rank, world_size=world, drop_last=drop_last,
            shuffle_batches=bool(args.shuffle_batches),
            shuffle_training_set=bool(args.shuffle_training_set),
            shuffle_training_set_random_seed=args.seed,
            mmap_mode=bool(args.mmap_mode),
            hashes=None if getattr(args, "virtual_tables", False) else table_sizes(args),
        )
    if args.synthetic_multi_hot_criteo_path is not None:
        files = stage_files(args.synthetic_multi_hot_criteo_path, args.dataset_name, stage,
                            MULTI_HOT_SPARSE)
        return MultiHotCriteoDataset(
            files.reader_stage, files.dense, files.sparse, files.labels, batch_size, rank,
            world, drop_last=drop_last, shuffle_batches=bool(args.shuffle_batches),
            seed=args.seed, mmap_mode=bool(args.mmap_mode),
        )
    limit = getattr(args, f"limit_{stage}_batches")
    sizes = table_sizes(args)
    if getattr(args, "virtual_tables", False):  # raw ids: the generator's own id space
        sizes = [SYNTHETIC_RAW_IDS] * len(sizes)
    return PowerLawCriteoDataset(
        sizes, batch_size,
        limit if limit is not None else SYNTHETIC_DEFAULT_BATCHES,
        zipf_alpha=args.zipf_alpha, seed=args.seed or 0, rank=rank, world_size=world,
        stream=_STREAM[stage], drift=args.zipf_drift if stage == "train" else 0.0,
    )


def make_multi_hot(args: argparse.Namespace) -> MultiHot | None:
    """The one-hot -> multi-hot expansion of ``--multi_hot_sizes``, or None."""
    if args.multi_hot_sizes is None:
        return None
    return MultiHot(args.multi_hot_sizes, table_sizes(args),
                    collect_freqs_stats=bool(args.collect_multi_hot_freqs_stats),
                    dist_type=args.multi_hot_distribution_type or "uniform")


def get_dataloader(args: argparse.Namespace, stage: str, rank: int, world: int,
                   multi_hot: MultiHot | None = None) -> Any:
    """What `stage` feeds the model on this rank: a re-iterable of `Batch` with `len()`."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    loader: Any = DataLoader(
        _dataset(args, stage, rank, world),
        batch_size=None,
        pin_memory=bool(args.pin_memory),
        collate_fn=lambda x: x,
    )
    if stage == "train" and args.undersampling_rate is not None:
        loader = Undersample(loader, args.undersampling_rate, args.seed or 0, rank)
    if multi_hot is not None:
        count = stage == "train"
        loader = MappedBatches(lambda b: multi_hot.convert(b, count=count), loader)
    return loader
