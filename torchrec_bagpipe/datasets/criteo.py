"""Criteo click logs through TorchRec's own readers: file layouts, stages and TSV conversion.

TorchRec's preprocessing (`torchrec.datasets.scripts.npy_preproc_criteo`, i.e.
`BinaryCriteoUtils.tsv_to_npys`) writes per file `<name>_dense.npy` (float32, already
``log(x - min + 2)``), `<name>_sparse.npy` (int64 hashed ids) and `<name>_labels.npy`
(int32, N x 1). `InMemoryBinaryCriteoIterDataPipe` reads them: it splits the last file of
the val/test stages into halves (val: the first ``ceil(n/2)`` rows, test: the rest), takes
ids modulo the table sizes (`hashes`), can shuffle the training set and each batch, and gives
batch j of the global stream to rank ``j % world_size`` (the last, partial round split
evenly). This module only decides which files each stage reads:

* ``criteo_1t`` (TorchRec's day layout, `day_{i}_*`): days are ordered by their number
  (``day_2`` before ``day_10``); train is every day but the last, val and test are the two
  halves of the last day. With all 24 days this is exactly TorchRec's example; fewer
  consecutive days (``day_0`` .. ``day_{n-1}``, n >= 2) work the same way.
* ``criteo_kaggle`` (`train_*`): Kaggle's test file has no labels, so TorchRec's example
  evaluates on the second half of `train_*`. Its training stage reads the whole file, so it
  trains on its own validation and test rows; here training reads the first half only
  (TorchRec's "val" half) and val and test are the second half (TorchRec's "test" half).

TSV files are converted with TorchRec's own `BinaryCriteoUtils.tsv_to_npys` (into
`day_{i}_*` in the order given, or `train_*` for Kaggle) and then read as above, so a TSV
and its preprocessed NPY files feed the model identical batches.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "CRITEO_1T",
    "CRITEO_KAGGLE",
    "DATASET_NAMES",
    "StageFiles",
    "convert_tsvs",
    "criteo_days",
    "stage_files",
]

CRITEO_1T = "criteo_1t"
CRITEO_KAGGLE = "criteo_kaggle"
DATASET_NAMES = (CRITEO_1T, CRITEO_KAGGLE)
STAGES = ("train", "val", "test")
PARTS = ("dense", "sparse", "labels")
NPY_SPARSE = "sparse.npy"
MULTI_HOT_SPARSE = "sparse_multi_hot.npz"

_DAY = re.compile(r"^day_(\d+)_dense\.npy$")


@dataclass(frozen=True)
class StageFiles:
    """The files of one stage and the stage TorchRec's reader is built with (it selects
    the half of the first file: ``"val"`` the first half, ``"test"`` the second, ``"train"``
    all rows)."""

    reader_stage: str
    dense: list[str]
    sparse: list[str]
    labels: list[str]


def _part(root: str, name: str, part: str, sparse_part: str) -> str:
    suffix = sparse_part if part == "sparse" else f"{part}.npy"
    return os.path.join(root, f"{name}_{suffix}")


def _require(paths: Sequence[str]) -> None:
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(f"Criteo files missing: {', '.join(missing)}")


def criteo_days(root: str, sparse_part: str = NPY_SPARSE) -> int:
    """The number n of days `day_0` .. `day_{n-1}` in `root` (numeric order, no gaps, every
    part present). Raises FileNotFoundError for a missing part or a gap, ValueError below 2
    days (training needs one day, validation and test the last)."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"Criteo directory not found: {root}")
    numbers = sorted(int(m.group(1)) for f in os.listdir(root) if (m := _DAY.match(f)))
    if not numbers:
        raise FileNotFoundError(
            f"no day_<i>_dense.npy files in {root} (TorchRec's Criteo 1TB layout; for the "
            "Kaggle layout, train_*.npy, pass --dataset_name criteo_kaggle)"
        )
    n = numbers[-1] + 1
    gaps = sorted(set(range(n)) - set(numbers))
    if gaps:
        raise FileNotFoundError(
            f"{root}: day_{gaps[0]}_dense.npy is missing but day_{n - 1}_dense.npy exists "
            "(days must be day_0 .. day_{n-1})"
        )
    _require([_part(root, f"day_{d}", p, sparse_part) for d in range(n) for p in PARTS])
    if n < 2:
        raise ValueError(
            f"{root} holds one day; the Criteo layout needs at least two (training days, "
            "then the day whose halves are the validation and test sets)"
        )
    return n


def stage_files(root: str, dataset_name: str, stage: str,
                sparse_part: str = NPY_SPARSE) -> StageFiles:
    """The files `stage` ("train", "val", "test") reads from `root` (see module doc)."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    if dataset_name == CRITEO_KAGGLE:
        files = [[_part(root, "train", p, sparse_part)] for p in PARTS]
        _require([f[0] for f in files])
        reader_stage = "val" if stage == "train" else "test"
        return StageFiles(reader_stage, *files)
    if dataset_name != CRITEO_1T:
        raise ValueError(f"dataset_name must be one of {DATASET_NAMES}, got {dataset_name!r}")
    n = criteo_days(root, sparse_part)
    days = range(n - 1) if stage == "train" else [n - 1]
    files = [[_part(root, f"day_{d}", p, sparse_part) for d in days] for p in PARTS]
    return StageFiles(stage, *files)


def convert_tsvs(paths: Sequence[str], out_dir: str, dataset_name: str = CRITEO_1T) -> str:
    """Converts Criteo TSV files with TorchRec's `BinaryCriteoUtils.tsv_to_npys` into
    `out_dir` (``day_{i}_*`` in the order given; ``train_*`` for one Kaggle file) and
    returns `out_dir`. A file whose three outputs exist and are newer than it is skipped."""
    from torchrec.datasets.criteo import BinaryCriteoUtils

    paths = [os.fspath(p) for p in paths]
    _require(paths)
    if dataset_name == CRITEO_KAGGLE:
        if len(paths) != 1:
            raise ValueError(
                f"criteo_kaggle reads one TSV file (Kaggle's train.txt), got {len(paths)}"
            )
        names = ["train"]
    elif dataset_name == CRITEO_1T:
        if len(paths) < 2:
            raise ValueError(
                "criteo_1t needs at least two TSV days (training days, then the day whose "
                f"halves are the validation and test sets), got {len(paths)}"
            )
        names = [f"day_{i}" for i in range(len(paths))]
    else:
        raise ValueError(f"dataset_name must be one of {DATASET_NAMES}, got {dataset_name!r}")
    os.makedirs(out_dir, exist_ok=True)
    for path, name in zip(paths, names):
        outs = [_part(out_dir, name, p, NPY_SPARSE) for p in PARTS]
        if all(os.path.isfile(o) and os.path.getmtime(o) >= os.path.getmtime(path)
               for o in outs):
            continue
        # Both layouts hold labelled rows: "criteo_1tb" parses them as TorchRec does for
        # either ("criteo_kaggle" would give every row label -1 when the path contains
        # "test", which is meant for Kaggle's unlabelled test.txt only).
        BinaryCriteoUtils.tsv_to_npys(path, *outs, dataset_name="criteo_1tb")
    return out_dir
