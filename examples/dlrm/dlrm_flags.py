"""The DLRM example's command line: TorchRec's DLRM flags, this example's, every
`BagPipeConfig` field (`BagPipeConfig.add_arguments`), and the checks that refuse a flag
that cannot act in the chosen setting, with a message saying why (`parse_args`)."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

import torch
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES

from torchrec_bagpipe import BagPipeConfig
from torchrec_bagpipe.datasets.criteo import DATASET_NAMES
from torchrec_bagpipe.datasets.multi_hot import DISTRIBUTIONS

__all__ = ["build_parser", "check_args", "parse_args"]

# Flags whose TorchRec default is filled in after parsing, so that one given explicitly
# can be told from the default (and refused where it cannot act).
_DEFAULTS: dict[str, Any] = {
    "num_embeddings": 100_000,
    "eps": 1e-8,
    "dcn_num_layers": 3,
    "dcn_low_rank_dim": 512,
    "interaction_branch1_layer_sizes": "2048,2048",
    "interaction_branch2_layer_sizes": "2048,2048",
    "zipf_alpha": 1.05,
    "zipf_drift": 0.0,
}
_INT_LISTS = ("num_embeddings_per_feature", "dense_arch_layer_sizes", "over_arch_layer_sizes",
              "multi_hot_sizes", "interaction_branch1_layer_sizes",
              "interaction_branch2_layer_sizes")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="torchrec dlrm example trainer (BagPipe)")
    a = p.add_argument
    a("--epochs", type=int, default=1, help="number of epochs to train")
    a("--batch_size", type=int, default=32, help="batch size to use for training")
    a("--drop_last_training_batch", dest="drop_last_training_batch", action="store_true",
      help="Drop the last non-full training batch (Criteo files)")
    a("--test_batch_size", type=int, default=None,
      help="batch size to use for validation and testing")
    a("--limit_train_batches", type=int, default=None, help="number of train batches")
    a("--limit_val_batches", type=int, default=None, help="number of validation batches")
    a("--limit_test_batches", type=int, default=None, help="number of test batches")
    a("--dataset_name", type=str, choices=list(DATASET_NAMES), default="criteo_1t",
      help="file layout of the Criteo data: criteo_1t (day_<i>_*), criteo_kaggle (train_*)")
    a("--num_embeddings", type=int, default=None,
      help="max_ind_size. The number of embeddings in each embedding table. Defaults to "
           "100_000 if num_embeddings_per_feature is not supplied.")
    a("--num_embeddings_per_feature", type=str, default=None,
      help="Comma separated max_ind_size per sparse feature. 26 values are expected for the "
           "Criteo dataset.")
    a("--dense_arch_layer_sizes", type=str, default="512,256,64",
      help="Comma separated layer sizes for dense arch.")
    a("--over_arch_layer_sizes", type=str, default="512,512,256,1",
      help="Comma separated layer sizes for over arch.")
    a("--embedding_dim", type=int, default=64, help="Size of each embedding.")
    a("--interaction_branch1_layer_sizes", type=str, default=None,
      help="Comma separated layer sizes for interaction branch1 (only on dlrm with "
           "projection; default 2048,2048).")
    a("--interaction_branch2_layer_sizes", type=str, default=None,
      help="Comma separated layer sizes for interaction branch2 (only on dlrm with "
           "projection; default 2048,2048).")
    a("--dcn_num_layers", type=int, default=None,
      help="Number of DCN layers in interaction layer (only on dlrm with DCN; default 3).")
    a("--dcn_low_rank_dim", type=int, default=None,
      help="Low rank dimension for DCN in interaction layer (only on dlrm with DCN; "
           "default 512).")
    a("--undersampling_rate", type=float, default=None,
      help="Desired proportion of zero-labeled training samples to retain: 0.3 keeps 30%% "
           "of the rows with label 0 and every row with label 1 (the same rows every pass). "
           "When not supplied, no undersampling occurs.")
    a("--seed", type=int, default=None,
      help="Random seed for reproducibility: torch's generator (initial weights), Python's "
           "and NumPy's global generators, the synthetic data, TorchRec's shuffles and the "
           "undersampling draws.")
    a("--pin_memory", dest="pin_memory", action="store_true",
      help="Use pinned memory when loading data (needs CUDA).")
    a("--mmap_mode", dest="mmap_mode", action="store_true",
      help="mmap the dataset: it stays on disk and is read as if it were in memory.")
    a("--in_memory_binary_criteo_path", type=str, default=None,
      help="Directory path containing the Criteo dataset npy files.")
    a("--synthetic_multi_hot_criteo_path", type=str, default=None,
      help="Directory path containing the MLPerf v2 synthetic multi-hot dataset npz files.")
    a("--learning_rate", type=float, default=15.0, help="Learning rate.")
    a("--eps", type=float, default=None, help="Epsilon for Adagrad optimizer (default 1e-8).")
    a("--shuffle_batches", dest="shuffle_batches", action="store_true",
      help="Shuffle each batch during training.")
    a("--shuffle_training_set", dest="shuffle_training_set", action="store_true",
      help="Shuffle the training set in memory. This will override mmap_mode")
    a("--validation_freq_within_epoch", type=int, default=None,
      help="Frequency at which validation will be run within an epoch.")
    p.set_defaults(pin_memory=None, mmap_mode=None, shuffle_batches=None,
                   shuffle_training_set=None)
    a("--adagrad", dest="adagrad", action="store_true",
      help="Flag to determine if adagrad optimizer should be used.")
    a("--interaction_type", choices=["original", "dcn", "projection"], default="original",
      help="Determine the interaction type to be used (original, dcn, or projection) "
           "default is original DLRM with pairwise dot product")
    a("--collect_multi_hot_freqs_stats", dest="collect_multi_hot_freqs_stats",
      action="store_true",
      help="Collect stats on the frequency of embedding accesses (multi-hot training "
           "batches), saved as stats_{pre,post}_hash_<rank>_<dist>.npy in the working directory.")
    a("--multi_hot_sizes", type=str, default=None,
      help="Comma separated multihot size per sparse feature. 26 values are expected for the "
           "Criteo dataset.")
    a("--multi_hot_distribution_type", type=str, choices=list(DISTRIBUTIONS), default=None,
      help="Multi-hot distribution options (with --multi_hot_sizes; default uniform).")
    a("--lr_warmup_steps", type=int, default=0)
    a("--lr_decay_start", type=int, default=0)
    a("--lr_decay_steps", type=int, default=0)
    a("--print_lr", action="store_true", help="Print learning rate every iteration.")
    a("--allow_tf32", action="store_true",
      help="Enable TensorFloat-32 mode for matrix multiplications (CUDA).")
    a("--print_sharding_plan", action="store_true",
      help="Print the sharding plan used for each embedding table.")
    # ---- this example's additions ----------------------------------------------------------
    a("--sharder", choices=["bagpipe", "torchrec"], default="bagpipe",
      help="bagpipe: tables on the BagPipe PS; torchrec: TorchRec's stock sharders (tables "
           "local to the trainers), for comparison")
    a("--zipf_alpha", type=float, default=None,
      help="power-law exponent of id popularity in the synthetic dataset (default 1.05)")
    a("--zipf_drift", type=float, default=None,
      help="fraction of each table's key space the synthetic dataset's hot set drifts through "
           "over the training batches (default 0: a stationary stream)")
    a("--emulated_compute_ms", type=float, default=0.0,
      help="sleep this long in every training step, after its work: the compute an "
           "accelerator would do while the host is free (link-bound benchmarks; default 0)")
    a("--criteo_tsv_paths", type=str, default=None,
      help="Comma separated raw Criteo TSV files (days in order; one Kaggle train.txt with "
           "--dataset_name criteo_kaggle), converted by TorchRec's preprocessing")
    a("--virtual_tables", "--virtual-tables", dest="virtual_tables", action="store_true",
      help="TorchRec virtual tables (use_virtual_table=True, rows on the BagPipe PS from the "
           "first step that trains them): raw Criteo ids, no %% num_embeddings hashing; the "
           "synthetic data draws raw ids from a 2^31-id space")
    a("--virtual_ttl_steps", type=int, default=0,
      help="with --virtual_tables: evict rows not trained for this many steps "
           "(StepTTLEvictionPolicy; default 0: never evict)")
    a("--virtual_eviction_trigger", type=int, default=0,
      help="with --virtual_ttl_steps: evict only while live rows per rank exceed this "
           "(training_id_eviction_trigger_count; default 0: at every step)")
    a("--metrics_json", type=str, default=None,
      help="write the final metrics (rank 0) to this JSON file")
    a("--no_progress", action="store_true", help="hide the tqdm bars")
    BagPipeConfig.add_arguments(p)
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parses and checks `argv`; exits with a usage error naming the flag that cannot act."""
    parser = build_parser()
    args = parser.parse_args(argv)
    given = {name for name in _DEFAULTS if getattr(args, name) is not None}
    for name, value in _DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in _INT_LISTS:
        value = getattr(args, name)
        if isinstance(value, str):
            try:
                setattr(args, name, [int(v) for v in value.split(",") if v])
            except ValueError:
                parser.error(f"--{name} must be comma separated integers, got {value!r}")
    if isinstance(args.criteo_tsv_paths, str):
        args.criteo_tsv_paths = [p for p in args.criteo_tsv_paths.split(",") if p]
    problem = check_args(args, given)
    if problem:
        parser.error(problem)
    if args.num_embeddings_per_feature is not None:
        args.num_embeddings = None
    return args


