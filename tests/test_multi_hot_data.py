"""Multi-hot Criteo: the one-hot -> multi-hot expansion (``--multi_hot_sizes``,
``--multi_hot_distribution_type``, ``--collect_multi_hot_freqs_stats``) and the MLPerf
multi-hot files (``--synthetic_multi_hot_criteo_path``) materialized from the same tables."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from criteo_files import example, example_args, loader, preprocess, write_days

from torchrec_bagpipe.datasets import MultiHot, PowerLawCriteoDataset

SIZES = [50, 7, 300] + [40] * 23
MULTI = [3, 1, 5] + [2] * 23
DAY_ROWS = [6, 9, 5, 8] * 5 + [7, 6, 8, 15]


def _flags(*extra: str) -> list[str]:
    return ["--batch_size", "4", "--num_embeddings_per_feature", ",".join(map(str, SIZES)),
            *extra]


@pytest.fixture(scope="module")
def days(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """24 preprocessed days and their materialized multi-hot version (as TorchRec's
    materialize_synthetic_multihot_dataset.py writes it: hashed ids through the tables,
    one uncompressed npz per day, dense and labels copied)."""
    root = tmp_path_factory.mktemp("multi")
    write_days(root / "tsv", DAY_ROWS, seed=11)
    preprocess(root / "tsv", root / "npy")
    out = root / "multi"
    out.mkdir()
    tables = MultiHot(MULTI, SIZES).tables
    for d in range(24):
        sparse = np.load(root / "npy" / f"day_{d}_sparse.npy")
        np.savez(out / f"day_{d}_sparse_multi_hot.npz", **{
            str(f): torch.nn.functional.embedding(
                torch.from_numpy(sparse[:, f] % SIZES[f]), tables[f]).numpy()
            for f in range(26)})
        for part in ("dense", "labels"):
            shutil.copy(root / "npy" / f"day_{d}_{part}.npy", out / f"day_{d}_{part}.npy")
    return {"npy": root / "npy", "multi": out}


def test_tables_start_with_the_one_hot_id_and_are_the_same_everywhere():
    a, b = MultiHot(MULTI, SIZES), MultiHot(MULTI, SIZES)
    pareto = MultiHot(MULTI, SIZES, dist_type="pareto")
    for f, (n, m) in enumerate(zip(SIZES, MULTI)):
        t = a.tables[f]
        assert t.shape == (n, m) and t.dtype == torch.int32
        assert torch.equal(t[:, 0], torch.arange(n, dtype=torch.int32))
        assert int(t.min()) >= 0 and int(t.max()) < n
        assert torch.equal(t, b.tables[f])
        assert int(pareto.tables[f].max()) < n
    assert not torch.equal(a.tables[2], pareto.tables[2])
    # Pareto(0.25) piles the extra ids onto the small ones; uniform spreads them.
    assert float(pareto.tables[2][:, 1:].float().median()) < 0.2 * SIZES[2]
    assert float(a.tables[2][:, 1:].float().median()) > 0.3 * SIZES[2]
    with pytest.raises(ValueError, match="distribution"):
        MultiHot(MULTI, SIZES, dist_type="zipf")
    with pytest.raises(ValueError, match="match"):
        MultiHot(MULTI[:3], SIZES)


def test_conversion_and_frequency_stats(tmp_path):
    one_hot = PowerLawCriteoDataset(SIZES, 16, 1, seed=2).batch(0)
    mh = MultiHot(MULTI, SIZES, collect_freqs_stats=True)
    out = mh.convert(one_hot, count=True)
    kjt, ids = out.sparse_features, one_hot.sparse_features
    for f, key in enumerate(kjt.keys()):
        assert kjt[key].lengths().tolist() == [MULTI[f]] * 16
        want = mh.tables[f][ids[key].values().long()].reshape(-1)
        assert torch.equal(kjt[key].values(), want)
    assert torch.equal(out.dense_features, one_hot.dense_features)
    mh.convert(one_hot, count=False)  # evaluation batches are not counted
    assert mh.freqs_pre_hash[2].sum() == 16
    assert mh.freqs_post_hash[2].sum() == 16 * MULTI[2]
    assert np.array_equal(mh.freqs_pre_hash[0],
                          np.bincount(ids["cat_0"].values().numpy(), minlength=SIZES[0]))
    paths = mh.save_freqs_stats(rank=1, directory=str(tmp_path))
    assert [os.path.basename(p) for p in paths] == ["stats_pre_hash_1_uniform.npy",
                                                    "stats_post_hash_1_uniform.npy"]
    saved = np.load(paths[1], allow_pickle=True).item()
    assert np.array_equal(saved["2"], mh.freqs_post_hash[2])


def _same(a: list, b: list) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert torch.equal(x.dense_features, y.dense_features)
        assert x.sparse_features.keys() == y.sparse_features.keys()
        assert torch.equal(x.sparse_features.lengths(), y.sparse_features.lengths())
        assert torch.equal(x.sparse_features.values().long(), y.sparse_features.values().long())
        assert torch.equal(x.labels.reshape(-1), y.labels.reshape(-1))


@pytest.mark.parametrize("mmap", [False, True])
def test_materialized_files_feed_what_on_the_fly_expansion_feeds(days, mmap):
    multi = ["--synthetic_multi_hot_criteo_path", str(days["multi"])]
    expand = ["--in_memory_binary_criteo_path", str(days["npy"]),
              "--multi_hot_sizes", ",".join(map(str, MULTI))]
    extra = ["--mmap_mode"] if mmap else []
    for stage in ("train", "val", "test"):
        for rank in range(2):
            got = list(loader(_flags(*multi, *extra), stage, rank, 2))
            _same(got, list(loader(_flags(*expand), stage, rank, 2)))
    if mmap:
        ds = loader(_flags(*multi, *extra), "train", 0, 2).dataset
        assert all(isinstance(a, np.memmap) for a in ds._files[0][1])


def test_multi_hot_files_drop_last_and_shuffle_batches(days):
    multi = ["--synthetic_multi_hot_criteo_path", str(days["multi"])]
    full = list(loader(_flags(*multi), "train", 0, 1))
    assert sum(len(b.labels) for b in full) == sum(DAY_ROWS[:23])
    dropped = list(loader(_flags(*multi, "--drop_last_training_batch"), "train", 0, 1))
    assert [len(b.labels) for b in dropped] == [4] * (sum(DAY_ROWS[:23]) // 4)
    shuffled = list(loader(_flags(*multi, "--shuffle_batches", "--seed", "2"), "train", 0, 1))
    moved = 0
    for a, b in zip(full, shuffled):
        order = [a.labels.tolist(), a.dense_features[:, 0].tolist()]
        other = [b.labels.tolist(), b.dense_features[:, 0].tolist()]
        assert sorted(zip(*order)) == sorted(zip(*other))
        moved += order != other
    assert moved > 0


def test_distribution_type_and_stats_flags_reach_the_expansion(days, tmp_path):
    expand = ["--in_memory_binary_criteo_path", str(days["npy"]),
              "--multi_hot_sizes", ",".join(map(str, MULTI))]
    uniform = next(iter(loader(_flags(*expand), "train", 0, 1)))
    pareto = next(iter(loader(_flags(*expand, "--multi_hot_distribution_type", "pareto"),
                              "train", 0, 1)))
    assert not torch.equal(uniform.sparse_features.values(), pareto.sparse_features.values())
    data = example("dlrm_dataloader")
    for flag, counted in (([], 0), (["--collect_multi_hot_freqs_stats"], 1)):
        args = example_args(_flags(*expand, *flag))
        multi_hot = data.make_multi_hot(args)
        first = next(iter(data.get_dataloader(args, "train", 0, 1, multi_hot)))
        assert multi_hot.freqs_pre_hash[0].sum() == counted * len(first.labels)
        next(iter(data.get_dataloader(args, "val", 0, 1, multi_hot)))  # not counted
        assert multi_hot.freqs_post_hash[0].sum() == counted * len(first.labels) * MULTI[0]
