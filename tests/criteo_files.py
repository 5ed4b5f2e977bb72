"""Tiny Criteo files for the data tests: TSV days, TorchRec's preprocessing of them, and the
arrays they must turn into, computed here independently from the TSV text."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tsv_lines(rows: int, rng: np.random.Generator) -> list[str]:
    """Criteo rows: label, 13 integer counts (some negative, some empty), 26 hex values
    (some empty)."""
    lines = []
    for _ in range(rows):
        label = str(int(rng.integers(0, 2)))
        dense = [str(int(x)) if rng.random() > 0.1 else "" for x in rng.integers(-3, 200, 13)]
        cats = [format(int(x), "x") if rng.random() > 0.1 else ""
                for x in rng.integers(0, 2**32, 26)]
        lines.append("\t".join([label, *dense, *cats]))
    return lines


def write_days(directory: Path, rows_per_day: list[int], seed: int = 0,
               names: list[str] | None = None) -> list[Path]:
    """TSV files `day_{i}` (or `names`) with the given row counts."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, rows in enumerate(rows_per_day):
        path = directory / (names[i] if names else f"day_{i}")
        path.write_text("\n".join(tsv_lines(rows, rng)) + "\n")
        paths.append(path)
    return paths


def preprocess(tsv_dir: Path, npy_dir: Path, dataset_name: str = "criteo_1tb") -> None:
    """TorchRec's own preprocessing script over a directory of TSVs."""
    from torchrec.datasets.scripts import npy_preproc_criteo

    npy_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.redirect_stdout(io.StringIO()):
        npy_preproc_criteo.main(["--input_dir", str(tsv_dir), "--output_dir", str(npy_dir),
                                 "--dataset_name", dataset_name])


def expected(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dense, raw sparse, labels) of a TSV file, as the model must see them before hashing:
    dense ``log(x - min + 2)`` with the file's minimum (empty fields are 0), sparse the hex
    values (empty: 0), labels as integers."""
    rows = [line.split("\t") for line in path.read_text().splitlines()]
    dense = np.array([[int(x or "0") for x in r[1:14]] for r in rows], dtype=np.float64)
    sparse = np.array([[int(x or "0", 16) for x in r[14:]] for r in rows], dtype=np.int64)
    labels = np.array([int(r[0] or "0") for r in rows], dtype=np.int64)
    return np.log(dense - dense.min() + 2.0), sparse, labels


def example(name: str) -> Any:
    """A module of the DLRM example (`dlrm_main`, `dlrm_flags`, `dlrm_dataloader`,
    `lr_scheduler`)."""
    sys.path.insert(0, os.path.join(REPO, "examples", "dlrm"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def example_args(argv: list[str]) -> argparse.Namespace:
    """The DLRM example's parsed flags."""
    return example("dlrm_flags").parse_args(argv)


def loader(argv: list[str], stage: str, rank: int, world: int):
    """What the example feeds the model for `stage` on `rank` of `world`."""
    data = example("dlrm_dataloader")
    args = example_args(argv)
    return data.get_dataloader(args, stage, rank, world, data.make_multi_hot(args))


def global_stream(argv: list[str], stage: str, world: int) -> list:
    """Every rank's batches of `stage` in the global order (batch j from rank j % world)."""
    per_rank = [list(loader(argv, stage, r, world)) for r in range(world)]
    counts = {len(b) for b in per_rank}
    assert len(counts) == 1, f"ranks got different numbers of batches: {counts}"
    return [per_rank[j % world][j // world] for j in range(world * counts.pop())]


def stack(batches: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dense, sparse N x 26, labels) of one-hot batches, concatenated."""
    dense = np.concatenate([b.dense_features.numpy() for b in batches])
    sparse = np.concatenate([
        b.sparse_features.values().numpy().reshape(26, -1).T for b in batches])
    labels = np.concatenate([b.labels.numpy().reshape(-1) for b in batches])
    return dense, sparse, labels