def _check_virtual(args: argparse.Namespace, given: set[str]) -> str | None:
    """Why the virtual-table flags cannot act together with the others, or None."""
    if not args.virtual_tables:
        extra = [f for f in ("virtual_ttl_steps", "virtual_eviction_trigger")
                 if getattr(args, f)]
        return f"--{extra[0]} needs --virtual_tables" if extra else None
    if args.virtual_ttl_steps < 0 or args.virtual_eviction_trigger < 0:
        return "--virtual_ttl_steps and --virtual_eviction_trigger must be >= 0"
    if args.virtual_eviction_trigger and not args.virtual_ttl_steps:
        return "--virtual_eviction_trigger needs --virtual_ttl_steps"
    if args.sharder != "bagpipe":
        return ("--virtual_tables needs --sharder bagpipe (TorchRec's own virtual-table "
                "kernels do not run in open source)")
    for flag in ("num_embeddings", "num_embeddings_per_feature", "multi_hot_sizes"):
        if flag in given or (flag != "num_embeddings" and getattr(args, flag) is not None):
            return (f"--{flag} sizes hashed tables; --virtual_tables keys rows by raw id "
                    "(no table size)")
    if args.synthetic_multi_hot_criteo_path is not None:
        return ("--virtual_tables reads raw ids; the synthetic multi-hot files hold ids "
                "already hashed to table sizes")
    return None


