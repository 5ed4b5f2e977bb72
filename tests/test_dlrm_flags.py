"""The DLRM example's flags (dlrm_flags.py), one process: TorchRec's defaults, every
refusal of a flag that cannot act, the learning-rate policy, the model flags, the CUDA-only
flags and the synthetic-data flags. `FLAG_TESTS` names, for every flag of the example, the
test that shows it changes behaviour (the multi-process ones are in test_dlrm_example.py)."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from criteo_files import example, example_args, loader

from torchrec_bagpipe.config import BagPipeConfig

dlrm_main = example("dlrm_main")
dlrm_flags = example("dlrm_flags")
lr_scheduler = example("lr_scheduler")

# flag -> "module::test" that shows the flag changes what the example does.
FLAG_TESTS = {
    "--epochs": "test_dlrm_example::test_training_loop_flags",
    "--batch_size": "test_criteo_data::test_drop_last_training_batch_and_test_batch_size",
    "--drop_last_training_batch":
        "test_criteo_data::test_drop_last_training_batch_and_test_batch_size",
    "--test_batch_size": "test_criteo_data::test_drop_last_training_batch_and_test_batch_size",
    "--limit_train_batches": "test_dlrm_example::test_training_loop_flags",
    "--limit_val_batches": "test_dlrm_example::test_training_loop_flags",
    "--limit_test_batches": "test_dlrm_example::test_training_loop_flags",
    "--dataset_name":
        "test_criteo_data::test_kaggle_trains_on_the_first_half_and_evaluates_on_the_second",
    "--num_embeddings": "test_dlrm_flags::test_model_flags_shape_the_model",
    "--num_embeddings_per_feature": "test_dlrm_flags::test_model_flags_shape_the_model",
    "--dense_arch_layer_sizes": "test_dlrm_flags::test_model_flags_shape_the_model",
    "--over_arch_layer_sizes": "test_dlrm_flags::test_model_flags_shape_the_model",
    "--embedding_dim": "test_dlrm_flags::test_model_flags_shape_the_model",
    "--interaction_branch1_layer_sizes": "test_dlrm_flags::test_model_flags_shape_the_model",
    "--interaction_branch2_layer_sizes": "test_dlrm_flags::test_model_flags_shape_the_model",
    "--dcn_num_layers": "test_dlrm_flags::test_model_flags_shape_the_model",
    "--dcn_low_rank_dim": "test_dlrm_flags::test_model_flags_shape_the_model",
    "--interaction_type": "test_dlrm_flags::test_model_flags_shape_the_model",
    "--undersampling_rate":
        "test_criteo_data::test_undersampling_keeps_positives_and_a_fraction_of_negatives",
    "--seed": "test_dlrm_example::test_training_loop_flags",
    "--pin_memory": "test_dlrm_flags::test_cuda_flags",
    "--mmap_mode": "test_criteo_data::test_mmap_mode_reads_the_files_in_place",
    "--in_memory_binary_criteo_path":
        "test_criteo_data::test_days_in_numeric_order_then_halves_of_the_last_day",
    "--synthetic_multi_hot_criteo_path":
        "test_multi_hot_data::test_materialized_files_feed_what_on_the_fly_expansion_feeds",
    "--learning_rate": "test_dlrm_example::test_training_loop_flags",
    "--eps": "test_dlrm_example::test_optimizer_flags_with_stock_tables",
    "--shuffle_batches": "test_criteo_data::test_shuffle_batches_permutes_rows_within_each_batch",
    "--shuffle_training_set":
        "test_criteo_data::test_shuffle_training_set_permutes_every_training_row_once",
    "--validation_freq_within_epoch": "test_dlrm_example::test_training_loop_flags",
    "--adagrad": "test_dlrm_example::test_optimizer_flags_with_stock_tables",
    "--collect_multi_hot_freqs_stats":
        "test_multi_hot_data::test_distribution_type_and_stats_flags_reach_the_expansion",
    "--multi_hot_sizes":
        "test_multi_hot_data::test_materialized_files_feed_what_on_the_fly_expansion_feeds",
    "--multi_hot_distribution_type":
        "test_multi_hot_data::test_distribution_type_and_stats_flags_reach_the_expansion",
    "--lr_warmup_steps": "test_dlrm_example::test_optimizer_flags_with_stock_tables",
    "--lr_decay_start": "test_dlrm_example::test_optimizer_flags_with_stock_tables",
    "--lr_decay_steps": "test_dlrm_example::test_optimizer_flags_with_stock_tables",
    "--print_lr": "test_dlrm_example::test_training_loop_flags",
    "--allow_tf32": "test_dlrm_flags::test_cuda_flags",
    "--print_sharding_plan": "test_dlrm_example::test_training_loop_flags",
    # the example's own flags
    "--sharder": "test_dlrm_example::test_bagpipe_sgd_trains_like_stock_torchrec",
    "--zipf_alpha": "test_dlrm_flags::test_synthetic_data_flags",
    "--zipf_drift": "test_link_bound::test_drift_moves_the_hot_set",
    "--emulated_compute_ms": "test_link_bound::test_emulated_compute_sleeps_in_every_step",
    "--criteo_tsv_paths":
        "test_criteo_data::test_tsv_files_feed_the_same_batches_as_their_preprocessed_npy",
    "--metrics_json": "test_dlrm_example::test_training_loop_flags",
    "--no_progress": "test_dlrm_example::test_training_loop_flags",
    "--virtual_tables":
        "test_dlrm_virtual_tables::test_virtual_tables_build_torchrec_virtual_configs",
    "--virtual_ttl_steps":
        "test_dlrm_virtual_tables::test_virtual_tables_build_torchrec_virtual_configs",
    "--virtual_eviction_trigger":
        "test_dlrm_virtual_tables::test_virtual_tables_build_torchrec_virtual_configs",
}


def test_every_flag_has_a_test_that_it_changes_behaviour():
    bagpipe = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(BagPipeConfig)}
    flags = {a.option_strings[0] for a in dlrm_flags.build_parser()._actions
             if a.option_strings and a.option_strings[0] != "-h"} - bagpipe
    assert flags == set(FLAG_TESTS)
    for target in set(FLAG_TESTS.values()):
        module, name = target.split("::")
        assert callable(getattr(importlib.import_module(module), name)), target


def test_torchrec_defaults():
    args = dlrm_flags.parse_args([])
    assert (args.epochs, args.batch_size, args.learning_rate, args.embedding_dim,
            args.num_embeddings, args.eps, args.dataset_name) == (
                1, 32, 15.0, 64, 100_000, 1e-8, "criteo_1t")
    assert args.dense_arch_layer_sizes == [512, 256, 64]
    assert args.over_arch_layer_sizes == [512, 512, 256, 1]
    assert args.interaction_branch1_layer_sizes == [2048, 2048]
    assert (args.dcn_num_layers, args.dcn_low_rank_dim) == (3, 512)
    assert (args.lr_warmup_steps, args.lr_decay_start, args.lr_decay_steps) == (0, 0, 0)
    assert args.interaction_type == "original" and args.sharder == "bagpipe"


def test_bagpipe_flags_map_onto_the_config():
    args = dlrm_flags.parse_args([
        "--batch_size", "64", "--read-mode", "bagpipe", "--optimization-prescan",
        "--optimization-cache-capacity", "128", "--bagpipe-aggregation", "collective",
        "--ps-type", "tcp", "--lookahead", "4", "--num_embeddings_per_feature",
        ",".join(["100"] * 26),
    ])
    assert BagPipeConfig.from_args(args) == BagPipeConfig(
        read_mode="bagpipe", optimization_prescan=True, optimization_cache_capacity=128,
        bagpipe_aggregation="collective", ps_type="tcp", lookahead=4,
    )
    assert args.batch_size == 64 and args.num_embeddings_per_feature == [100] * 26
    assert args.num_embeddings is None


REFUSED = [
    (["--epochs", "0"], "--epochs must be >= 1"),
    (["--in_memory_binary_criteo_path", "a", "--synthetic_multi_hot_criteo_path", "b"],
     "mutually exclusive"),
    (["--num_embeddings_per_feature", "1,2"], "needs 26 values"),
    (["--num_embeddings", "5", "--num_embeddings_per_feature", ",".join(["3"] * 26)],
     "give one"),
    (["--mmap_mode"], "--mmap_mode applies to Criteo files"),
    (["--shuffle_batches"], "--shuffle_batches applies to Criteo files"),
    (["--shuffle_training_set"], "--shuffle_training_set applies to Criteo files"),
    (["--drop_last_training_batch"], "--drop_last_training_batch applies to Criteo files"),
    (["--dataset_name", "criteo_kaggle"], "none are given"),
    (["--in_memory_binary_criteo_path", "d", "--zipf_alpha", "1.2"], "synthetic dataset"),
    (["--synthetic_multi_hot_criteo_path", "d", "--shuffle_training_set"],
     "not available for the multi-hot files"),
    (["--in_memory_binary_criteo_path", "d", "--dataset_name", "criteo_kaggle",
      "--shuffle_training_set"], "first half of train_"),
    (["--in_memory_binary_criteo_path", "d", "--shuffle_batches", "--optimization-prescan"],
     "prescan"),
    (["--synthetic_multi_hot_criteo_path", "d", "--multi_hot_sizes", ",".join(["2"] * 26)],
     "already are"),
    (["--multi_hot_sizes", "2,2"], "needs 26 values"),
    (["--multi_hot_distribution_type", "pareto"], "applies to the expansion"),
    (["--collect_multi_hot_freqs_stats"], "applies to the expansion"),
    (["--undersampling_rate", "1.5"], "(0, 1]"),
    (["--eps", "0.1"], "add --adagrad"),
    (["--dcn_num_layers", "2"], "--interaction_type dcn"),
    (["--interaction_type", "dcn", "--interaction_branch1_layer_sizes", "4,4"],
     "--interaction_type projection"),
    (["--lr_warmup_steps", "10"], "warmup must finish before the decay starts"),
    (["--lr_decay_steps", "-1"], ">= 0"),
    (["--sharder", "torchrec", "--optimization-prescan", "--lookahead", "2"],
     "--optimization-prescan, --lookahead: BagPipe flags"),
    (["--dense_arch_layer_sizes", "4,x"], "comma separated integers"),
]


@pytest.mark.parametrize(("argv", "message"), REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_flags_that_cannot_act_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        dlrm_flags.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def _policy(base: float, warmup: int, start: int, steps: int, t: int,
            last: float | None) -> float:
    """TorchRec's LRPolicyScheduler.get_lr for one group at step count t (reference)."""
    if t < warmup:
        return base * (1.0 - (warmup - t) / warmup)
    if start <= t < start + steps:
        return max(1e-7, base * ((steps - (t - start)) / steps) ** 2)
    if steps > 0:
        return last if last is not None else base
    return base


