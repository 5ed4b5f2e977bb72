"""What the DLRM example feeds the model from Criteo files: tiny TSV days, TorchRec's own
preprocessing, and arrays computed independently from the TSV text (values, day order,
val/test halves, hashing, rank assignment, and each data flag)."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from criteo_files import expected, global_stream, loader, preprocess, stack, write_days
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrec.datasets.criteo import InMemoryBinaryCriteoIterDataPipe

from torchrec_bagpipe.datasets import (
    Undersample,
    convert_tsvs,
    criteo_days,
    rank_batch_rows,
    select_rows,
    stage_files,
)

SIZES = [97, 5, 1000, 3] + [61] * 22
DAY_ROWS = [9, 12, 7, 11, 10, 8, 13, 9, 7, 12, 10, 11, 8, 9, 13, 7, 10, 12, 9, 8, 11, 10, 7, 23]


@pytest.fixture(scope="module")
def criteo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """24 TSV days of different lengths and their TorchRec preprocessing."""
    root = tmp_path_factory.mktemp("criteo")
    write_days(root / "tsv", DAY_ROWS, seed=7)
    preprocess(root / "tsv", root / "npy")
    return {"tsv": root / "tsv", "npy": root / "npy"}


def _argv(npy: Path, *extra: str, batch: int = 4) -> list[str]:
    return ["--in_memory_binary_criteo_path", str(npy), "--batch_size", str(batch),
            "--num_embeddings_per_feature", ",".join(map(str, SIZES)), *extra]


def _want(paths: list[Path]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    parts = [expected(p) for p in paths]
    dense = np.concatenate([p[0] for p in parts])
    sparse = np.concatenate([p[1] for p in parts]) % np.array(SIZES)
    labels = np.concatenate([p[2] for p in parts])
    return dense, sparse, labels


def _check(got: tuple[np.ndarray, ...], want: tuple[np.ndarray, ...]) -> None:
    assert got[0].dtype == np.float32
    assert got[0].shape == want[0].shape
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2], want[2])


def _check_batch_sizes(batches: list, batch: int, world: int) -> None:
    """Full batches, then at most one last round splitting the rest evenly over the ranks."""
    sizes = [len(b.labels) for b in batches]
    *full, last = [sizes[i:i + world] for i in range(0, len(sizes), world)] or [[]]
    assert all(s == batch for r in full for s in r), sizes
    assert max(last) - min(last) <= 1 and last == sorted(last, reverse=True), sizes


@pytest.mark.parametrize("world", [1, 2, 3])
def test_days_in_numeric_order_then_halves_of_the_last_day(criteo, world):
    tsv = [criteo["tsv"] / f"day_{d}" for d in range(24)]
    argv = _argv(criteo["npy"])
    train = global_stream(argv, "train", world)
    _check(stack(train), _want(tsv[:23]))  # day_2 .. day_9 before day_10 .. day_22
    _check_batch_sizes(train, 4, world)
    val, test = global_stream(argv, "val", world), global_stream(argv, "test", world)
    last = _want([tsv[23]])
    half = math.ceil(DAY_ROWS[23] / 2)
    _check(stack(val), tuple(a[:half] for a in last))
    _check(stack(test), tuple(a[half:] for a in last))


def test_fewer_days_keep_the_numeric_order(tmp_path):
    tsv = write_days(tmp_path / "tsv", [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 8], seed=3)
    preprocess(tmp_path / "tsv", tmp_path / "npy")
    assert criteo_days(str(tmp_path / "npy")) == 12
    argv = _argv(tmp_path / "npy")
    _check(stack(global_stream(argv, "train", 2)), _want(tsv[:11]))
    _check(stack(global_stream(argv, "val", 1)), tuple(a[:4] for a in _want([tsv[11]])))


def test_kaggle_trains_on_the_first_half_and_evaluates_on_the_second():
    # TorchRec's Kaggle preprocessing reads any input path containing "test" as Kaggle's
    # unlabelled test.txt: keep "test" (and pytest's temporary directories) out of it.
    with tempfile.TemporaryDirectory(prefix="kaggle_") as tmp:
        root = Path(tmp)
        assert "test" not in str(root)
        tsv = write_days(root / "tsv", [41], seed=5, names=["train.txt"])
        preprocess(root / "tsv", root / "npy", dataset_name="criteo_kaggle")
        argv = _argv(root / "npy", "--dataset_name", "criteo_kaggle")
        want = _want(tsv)
        _check(stack(global_stream(argv, "train", 2)), tuple(a[:21] for a in want))
        for stage in ("val", "test"):
            _check(stack(global_stream(argv, stage, 2)), tuple(a[21:] for a in want))
        # Our TSV conversion has no such trap, wherever the file lives.
        tsv_argv = ["--criteo_tsv_paths", str(tsv[0]), *argv[2:]]
        _check(stack(global_stream(tsv_argv, "train", 2)), tuple(a[:21] for a in want))


def test_tsv_files_feed_the_same_batches_as_their_preprocessed_npy(criteo, tmp_path):
    tsv = ",".join(str(criteo["tsv"] / f"day_{d}") for d in range(24))
    flags = ["--batch_size", "5", "--num_embeddings_per_feature", ",".join(map(str, SIZES))]
    for stage in ("train", "val", "test"):
        for rank in range(2):
            a = list(loader(["--criteo_tsv_paths", tsv, *flags], stage, rank, 2))
            b = list(loader(["--in_memory_binary_criteo_path", str(criteo["npy"]), *flags],
                            stage, rank, 2))
            assert len(a) == len(b) > 0
            for x, y in zip(a, b):
                assert torch.equal(x.dense_features, y.dense_features)
                assert torch.equal(x.sparse_features.values(), y.sparse_features.values())
                assert torch.equal(x.labels, y.labels)
    # Conversion into a directory of our own, with TorchRec's preprocessing.
    out = convert_tsvs([criteo["tsv"] / "day_0", criteo["tsv"] / "day_1"], str(tmp_path / "o"))
    assert np.array_equal(np.load(Path(out) / "day_1_sparse.npy"),
                          np.load(criteo["npy"] / "day_1_sparse.npy"))


def test_hashing_by_num_embeddings(criteo):
    got = stack(global_stream(["--in_memory_binary_criteo_path", str(criteo["npy"]),
                               "--batch_size", "8", "--num_embeddings", "10"], "test", 1))
    np.testing.assert_array_equal(got[1], expected(criteo["tsv"] / "day_23")[1][12:] % 10)


def test_drop_last_training_batch_and_test_batch_size(criteo):
    rows = sum(DAY_ROWS[:23])  # 223: with batch 6 and 3 ranks, 7 rows remain
    full = global_stream(_argv(criteo["npy"], batch=6), "train", 3)
    dropped = global_stream(_argv(criteo["npy"], "--drop_last_training_batch", batch=6),
                            "train", 3)
    assert sum(len(b.labels) for b in full) == rows
    assert [len(b.labels) for b in dropped] == [6] * (rows // 18 * 3)
    assert len(full) > len(dropped)
    evals = global_stream(_argv(criteo["npy"], "--test_batch_size", "3"), "val", 1)
    assert [len(b.labels) for b in evals] == [3, 3, 3, 3]


def test_mmap_mode_reads_the_files_in_place(criteo):
    plain = stack(global_stream(_argv(criteo["npy"]), "train", 2))
    mapped = global_stream(_argv(criteo["npy"], "--mmap_mode"), "train", 2)
    _check(stack(mapped), plain)
    pipe = loader(_argv(criteo["npy"], "--mmap_mode"), "train", 0, 2).dataset
    assert isinstance(pipe, InMemoryBinaryCriteoIterDataPipe)
    assert all(isinstance(a, np.memmap) for a in pipe.sparse_arrs)
    pipe = loader(_argv(criteo["npy"]), "train", 0, 2).dataset
    assert not any(isinstance(a, np.memmap) for a in pipe.sparse_arrs)


def _rows(arrays: tuple[np.ndarray, ...]) -> list[tuple]:
    return sorted(zip(*(map(tuple, a.reshape(len(a), -1)) for a in arrays)))


def test_shuffle_training_set_permutes_every_training_row_once(criteo):
    plain = stack(global_stream(_argv(criteo["npy"]), "train", 1))
    argv = _argv(criteo["npy"], "--shuffle_training_set", "--seed", "3")
    per_rank = [stack(list(loader(argv, "train", r, 2))) for r in range(2)]
    shuffled = tuple(np.concatenate([p[i] for p in per_rank]) for i in range(3))
    assert _rows(shuffled) == _rows(plain)
    assert not np.array_equal(shuffled[1], plain[1])
    again = stack(list(loader(argv, "train", 0, 2)))
    np.testing.assert_array_equal(again[1], per_rank[0][1])


def test_shuffle_batches_permutes_rows_within_each_batch(criteo):
    plain = list(loader(_argv(criteo["npy"], batch=8), "train", 0, 1))
    shuffled = list(loader(_argv(criteo["npy"], "--shuffle_batches", "--seed", "1", batch=8),
                           "train", 0, 1))
    assert len(plain) == len(shuffled)
    moved = 0
    for a, b in zip(plain, shuffled):
        x, y = stack([a]), stack([b])
        assert _rows(x) == _rows(y)
        moved += not np.array_equal(x[1], y[1])
    assert moved > len(plain) // 2


def test_undersampling_keeps_positives_and_a_fraction_of_negatives(criteo):
    argv = _argv(criteo["npy"], batch=32)
    plain = list(loader(argv, "train", 0, 1))
    kept = list(loader([*argv, "--undersampling_rate", "0.25", "--seed", "4"], "train", 0, 1))
    assert len(kept) == len(plain)
    pos = neg = neg_kept = 0
    for a, b in zip(plain, kept):
        la, lb = a.labels.reshape(-1), b.labels.reshape(-1)
        assert int((lb == 1).sum()) == int((la == 1).sum())
        pos += int((la == 1).sum())
        neg += int((la == 0).sum())
        neg_kept += int((lb == 0).sum())
        assert set(_rows(stack([b]))) <= set(_rows(stack([a])))
    assert pos > 0 and 0.1 < neg_kept / neg < 0.4
    again = list(loader([*argv, "--undersampling_rate", "0.25", "--seed", "4"], "train", 0, 1))
    assert all(torch.equal(x.labels, y.labels) for x, y in zip(kept, again))
    # Validation and test keep every row.
    assert sum(len(b.labels) for b in loader([*argv, "--undersampling_rate", "0.25"], "val",
                                              0, 1)) == 12


def test_undersample_never_leaves_a_batch_empty():
    from torchrec_bagpipe.datasets import PowerLawCriteoDataset

    batch = PowerLawCriteoDataset([50] * 26, 16, 1).batch(0)
    batch.labels.zero_()
    out = list(Undersample([batch], 1e-9, seed=0, rank=0))
    assert len(out[0].labels) == 1
    assert torch.equal(out[0].dense_features, batch.dense_features[:1])
    with pytest.raises(ValueError, match="rate"):
        Undersample([batch], 0.0, 0, 0)


@settings(deadline=None, max_examples=40)
@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=4),
       data=st.data())
def test_select_rows_matches_a_per_sample_reference(lengths, data):
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    n = len(lengths)
    per_key = [lengths, [(x * 3) % 4 for x in lengths]]  # a second key, zero-length bags too
    flat = [x for key in per_key for x in key]
    values = torch.arange(sum(flat), dtype=torch.int64)
    batch = Batch(dense_features=torch.arange(n, dtype=torch.float32)[:, None],
                  sparse_features=KeyedJaggedTensor(keys=["a", "b"], values=values,
                                                    lengths=torch.tensor(flat), stride=n),
                  labels=torch.arange(n))
    rows = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=2 * n))
    got = select_rows(batch, torch.tensor(rows))
    starts = np.concatenate([[0], np.cumsum(flat)])
    for k, key in enumerate(["a", "b"]):
        want = [v for i in rows for v in range(starts[k * n + i], starts[k * n + i + 1])]
        assert got.sparse_features[key].values().tolist() == want
        assert got.sparse_features[key].lengths().tolist() == [per_key[k][i] for i in rows]
    assert got.labels.tolist() == rows and got.dense_features[:, 0].tolist() == rows


@settings(deadline=None, max_examples=60)
@given(files=st.lists(st.integers(1, 40), min_size=1, max_size=3), batch=st.integers(1, 9),
       world=st.integers(1, 4), drop_last=st.booleans())
def test_rank_batch_rows_is_torchrecs_schedule(tmp_path_factory, files, batch, world,
                                               drop_last):
    if sum(files) < world:
        return
    root = tmp_path_factory.mktemp("sched")
    start = 0
    paths = {"dense": [], "sparse": [], "labels": []}
    for i, n in enumerate(files):
        ids = np.arange(start, start + n)
        start += n
        for part, arr in (("dense", np.zeros((n, 13), np.float32)),
                          ("sparse", np.repeat(ids[:, None], 26, 1)),
                          ("labels", np.zeros((n, 1), np.int32))):
            np.save(root / f"day_{i}_{part}.npy", arr)
            paths[part].append(str(root / f"day_{i}_{part}.npy"))
    for rank in range(world):
        pipe = InMemoryBinaryCriteoIterDataPipe("train", paths["dense"], paths["sparse"],
                                                paths["labels"], batch, rank, world,
                                                drop_last=drop_last)
        got = [b.sparse_features["cat_0"].values().tolist() for b in pipe]
        want = [list(range(a, b)) for a, b in rank_batch_rows(sum(files), batch, rank, world,
                                                              drop_last)]
        assert got == want


def test_layout_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no day_<i>_dense\.npy"):
        criteo_days(str(tmp_path))
    for d in (0, 2):
        for part in ("dense", "sparse", "labels"):
            np.save(tmp_path / f"day_{d}_{part}.npy", np.zeros((2, 1)))
    with pytest.raises(FileNotFoundError, match=r"day_1_dense\.npy is missing"):
        stage_files(str(tmp_path), "criteo_1t", "train")
    (tmp_path / "day_2_dense.npy").unlink()
    with pytest.raises(ValueError, match="at least two"):
        criteo_days(str(tmp_path))
    (tmp_path / "day_1_dense.npy").write_bytes(b"")
    np.save(tmp_path / "day_1_dense.npy", np.zeros((2, 1)))
    with pytest.raises(FileNotFoundError, match=r"day_1_sparse\.npy"):
        criteo_days(str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"train_dense\.npy"):
        stage_files(str(tmp_path), "criteo_kaggle", "val")
    with pytest.raises(ValueError, match="two TSV days"):
        convert_tsvs([tmp_path / "day_0_dense.npy"], str(tmp_path / "o"))
    with pytest.raises(ValueError, match="one TSV"):
        convert_tsvs([tmp_path / "day_0_dense.npy"] * 2, str(tmp_path / "o"), "criteo_kaggle")
