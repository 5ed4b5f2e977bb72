"""The DLRM example's ``--virtual_tables`` (issue 22 item 5): the tables it builds, raw ids
from the synthetic generator and from TorchRec-preprocessed Criteo files (no ``%
num_embeddings``), the flags it refuses, and (slow) a short 2-rank run that trains."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from criteo_files import REPO, example, example_args, expected, loader, preprocess, write_days

from torchrec_bagpipe.datasets import PowerLawCriteoDataset

dlrm_main = example("dlrm_main")
dlrm_flags = example("dlrm_flags")
dlrm_dataloader = example("dlrm_dataloader")

SMALL = ["--batch_size", "16", "--embedding_dim", "8", "--dense_arch_layer_sizes", "16,8",
         "--over_arch_layer_sizes", "16,1"]


def test_virtual_tables_build_torchrec_virtual_configs():
    from torchrec_bagpipe.distributed import StepTTLEvictionPolicy

    for flag in ("--virtual_tables", "--virtual-tables"):
        args = example_args([*SMALL, flag, "--virtual_ttl_steps", "5",
                             "--virtual_eviction_trigger", "100"])
        model = dlrm_main.build_model(args, torch.device("cpu"))
        configs = model.model.sparse_arch.embedding_bag_collection.embedding_bag_configs()
        assert len(configs) == 26
        for c in configs:
            assert c.use_virtual_table and c.num_embeddings == dlrm_dataloader.RAW_CRITEO_IDS
            assert c.virtual_table_eviction_policy == StepTTLEvictionPolicy(
                ttl_steps=5, training_id_eviction_trigger_count=100)
    plain = dlrm_main.build_model(example_args(SMALL), torch.device("cpu"))
    for c in plain.model.sparse_arch.embedding_bag_collection.embedding_bag_configs():
        assert not c.use_virtual_table and c.num_embeddings == 100_000
    no_ttl = dlrm_main.build_model(example_args([*SMALL, "--virtual_tables"]),
                                   torch.device("cpu"))
    c0 = no_ttl.model.sparse_arch.embedding_bag_collection.embedding_bag_configs()[0]
    assert c0.use_virtual_table and c0.virtual_table_eviction_policy is None


def test_synthetic_generator_writes_raw_ids():
    base = ["--batch_size", "256", "--limit_train_batches", "2", "--seed", "5"]
    raw = list(loader([*base, "--virtual_tables"], "train", 0, 1))
    hashed = list(loader(base, "train", 0, 1))
    ids = torch.cat([b.sparse_features.values() for b in raw])
    # Raw ids over the generator's 2^31-id space: far beyond the hashed default of 100_000.
    assert int(ids.max()) >= 100_000 and int(ids.min()) >= 0
    assert int(ids.max()) < dlrm_dataloader.SYNTHETIC_RAW_IDS
    want = PowerLawCriteoDataset([dlrm_dataloader.SYNTHETIC_RAW_IDS] * 26, 256, 2, seed=5)
    for got, ref in zip(raw, want):
        assert torch.equal(got.sparse_features.values(), ref.sparse_features.values())
        assert torch.equal(got.labels, ref.labels)
    assert int(torch.cat([b.sparse_features.values() for b in hashed]).max()) < 100_000


@pytest.fixture(scope="module")
def criteo_days_npy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    root = tmp_path_factory.mktemp("criteo_virtual")
    tsvs = write_days(root / "tsv", [40, 30], seed=11)
    preprocess(root / "tsv", root / "npy")
    return root / "npy", tsvs


def test_criteo_files_are_read_as_raw_ids(criteo_days_npy):
    npy, tsvs = criteo_days_npy
    _, sparse, _ = expected(tsvs[0])  # the TSV's hex values, parsed here independently
    argv = ["--batch_size", "8", "--in_memory_binary_criteo_path", str(npy)]

    def ids(extra: list[str]) -> np.ndarray:
        batches = list(loader([*argv, *extra], "train", 0, 1))
        return np.concatenate([b.sparse_features.values().numpy().reshape(26, -1).T
                               for b in batches])

    raw, hashed = ids(["--virtual_tables"]), ids(["--num_embeddings", "1000"])
    assert np.array_equal(raw, sparse) and int(raw.max()) >= 1 << 24
    assert np.array_equal(hashed, sparse % 1000)


REFUSED = [
    (["--virtual_ttl_steps", "3"], "--virtual_ttl_steps needs --virtual_tables"),
    (["--virtual_eviction_trigger", "3"], "--virtual_eviction_trigger needs --virtual_tables"),
    (["--virtual_tables", "--virtual_eviction_trigger", "3"], "needs --virtual_ttl_steps"),
    (["--virtual_tables", "--virtual_ttl_steps", "-1"], ">= 0"),
    (["--virtual_tables", "--sharder", "torchrec"], "needs --sharder bagpipe"),
    (["--virtual_tables", "--num_embeddings", "10"], "--num_embeddings sizes hashed tables"),
    (["--virtual_tables", "--num_embeddings_per_feature", ",".join(["5"] * 26)],
     "--num_embeddings_per_feature sizes hashed tables"),
    (["--virtual_tables", "--multi_hot_sizes", ",".join(["2"] * 26)],
     "--multi_hot_sizes sizes hashed tables"),
    (["--virtual_tables", "--synthetic_multi_hot_criteo_path", "d"], "already hashed"),
]


@pytest.mark.parametrize(("argv", "message"), REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_virtual_flags_that_cannot_act_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        dlrm_flags.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def _train(rank: int, world: int) -> dict[str, Any]:
    import contextlib
    import io
    import sys

    sys.path.insert(0, os.path.join(REPO, "examples", "dlrm"))
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ.setdefault("LOCAL_WORLD_SIZE", "2")
    argv = [*SMALL, "--virtual_tables", "--virtual_ttl_steps", "2", "--learning_rate", "0.5",
            "--seed", "3", "--no_progress", "--limit_train_batches", "6",
            "--limit_val_batches", "2", "--limit_test_batches", "2"]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return dlrm_main.main(argv)


@pytest.mark.slow
def test_virtual_tables_example_trains():
    from _dist import run_world

    r0, r1 = run_world(_train, 2, timeout=600)
    for r in (r0, r1):
        assert r["steps"] == 6 and len(r["train_losses"]) == 6
        assert all(np.isfinite(r["train_losses"]))
        assert r["train_losses"] != [r["train_losses"][0]] * 6  # the model trains
    assert r0["train_losses"] != r1["train_losses"]  # different data on each rank