def check_args(args: argparse.Namespace, given: set[str]) -> str | None:
    """The first reason the flags cannot all act together, or None."""
    sources = [n for n in ("in_memory_binary_criteo_path", "synthetic_multi_hot_criteo_path",
                           "criteo_tsv_paths") if getattr(args, n) is not None]
    files = bool(sources)
    cuda = torch.cuda.is_available()
    problem = _check_virtual(args, given)
    if problem:
        return problem
    positive = ["epochs", "batch_size", "embedding_dim", "test_batch_size",
                "limit_train_batches", "limit_val_batches", "limit_test_batches",
                "validation_freq_within_epoch", "num_embeddings"]
    for name in positive:
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"--{name} must be >= 1, got {value}"
    if len(sources) > 1:
        return f"--{sources[0]} and --{sources[1]} are mutually exclusive data sources"
    if args.num_embeddings_per_feature is not None:
        if len(args.num_embeddings_per_feature) != len(DEFAULT_CAT_NAMES):
            return f"--num_embeddings_per_feature needs {len(DEFAULT_CAT_NAMES)} values"
        if min(args.num_embeddings_per_feature) < 1:
            return "--num_embeddings_per_feature values must be >= 1"
        if "num_embeddings" in given:
            return ("--num_embeddings and --num_embeddings_per_feature both set the table "
                    "sizes; give one")
    if args.pin_memory and not cuda:
        return "--pin_memory pins host memory for copies to CUDA devices; none is available"
    if args.allow_tf32 and not cuda:
        return "--allow_tf32 enables TF32 matmuls on CUDA devices; none is available"
    for flag in ("mmap_mode", "shuffle_batches", "shuffle_training_set",
                 "drop_last_training_batch"):
        if getattr(args, flag) and not files:
            return (f"--{flag} applies to Criteo files (--in_memory_binary_criteo_path, "
                    "--criteo_tsv_paths, --synthetic_multi_hot_criteo_path); the synthetic "
                    "dataset has none")
    if args.dataset_name != "criteo_1t" and not files:
        return "--dataset_name selects the layout of Criteo files; none are given"
    for name in ("zipf_alpha", "zipf_drift"):
        if name in given and files:
            return f"--{name} shapes the synthetic dataset; Criteo files are given"
    if not 0.0 <= args.zipf_drift <= 1.0:
        return f"--zipf_drift must be in [0, 1], got {args.zipf_drift}"
    if not args.emulated_compute_ms >= 0.0:
        return f"--emulated_compute_ms must be >= 0, got {args.emulated_compute_ms}"
    if args.shuffle_training_set and args.synthetic_multi_hot_criteo_path is not None:
        return ("--shuffle_training_set is not available for the multi-hot files (TorchRec's "
                "example has no implementation either)")
    if args.shuffle_training_set and args.dataset_name == "criteo_kaggle":
        return ("--shuffle_training_set shuffles whole training files; criteo_kaggle trains "
                "on the first half of train_*.npy (its second half is val/test)")
    if args.shuffle_batches and args.sharder == "bagpipe" and args.optimization_prescan:
        return ("--shuffle_batches reshuffles every pass over the data, so the prescan pass "
                "(--optimization-prescan) would plan other batches than training sees; use "
                "online planning")
    if args.multi_hot_sizes is not None:
        if args.synthetic_multi_hot_criteo_path is not None:
            return ("--multi_hot_sizes converts one-hot data to multi-hot; the multi-hot "
                    "files of --synthetic_multi_hot_criteo_path already are")
        if len(args.multi_hot_sizes) != len(DEFAULT_CAT_NAMES):
            return f"--multi_hot_sizes needs {len(DEFAULT_CAT_NAMES)} values"
        if min(args.multi_hot_sizes) < 1:
            return "--multi_hot_sizes values must be >= 1"
    else:
        for flag in ("multi_hot_distribution_type", "collect_multi_hot_freqs_stats"):
            if getattr(args, flag):
                return f"--{flag} applies to the expansion of --multi_hot_sizes"
    if args.undersampling_rate is not None and not 0.0 < args.undersampling_rate <= 1.0:
        return f"--undersampling_rate must be in (0, 1], got {args.undersampling_rate}"
    if "eps" in given and not args.adagrad:
        return "--eps is Adagrad's epsilon; add --adagrad"
    own = {"dcn": ("dcn_num_layers", "dcn_low_rank_dim"),
           "projection": ("interaction_branch1_layer_sizes", "interaction_branch2_layer_sizes")}
    for kind, names in own.items():
        for name in names:
            if name in given and args.interaction_type != kind:
                return f"--{name} applies to --interaction_type {kind}"
    if min(args.lr_warmup_steps, args.lr_decay_start, args.lr_decay_steps) < 0:
        return "--lr_warmup_steps, --lr_decay_start and --lr_decay_steps must be >= 0"
    if args.lr_decay_start < args.lr_warmup_steps:
        return "Learning rate warmup must finish before the decay starts"
    if args.sharder == "torchrec":
        changed = [f.name for f in fields(BagPipeConfig)
                   if getattr(args, f.name) != getattr(BagPipeConfig(), f.name)]
        if changed:
            flags = ", ".join("--" + n.replace("_", "-") for n in changed)
            return f"{flags}: BagPipe flags, but --sharder torchrec does not use BagPipe"
    return None
