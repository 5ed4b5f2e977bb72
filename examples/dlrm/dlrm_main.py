#!/usr/bin/env python3
"""DLRM training with TorchRec, embeddings on the BagPipe parameter server.

The command line mirrors TorchRec's `torchrec_dlrm/dlrm_main.py` (same flag names and
defaults where they apply) and adds BagPipe's flags (`--read-mode bagpipe`,
`--optimization-prescan`, `--optimization-cache-capacity`, `--bagpipe-aggregation`,
`--ps-type`, `--lookahead`, ... — every `BagPipeConfig` field). Data: a synthetic
Criteo-like power-law dataset by default (`--zipf_alpha`), or Criteo files
(`--in_memory_binary_criteo_path` NPY directory, `--criteo_tsv_paths`).

Run on 2 ranks of one machine:

    torchrec-bagpipe-launch --nproc-per-node 2 examples/dlrm/dlrm_main.py \\
        --limit_train_batches 200 --read-mode bagpipe --optimization-prescan

Compared with TorchRec's script, the differences a user makes are: the sharder
(`BagPipeEmbeddingBagCollectionSharder`), the planner (`BagPipeShardingPlanner`) and the
pipeline (`BagPipeTrainPipeline`, which adds a lookahead window); `--sharder torchrec`
runs the unmodified stock path (tables local to the trainers) for comparison.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES
from torchrec.distributed import TrainPipelineSparseDist
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRM_Projection, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from tqdm import tqdm

from torchrec_bagpipe import BagPipeConfig
from torchrec_bagpipe.datasets import CriteoNPYDataset, CriteoTSVDataset, PowerLawCriteoDataset
from torchrec_bagpipe.distributed import (
    BagPipeEmbeddingBagCollectionSharder,
    BagPipeShardingPlanner,
    BagPipeTrainPipeline,
    bagpipe_metrics,
    close_model,
    flush_model,
)
from torchrec_bagpipe.metrics_table import format_table, summarize


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="torchrec dlrm example trainer (BagPipe)")
    parser.add_argument("--epochs", type=int, default=1, help="number of epochs to train")
    parser.add_argument("--batch_size", type=int, default=32,
                        help="batch size to use for training")
    parser.add_argument("--drop_last_training_batch", dest="drop_last_training_batch",
                        action="store_true", help="Drop the last non-full training batch")
    parser.add_argument("--test_batch_size", type=int, default=None,
                        help="batch size to use for validation and testing")
    parser.add_argument("--limit_train_batches", type=int, default=None,
                        help="number of train batches")
    parser.add_argument("--limit_val_batches", type=int, default=None,
                        help="number of validation batches")
    parser.add_argument("--limit_test_batches", type=int, default=None,
                        help="number of test batches")
    parser.add_argument("--dataset_name", type=str, default="criteo_1t",
                        help="dataset for experiment, current support criteo_1tb, criteo_kaggle")
    parser.add_argument("--num_embeddings", type=int, default=100_000,
                        help="max_ind_size. The number of embeddings in each embedding table. "
                             "Defaults to 100_000 if num_embeddings_per_feature is not supplied.")
    parser.add_argument("--num_embeddings_per_feature", type=str, default=None,
                        help="Comma separated max_ind_size per sparse feature. 26 values are "
                             "expected for the Criteo dataset.")
    parser.add_argument("--dense_arch_layer_sizes", type=str, default="512,256,64",
                        help="Comma separated layer sizes for dense arch.")
    parser.add_argument("--over_arch_layer_sizes", type=str, default="512,512,256,1",
                        help="Comma separated layer sizes for over arch.")
    parser.add_argument("--embedding_dim", type=int, default=64, help="Size of each embedding.")
    parser.add_argument("--interaction_branch1_layer_sizes", type=str, default="2048,2048",
                        help="Comma separated layer sizes for interaction branch1 (only on "
                             "dlrm with projection).")
    parser.add_argument("--interaction_branch2_layer_sizes", type=str, default="2048,2048",
                        help="Comma separated layer sizes for interaction branch2 (only on "
                             "dlrm with projection).")
    parser.add_argument("--dcn_num_layers", type=int, default=3,
                        help="Number of DCN layers in interaction layer (only on dlrm with DCN).")
    parser.add_argument("--dcn_low_rank_dim", type=int, default=512,
                        help="Low rank dimension for DCN in interaction layer (only on dlrm "
                             "with DCN).")
    parser.add_argument("--interaction_type", choices=["original", "dcn", "projection"],
                        default="original",
                        help="Determine the interaction type to be used (original, dcn, or "
                             "projection) default is original DLRM with pairwise dot product")
    parser.add_argument("--seed", type=int, help="Random seed for reproducibility.")
    parser.add_argument("--pin_memory", dest="pin_memory", action="store_true",
                        help="Use pinned memory when loading data (accepted; no effect here).")
    parser.add_argument("--mmap_mode", dest="mmap_mode", action="store_true",
                        help="mmap the dataset (NPY files are always memory-mapped here).")
    parser.add_argument("--in_memory_binary_criteo_path", type=str, default=None,
                        help="Directory path containing the Criteo dataset npy files.")
    parser.add_argument("--learning_rate", type=float, default=15.0, help="Learning rate.")
    parser.add_argument("--shuffle_batches", dest="shuffle_batches", action="store_true",
                        help="Shuffle each batch during training (accepted; no effect here).")
    parser.add_argument("--validation_freq_within_epoch", type=int, default=None,
                        help="Frequency at which validation will be run within an epoch.")
    parser.add_argument("--adagrad", dest="adagrad", action="store_true",
                        help="Use Adagrad (BagPipe tables support SGD only: this fails clearly).")
    parser.add_argument("--multi_hot_sizes", type=str, default=None,
                        help="Comma separated multihot size per sparse feature.")
    parser.add_argument("--lr_warmup_steps", type=int, default=0)
    parser.add_argument("--lr_decay_start", type=int, default=0)
    parser.add_argument("--lr_decay_steps", type=int, default=0)
    parser.add_argument("--print_lr", action="store_true",
                        help="Print learning rate every iteration.")
    parser.add_argument("--allow_tf32", action="store_true",
                        help="Enable TensorFloat-32 mode for matrix multiplications.")
    parser.add_argument("--print_sharding_plan", action="store_true",
                        help="Print the sharding plan used for each embedding table.")
    # ---- this example's additions ----------------------------------------------------------
    parser.add_argument("--sharder", choices=["bagpipe", "torchrec"], default="bagpipe",
                        help="bagpipe: tables on the BagPipe PS; torchrec: TorchRec's stock "
                             "sharders (tables local to the trainers), for comparison")
    parser.add_argument("--zipf_alpha", type=float, default=1.05,
                        help="power-law exponent of id popularity in the synthetic dataset")
    parser.add_argument("--criteo_tsv_paths", type=str, default=None,
                        help="Comma separated Criteo TSV files (instead of synthetic data)")
    parser.add_argument("--metrics_json", type=str, default=None,
                        help="write the final metrics (rank 0) to this JSON file")
    parser.add_argument("--no_progress", action="store_true", help="hide the tqdm bars")
    BagPipeConfig.add_arguments(parser)
    parser.set_defaults(pin_memory=None, mmap_mode=None, shuffle_batches=None)
    args = parser.parse_args(argv)
    for name in ("num_embeddings_per_feature", "dense_arch_layer_sizes",
                 "over_arch_layer_sizes", "multi_hot_sizes", "interaction_branch1_layer_sizes",
                 "interaction_branch2_layer_sizes"):
        value = getattr(args, name)
        if isinstance(value, str):
            setattr(args, name, [int(v) for v in value.split(",") if v])
    return args


def _table_sizes(args: argparse.Namespace) -> list[int]:
    if args.num_embeddings_per_feature is not None:
        if len(args.num_embeddings_per_feature) != len(DEFAULT_CAT_NAMES):
            raise ValueError(
                f"--num_embeddings_per_feature needs {len(DEFAULT_CAT_NAMES)} values"
            )
        return list(args.num_embeddings_per_feature)
    return [args.num_embeddings] * len(DEFAULT_CAT_NAMES)


def make_dataset(args: argparse.Namespace, split: str, rank: int, world: int) -> Iterable[Any]:
    sizes = _table_sizes(args)
    batch = args.batch_size if split == "train" else (args.test_batch_size or args.batch_size)
    limit = {"train": args.limit_train_batches, "val": args.limit_val_batches,
             "test": args.limit_test_batches}[split]
    if args.in_memory_binary_criteo_path:
        root = args.in_memory_binary_criteo_path
        days = sorted(glob.glob(os.path.join(root, "*_dense.npy")))
        if not days:
            raise FileNotFoundError(f"no *_dense.npy files in {root}")
        # Last day: val (first half) / test (second half) as TorchRec does; the rest: train.
        chosen = days[:-1] if split == "train" and len(days) > 1 else days[-1:]
        return CriteoNPYDataset(
            chosen, [d.replace("_dense", "_sparse") for d in chosen],
            [d.replace("_dense", "_labels") for d in chosen], batch, sizes, rank, world, limit,
        )
    if args.criteo_tsv_paths:
        return CriteoTSVDataset(args.criteo_tsv_paths.split(","), batch, sizes, rank, world,
                                limit)
    num = limit if limit is not None else 10
    # One seed, so one hidden label model for every split; the splits are different sample
    # streams of it (a different seed per split would evaluate on a different distribution).
    return PowerLawCriteoDataset(
        sizes, batch, num, zipf_alpha=args.zipf_alpha, seed=args.seed or 0, rank=rank,
        world_size=world, multi_hot_sizes=args.multi_hot_sizes,
        stream={"train": 0, "val": 1, "test": 2}[split],
    )


def build_model(args: argparse.Namespace, device: torch.device) -> DLRMTrain:
    sizes = _table_sizes(args)
    eb_configs = [
        EmbeddingBagConfig(name=f"t_{feature_name}", embedding_dim=args.embedding_dim,
                           num_embeddings=sizes[i], feature_names=[feature_name])
        for i, feature_name in enumerate(DEFAULT_CAT_NAMES)
    ]
    common = dict(
        embedding_bag_collection=EmbeddingBagCollection(tables=eb_configs,
                                                        device=torch.device("meta")),
        dense_in_features=len(DEFAULT_INT_NAMES),
        dense_arch_layer_sizes=args.dense_arch_layer_sizes,
        over_arch_layer_sizes=args.over_arch_layer_sizes,
        dense_device=device,
    )
    if args.interaction_type == "dcn":
        dlrm = DLRM_DCN(dcn_num_layers=args.dcn_num_layers,
                        dcn_low_rank_dim=args.dcn_low_rank_dim, **common)
    elif args.interaction_type == "projection":
        dlrm = DLRM_Projection(
            interaction_branch1_layer_sizes=args.interaction_branch1_layer_sizes,
            interaction_branch2_layer_sizes=args.interaction_branch2_layer_sizes, **common,
        )
    else:
        dlrm = DLRM(**common)
    return DLRMTrain(dlrm)


def _evaluate(pipeline: TrainPipelineSparseDist, batches: Iterator[Any], stage: str,
              show: bool) -> float:
    from torchmetrics.classification import BinaryAUROC

    pipeline._model.eval()
    auroc = BinaryAUROC()
    bar = tqdm(desc=f"Evaluating {stage} set", disable=not show)
    with torch.no_grad():
        while True:
            try:
                _loss, logits, labels = pipeline.progress(batches)
            except StopIteration:
                break
            auroc.update(torch.sigmoid(logits), labels.int())
            bar.update(1)
    bar.close()
    result = float(auroc.compute().item()) if auroc.preds else float("nan")
    pipeline._model.train()
    return result


def main(argv: list[str]) -> dict[str, Any]:
    args = parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = args.allow_tf32
    if args.seed is not None:
        torch.manual_seed(args.seed)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device(f"cuda:{rank}")
        backend = "nccl"
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    show = rank == 0 and not args.no_progress
    if args.num_embeddings_per_feature is not None:
        args.num_embeddings = None
    if (args.in_memory_binary_criteo_path is None and args.criteo_tsv_paths is None):
        for split in ("train", "val", "test"):
            if getattr(args, f"limit_{split}_batches") is None:
                setattr(args, f"limit_{split}_batches", 10)

    train_model = build_model(args, device)
    embedding_optimizer = torch.optim.Adagrad if args.adagrad else torch.optim.SGD
    apply_optimizer_in_backward(embedding_optimizer, train_model.model.sparse_arch.parameters(),
                                {"lr": args.learning_rate})
    topology = Topology(local_world_size=get_local_size(), world_size=world,
                        compute_device=device.type)
    if args.sharder == "bagpipe":
        config = BagPipeConfig.from_args(args)
        sharders = [BagPipeEmbeddingBagCollectionSharder(config)]
        planner: EmbeddingShardingPlanner = BagPipeShardingPlanner(
            topology=topology, batch_size=args.batch_size,
            storage_reservation=HeuristicalStorageReservation(percentage=0.05),
        )
    else:
        config = None
        sharders = get_default_sharders()
        planner = EmbeddingShardingPlanner(
            topology=topology, batch_size=args.batch_size,
            storage_reservation=HeuristicalStorageReservation(percentage=0.05),
        )
    plan = planner.collective_plan(train_model, sharders, dist.GroupMember.WORLD)
    model = DistributedModelParallel(module=train_model, device=device, plan=plan,
                                     sharders=sharders)
    if rank == 0 and args.print_sharding_plan:
        print(model.plan)

    dense_optimizer = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        (lambda params: torch.optim.Adagrad(params, lr=args.learning_rate)) if args.adagrad
        else (lambda params: torch.optim.SGD(params, lr=args.learning_rate)),
    )
    optimizer = CombinedOptimizer([model.fused_optimizer, dense_optimizer])

    train_data = make_dataset(args, "train", rank, world)
    val_data = make_dataset(args, "val", rank, world)
    test_data = make_dataset(args, "test", rank, world)

    def epoch_batches() -> Iterator[Any]:
        return itertools.islice(iter(train_data), args.limit_train_batches)

    prescan_s = 0.0
    if args.sharder == "bagpipe":
        assert config is not None
        prescan = None
        if config.optimization_prescan:
            prescan = itertools.chain.from_iterable(epoch_batches() for _ in range(args.epochs))
        train_pipeline: TrainPipelineSparseDist = BagPipeTrainPipeline(
            model, optimizer, device, prescan_batches=prescan
        )
    else:
        train_pipeline = TrainPipelineSparseDist(model, optimizer, device)
    eval_pipeline = TrainPipelineSparseDist(model, optimizer, device)

    results: dict[str, Any] = {"val_auroc": [], "steps": 0}
    model.train()
    dist.barrier()
    train_time = 0.0
    samples = 0
    step_times: list[float] = []
    for epoch in range(args.epochs):
        bar = tqdm(desc=f"Epoch {epoch}", total=args.limit_train_batches, disable=not show)
        it = epoch_batches()
        start = time.perf_counter()
        for step in itertools.count(1):
            try:
                before = getattr(train_pipeline, "prescan_seconds", 0.0)
                t0 = time.perf_counter()
                train_pipeline.progress(it)
                # The first progress call may hand the whole trace to the planner.
                spent = getattr(train_pipeline, "prescan_seconds", 0.0) - before
                prescan_s += spent
                start += spent
                step_times.append(time.perf_counter() - t0 - spent)
            except StopIteration:
                break
            samples += args.batch_size * world
            results["steps"] += 1
            bar.update(1)
            if args.validation_freq_within_epoch and step % args.validation_freq_within_epoch == 0:
                train_time += time.perf_counter() - start
                _evaluate(eval_pipeline, itertools.islice(iter(val_data), args.limit_val_batches),
                          "val", show)
                start = time.perf_counter()
        if args.sharder == "bagpipe":
            flush_model(model)  # the last commit belongs to the training time
        train_time += time.perf_counter() - start
        bar.close()
        results["val_auroc"].append(
            _evaluate(eval_pipeline, itertools.islice(iter(val_data), args.limit_val_batches),
                      "val", show)
        )
    results["test_auroc"] = _evaluate(
        eval_pipeline, itertools.islice(iter(test_data), args.limit_test_batches), "test", show
    )
    results["train_seconds"] = train_time
    results["samples_per_s"] = samples / train_time if train_time > 0 else 0.0
    results["prescan_seconds"] = prescan_s
    results["step_times"] = step_times
    results["world_size"] = world
    raw = bagpipe_metrics(model) if args.sharder == "bagpipe" else {}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, raw)
    summary = summarize(gathered, results["steps"])
    results["bagpipe"] = summary
    if rank == 0:
        print(format_table(results, summary))
        if args.metrics_json:
            with open(args.metrics_json, "w", encoding="utf-8") as f:
                json.dump(results, f, indent=2, default=float)
    if args.sharder == "bagpipe":
        close_model(model)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
    if dist.is_initialized():
        dist.destroy_process_group()