@pytest.mark.parametrize(("warmup", "start", "steps"),
                         [(0, 0, 0), (4, 4, 0), (4, 6, 5), (0, 3, 4), (3, 3, 3), (5, 9, 0)])
def test_lr_policy_is_torchrecs(warmup, start, steps):
    dense = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD([{"params": [dense.weight], "lr": 2.0},
                           {"params": [dense.bias], "lr": 0.5}])
    sched = lr_scheduler.LRPolicyScheduler(opt, warmup, start, steps)
    last: list[float | None] = [None, None]
    for t in range(1, 20):
        for g, base in enumerate((2.0, 0.5)):
            want = _policy(base, warmup, start, steps, t, last[g])
            if t < warmup or start <= t < start + steps:
                last[g] = want
            assert opt.param_groups[g]["lr"] == pytest.approx(want, rel=1e-12), (t, g)
        opt.step()
        sched.step()
    with pytest.raises(ValueError, match="warm-up"):
        lr_scheduler.LRPolicyScheduler(opt, 5, 2, 1)


def _shapes(model: torch.nn.Module, part: str) -> list[tuple[int, ...]]:
    return [tuple(v.shape) for k, v in model.named_parameters()
            if k.startswith(part) and k.endswith("weight")]


def test_model_flags_shape_the_model():
    def build(*argv: str) -> torch.nn.Module:
        args = dlrm_flags.parse_args(list(argv))
        return dlrm_main.build_model(args, torch.device("cpu"), torch.device("meta")).model

    base = build("--embedding_dim", "8", "--dense_arch_layer_sizes", "16,8",
                 "--over_arch_layer_sizes", "12,1", "--num_embeddings", "77")
    assert _shapes(base, "sparse_arch") == [(77, 8)] * 26
    assert _shapes(base, "dense_arch") == [(16, 13), (8, 16)]
    assert _shapes(base, "over_arch") == [(12, 8 + 27 * 26 // 2), (1, 12)]
    per = build("--embedding_dim", "4", "--dense_arch_layer_sizes", "6,4",
                "--over_arch_layer_sizes", "3,1",
                "--num_embeddings_per_feature", ",".join(str(10 + i) for i in range(26)))
    assert _shapes(per, "sparse_arch") == [(10 + i, 4) for i in range(26)]
    common = ["--embedding_dim", "8", "--dense_arch_layer_sizes", "16,8",
              "--over_arch_layer_sizes", "12,1", "--num_embeddings", "10"]
    dcn = build(*common, "--interaction_type", "dcn", "--dcn_num_layers", "2",
                "--dcn_low_rank_dim", "5")
    assert type(dcn).__name__ == "DLRM_DCN"
    assert [tuple(v.shape) for k, v in dcn.named_parameters() if "crossnet.V_kernels" in k] \
        == [(5, 27 * 8)] * 2
    proj = build(*common, "--interaction_type", "projection",
                 "--interaction_branch1_layer_sizes", "7,16",
                 "--interaction_branch2_layer_sizes", "9,24")
    assert type(proj).__name__ == "DLRM_Projection"
    assert _shapes(proj, "inter_arch.interaction_branch1") == [(7, 27 * 8), (16, 7)]
    assert _shapes(proj, "inter_arch.interaction_branch2") == [(9, 27 * 8), (24, 9)]


def test_cuda_flags(monkeypatch):
    """--pin_memory and --allow_tf32 act on CUDA devices: refused without one; with one,
    the DataLoader pins batches and TF32 matmuls are enabled."""
    if not torch.cuda.is_available():
        for flag in ("--pin_memory", "--allow_tf32"):
            with pytest.raises(SystemExit):
                dlrm_flags.parse_args([flag])
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = dlrm_flags.parse_args(["--pin_memory", "--allow_tf32", "--num_embeddings", "50"])
    data = example("dlrm_dataloader")
    assert data.get_dataloader(args, "train", 0, 1).pin_memory is True
    plain = dlrm_flags.parse_args(["--num_embeddings", "50"])
    assert data.get_dataloader(plain, "train", 0, 1).pin_memory is False
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        dlrm_main.configure_torch(args)
        assert torch.backends.cuda.matmul.allow_tf32 is True
        dlrm_main.configure_torch(plain)
        assert torch.backends.cuda.matmul.allow_tf32 is False
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_synthetic_data_flags():
    base = ["--num_embeddings", "1000", "--batch_size", "512", "--limit_train_batches", "2"]
    flat = next(iter(loader([*base, "--zipf_alpha", "0"], "train", 0, 1)))
    skewed = next(iter(loader([*base, "--zipf_alpha", "1.5"], "train", 0, 1)))
    top = [int(torch.bincount(b.sparse_features["cat_0"].values()).max())
           for b in (flat, skewed)]
    assert top[1] > 5 * top[0]
    seeded = [next(iter(loader([*base, "--seed", s], "train", 0, 1))) for s in ("1", "2")]
    assert not torch.equal(seeded[0].sparse_features.values(),
                           seeded[1].sparse_features.values())
    args = example_args(base)
    assert len(example("dlrm_dataloader").get_dataloader(args, "train", 0, 1)) == 2
