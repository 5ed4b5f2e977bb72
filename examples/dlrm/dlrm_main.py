#!/usr/bin/env python3
"""DLRM training with TorchRec, embeddings on the BagPipe parameter server.

The command line is TorchRec's DLRM example (`torchrec_dlrm/dlrm_main.py`): the same flags,
defaults and semantics — data stages, learning-rate policy (`lr_scheduler.py`, applied to
the dense optimizer and to the tables' fused optimizer), ``--adagrad``, multi-hot
expansion, the training/validation/test loop — plus BagPipe's flags (every `BagPipeConfig`
field: ``--read-mode``, ``--optimization-prescan``, ``--optimization-cache-capacity``,
``--bagpipe-aggregation``, ``--ps-type``, ``--lookahead``, ...) and a few of its own
(``--sharder``, ``--zipf_alpha``, ``--criteo_tsv_paths``, ``--metrics_json``,
``--no_progress``). A flag that cannot act in the chosen setting is refused with a message
saying why (e.g. ``--pin_memory`` without CUDA, ``--dcn_num_layers`` without
``--interaction_type dcn``), never accepted and ignored.

The flags and their checks: `dlrm_flags.py`. Data (`dlrm_dataloader.py`): TorchRec's
preprocessed Criteo files (``--in_memory_binary_criteo_path``), raw Criteo TSVs
(``--criteo_tsv_paths``), the MLPerf multi-hot files (``--synthetic_multi_hot_criteo_path``),
or else synthetic power-law data.

Run on 2 ranks of one machine:

    torchrec-bagpipe-launch --nproc-per-node 2 examples/dlrm/dlrm_main.py \\
        --limit_train_batches 200 --read-mode bagpipe --optimization-prescan

Compared with TorchRec's script, the differences are the sharder
(`BagPipeEmbeddingBagCollectionSharder`), the planner (`BagPipeShardingPlanner`) and the
pipeline (`BagPipeTrainPipeline`, which adds a lookahead window); ``--sharder torchrec``
runs the stock path (tables local to the trainers) for comparison. The planner places each
table by the placement rule (distributed/placement.py): every table BagPipe can serve goes
to BagPipe unless ``--placement-min-rows`` / ``--placement-memory-fraction`` (opt-in size
rule) keep the small ones on TorchRec's stock sharding in the same EmbeddingBagCollection;
rank 0 prints the placement (one line, and the plan table with where and why with
``--print_sharding_plan``). ``--placement-min-rows 0`` puts every table on BagPipe.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES
from torchrec.distributed import TrainPipelineSparseDist
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.model_parallel import (
    DistributedModelParallel,
    get_default_sharders,
)
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.storage_reservations import (
    FixedPercentageStorageReservation,
)
from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRM_Projection, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.optim.apply_optimizer_in_backward import (
    apply_optimizer_in_backward,
)
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from tqdm import tqdm

from torchrec_bagpipe import BagPipeConfig
from torchrec_bagpipe.distributed import (
    BAGPIPE_KERNEL,
    BagPipeEmbeddingBagCollectionSharder,
    BagPipeShardingPlanner,
    BagPipeTrainPipeline,
    bagpipe_metrics,
    checkpoint_due,
    close_model,
    flush_model,
    load_job_checkpoint,
    restore_rng_state,
    save_job_checkpoint,
)
from torchrec_bagpipe.metrics_table import format_table, summarize

# The example's own modules sit next to it (as in TorchRec's example).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dlrm_dataloader import get_dataloader, make_multi_hot, table_sizes
from dlrm_flags import parse_args
from lr_scheduler import LRPolicyScheduler


def configure_torch(args: argparse.Namespace) -> None:
    """Process-wide settings of the flags: TF32 matmuls (``--allow_tf32``) and the seed of
    torch's generator (``--seed``: the dense layers' initial weights), and of Python's and
    NumPy's global generators (a whole-job checkpoint saves and restores all three)."""
    torch.backends.cuda.matmul.allow_tf32 = args.allow_tf32
    if args.seed is not None:
        torch.manual_seed(args.seed)
        random.seed(args.seed)
        np.random.seed(args.seed % (1 << 32))


def virtual_table_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The EmbeddingBagConfig fields of ``--virtual_tables`` (none without it)."""
    if not getattr(args, "virtual_tables", False):
        return {}
    from torchrec_bagpipe.distributed import StepTTLEvictionPolicy

    policy = None
    if args.virtual_ttl_steps:
        policy = StepTTLEvictionPolicy(
            ttl_steps=args.virtual_ttl_steps,
            training_id_eviction_trigger_count=args.virtual_eviction_trigger)
    return {"use_virtual_table": True, "virtual_table_eviction_policy": policy}


def build_model(args: argparse.Namespace, device: torch.device,
                table_device: torch.device | None = None) -> DLRMTrain:
    """The DLRM of `args` (tables on `meta` unless `table_device`: sharding places them)."""
    sizes = table_sizes(args)
    eb_configs = [
        EmbeddingBagConfig(name=f"t_{feature_name}", embedding_dim=args.embedding_dim,
                           num_embeddings=sizes[i], feature_names=[feature_name],
                           **virtual_table_fields(args))
        for i, feature_name in enumerate(DEFAULT_CAT_NAMES)
    ]
    ebc = EmbeddingBagCollection(tables=eb_configs,
                                 device=table_device or torch.device("meta"))
    common: dict[str, Any] = dict(
        embedding_bag_collection=ebc, dense_in_features=len(DEFAULT_INT_NAMES),
        dense_arch_layer_sizes=args.dense_arch_layer_sizes,
        over_arch_layer_sizes=args.over_arch_layer_sizes, dense_device=device,
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


def _optimizer_factory(args: argparse.Namespace) -> Any:
    if args.adagrad:
        return lambda params: torch.optim.Adagrad(params, lr=args.learning_rate, eps=args.eps)
    return lambda params: torch.optim.SGD(params, lr=args.learning_rate)


def shard(args: argparse.Namespace, train_model: DLRMTrain, device: torch.device,
          embedding_optimizer: tuple[type, dict[str, Any]] | None = None,
          ) -> tuple[DistributedModelParallel, CombinedOptimizer, LRPolicyScheduler,
                     BagPipeConfig | None]:
    """DMP of the model, the combined (fused tables + dense) optimizer and the LR policy.
    The tables' optimizer is TorchRec's choice (Adagrad with ``--adagrad``, else SGD, at
    ``--learning_rate``) unless `embedding_optimizer` = (class, kwargs) names another."""
    if embedding_optimizer is None:
        optimizer_kwargs: dict[str, Any] = {"lr": args.learning_rate}
        if args.adagrad:
            optimizer_kwargs["eps"] = args.eps
        embedding_optimizer = (torch.optim.Adagrad if args.adagrad else torch.optim.SGD,
                               optimizer_kwargs)
    apply_optimizer_in_backward(embedding_optimizer[0],
                                train_model.model.sparse_arch.parameters(),
                                dict(embedding_optimizer[1]))
    # As TorchRec 1.9 asks: the topology through TopologyFactory, a fixed reservation.
    topology = TopologyFactory.create_topology(
        TrainerConfig(world_size=dist.get_world_size(), local_world_size=get_local_size()),
        kernel_config=KernelConfig(compute_device=device.type))
    reservation = FixedPercentageStorageReservation(percentage=0.05)
    config: BagPipeConfig | None = None
    if args.sharder == "bagpipe":
        config = BagPipeConfig.from_args(args)
        sharders: list[Any] = [BagPipeEmbeddingBagCollectionSharder(config)]
        planner: EmbeddingShardingPlanner = BagPipeShardingPlanner(
            topology=topology, batch_size=args.batch_size, storage_reservation=reservation)
    else:
        sharders = get_default_sharders()
        planner = EmbeddingShardingPlanner(topology=topology, batch_size=args.batch_size,
                                           storage_reservation=reservation)
    plan = planner.collective_plan(train_model, sharders, dist.GroupMember.WORLD)
    model = DistributedModelParallel(module=train_model, device=device, plan=plan,
                                     sharders=sharders)
    if dist.get_rank() == 0:
        if config is not None:
            print(placement_summary(model.plan))
        if args.print_sharding_plan:
            # TorchRec's plan table; BagPipe's adds where each table's rows live.
            print(model.plan)
    dense_optimizer = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())), _optimizer_factory(args))
    optimizer = CombinedOptimizer([model.fused_optimizer, dense_optimizer])
    lr_scheduler = LRPolicyScheduler(optimizer, args.lr_warmup_steps, args.lr_decay_start,
                                     args.lr_decay_steps)
    return model, optimizer, lr_scheduler, config


def placement(plan: ShardingPlan) -> dict[str, list[str]]:
    """The tables the plan puts on BagPipe and those it keeps on stock TorchRec sharding."""
    out: dict[str, list[str]] = {"bagpipe": [], "stock": []}
    for module_plan in plan.plan.values():
        for table, ps in module_plan.items():  # type: ignore[attr-defined]
            out["bagpipe" if ps.compute_kernel == BAGPIPE_KERNEL else "stock"].append(table)
    return out


def sharding_types(plan: ShardingPlan) -> dict[str, str]:
    """Each table's sharding type in the plan (what its traffic between trainers is)."""
    return {table: str(ps.sharding_type) for module_plan in plan.plan.values()
            for table, ps in module_plan.items()}  # type: ignore[attr-defined]


def placement_summary(plan: ShardingPlan) -> str:
    """One line: which tables are on BagPipe (rows in the PS) and which stay stock."""
    placed = placement(plan)
    ours, stock = placed["bagpipe"], placed["stock"]
    return (f"Placement: {len(ours)} of {len(ours) + len(stock)} tables on BagPipe "
            f"({', '.join(ours) or 'none'}), {len(stock)} on stock TorchRec sharding "
            "(--placement-min-rows, --placement-memory-fraction; --print_sharding_plan "
            "prints the plan)")


def _evaluate(limit: int | None, pipeline: TrainPipelineSparseDist, loader: Any, stage: str,
              show: bool) -> float:
    from torchmetrics.classification import BinaryAUROC

    pipeline._model.eval()
    auroc = BinaryAUROC()
    iterator = itertools.islice(iter(loader), limit)
    bar = tqdm(desc=f"Evaluating {stage} set", disable=not show)
    samples = 0
    with torch.no_grad():
        while True:
            try:
                _loss, logits, labels = pipeline.progress(iterator)
            except StopIteration:
                break
            auroc.update(torch.sigmoid(logits), labels.int())
            samples += labels.numel()
            bar.update(1)
    bar.close()
    result = float(auroc.compute().item()) if auroc.preds else float("nan")
    count = torch.tensor(samples)
    dist.reduce(count, 0, op=dist.ReduceOp.SUM)
    if dist.get_rank() == 0:
        print(f"AUROC over {stage} set: {result}.")
        print(f"Number of {stage} samples: {int(count)}")
    pipeline._model.train()
    return result


def _chunks(iterator: Iterator[Any], n: int | None) -> Iterator[Iterator[Any]]:
    """Consecutive chunks of at most n items (one chunk when n is None)."""
    if n is None:
        yield iterator
        return
    for first in iterator:
        yield itertools.chain((first,), itertools.islice(iterator, n - 1))


def train_val_test(args: argparse.Namespace, model: DistributedModelParallel,
                   optimizer: CombinedOptimizer, lr_scheduler: LRPolicyScheduler,
                   loaders: Mapping[str, Any], device: torch.device,
                   config: BagPipeConfig | None) -> dict[str, Any]:
    """TorchRec's training loop: per epoch, train (validating every
    ``--validation_freq_within_epoch`` steps) then validate; finally test."""
    rank, world = dist.get_rank(), dist.get_world_size()
    show = rank == 0 and not args.no_progress

    def epoch_batches() -> Iterator[Any]:
        return itertools.islice(iter(loaders["train"]), args.limit_train_batches)

    # A resumed job (--resume): the trainer state of the checkpoint's set, and the number of
    # training batches already done (skipped below, so the data continues where it stopped).
    # Its random streams are restored once the data iterator is created and positioned (the
    # iterator's creation draws from torch's generator), right before the first step.
    resumed, extra = (load_job_checkpoint(model, optimizer=optimizer, restore_rng=False)
                      if config is not None else (0, None))
    rng_held = config is not None and resumed > 0
    if extra is not None:
        lr_scheduler.load_state_dict(extra["lr_scheduler"])
        # Another number of trainers resumes the same global batch (its steps are the same
        # synchronous updates): each rank skips `resumed` batches of its own share, as
        # TorchRec's readers number batches per rank.
        saved = int(extra.get("global_batch", world * args.batch_size))
        if saved != world * args.batch_size:
            hint = (f"; pass --batch_size {saved // world}" if saved % world == 0 else "")
            raise ValueError(
                f"--resume: the checkpoint was trained with a global batch of {saved} samples, "
                f"this job's is {world} ranks x --batch_size {args.batch_size} = "
                f"{world * args.batch_size}{hint}")

    if config is not None:
        prescan = None
        if config.optimization_prescan:
            prescan = itertools.islice(itertools.chain.from_iterable(
                epoch_batches() for _ in range(args.epochs)), resumed, None)
        pipeline: TrainPipelineSparseDist = BagPipeTrainPipeline(
            model, optimizer, device, prescan_batches=prescan)
    else:
        pipeline = TrainPipelineSparseDist(model, optimizer, device, execute_all_batches=True)
    eval_pipeline = TrainPipelineSparseDist(model, optimizer, device, execute_all_batches=True)

    results: dict[str, Any] = {"val_auroc": [], "steps": 0, "train_losses": [], "lrs": []}
    model.train()
    dist.barrier()
    train_time = prescan_s = emulated_s = 0.0
    samples = 0
    step_times: list[float] = []
    step = skip = resumed
    for epoch in range(args.epochs):
        batches = epoch_batches()
        it = 0  # steps within the epoch (--print_lr and --validation_freq_within_epoch count them)
        if skip:
            it = sum(1 for _ in itertools.islice(batches, skip))
            skip -= it
            if skip:
                continue  # this whole epoch was trained before the checkpoint
        if rng_held:
            restore_rng_state()  # the stream the uninterrupted run drew from after its save
            rng_held = False
        bar = tqdm(desc=f"Epoch {epoch}", total=args.limit_train_batches, disable=not show)
        start = time.perf_counter()
        for chunk in _chunks(batches, args.validation_freq_within_epoch):
            while True:
                lrs = [float(g["lr"]) for g in optimizer.param_groups]  # this step's rates
                before = getattr(pipeline, "prescan_seconds", 0.0)
                t0 = time.perf_counter()
                try:
                    loss, _logits, labels = pipeline.progress(chunk)
                except StopIteration:
                    break
                if args.emulated_compute_ms:  # an accelerator's compute: the host is free
                    time.sleep(args.emulated_compute_ms / 1e3)
                    emulated_s += args.emulated_compute_ms / 1e3
                # The first progress call may hand the whole trace to the planner.
                spent = getattr(pipeline, "prescan_seconds", 0.0) - before
                prescan_s += spent
                start += spent
                step_times.append(time.perf_counter() - t0 - spent)
                if args.print_lr and rank == 0:
                    for i, lr in enumerate(lrs):
                        print(f"lr: {it} {i} {lr:.6f}")
                lr_scheduler.step()
                step += 1
                it += 1
                samples += labels.numel()
                results["train_losses"].append(float(loss))
                results["lrs"].append(lrs)
                bar.update(1)
                if config is not None and checkpoint_due(step):  # --checkpoint-every
                    save_job_checkpoint(model, step=step, optimizer=optimizer,
                                        extra={"lr_scheduler": lr_scheduler.state_dict(),
                                               "global_batch": world * args.batch_size})
            if args.validation_freq_within_epoch and it % args.validation_freq_within_epoch == 0:
                train_time += time.perf_counter() - start
                _evaluate(args.limit_val_batches, eval_pipeline, loaders["val"], "val", show)
                start = time.perf_counter()
        if config is not None:
            flush_model(model)  # the last commit belongs to the training time
        train_time += time.perf_counter() - start
        bar.close()
        if rank == 0:
            print("Total number of iterations:", it)
        results["val_auroc"].append(
            _evaluate(args.limit_val_batches, eval_pipeline, loaders["val"], "val", show))
    results["steps"] = step
    results["test_auroc"] = _evaluate(args.limit_test_batches, eval_pipeline, loaders["test"],
                                      "test", show)
    total = torch.tensor(samples)
    dist.all_reduce(total)
    results["samples"] = int(total)
    results["train_seconds"] = train_time
    results["samples_per_s"] = int(total) / train_time if train_time > 0 else 0.0
    results["prescan_seconds"] = prescan_s
    results["emulated_compute_s"] = emulated_s
    results["step_times"] = step_times
    results["world_size"] = world
    return results


def main(argv: list[str], initial_state: Mapping[str, torch.Tensor] | None = None,
         embedding_optimizer: tuple[type, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Trains, validates and tests; returns the metrics (rank 0 also prints them).
    `initial_state`: a state dict of the unsharded `DLRMTrain`, loaded after sharding (runs
    with either sharder then start from the same weights). `embedding_optimizer`: see
    `shard` (e.g. ``(torchrec.optim.RowWiseAdagrad, {"lr": 0.1})``)."""
    args = parse_args(argv)
    configure_torch(args)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device(f"cuda:{local_rank}")
        backend = "nccl"
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if local_rank == 0:
        params = (args.learning_rate, args.batch_size, args.lr_warmup_steps,
                  args.lr_decay_start, args.lr_decay_steps)
        print(f"PARAMS: (lr, batch_size, warmup_steps, decay_start, decay_steps): {params}")
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.in_memory_binary_criteo_path is args.synthetic_multi_hot_criteo_path is \
            args.criteo_tsv_paths is None:
        for split in ("train", "val", "test"):
            if getattr(args, f"limit_{split}_batches") is None:
                setattr(args, f"limit_{split}_batches", 10)
    multi_hot = make_multi_hot(args)
    loaders = {stage: get_dataloader(args, stage, rank, world, multi_hot)
               for stage in ("train", "val", "test")}
    model, optimizer, lr_scheduler, config = shard(args, build_model(args, device), device,
                                                   embedding_optimizer)
    try:
        if initial_state is not None:
            model.load_state_dict(dict(initial_state))
        results = train_val_test(args, model, optimizer, lr_scheduler, loaders, device, config)
        results["placement"] = placement(model.plan)
        results["sharding_types"] = sharding_types(model.plan)
        raw = bagpipe_metrics(model) if config is not None else {}
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, raw)
        results["bagpipe"] = summarize(gathered, results["steps"])
        if multi_hot is not None and args.collect_multi_hot_freqs_stats:
            results["multi_hot_stats"] = multi_hot.save_freqs_stats(rank)
        if rank == 0:
            print(format_table(results, results["bagpipe"]))
            if args.metrics_json:
                with open(args.metrics_json, "w", encoding="utf-8") as f:
                    json.dump(results, f, indent=2, default=float)
    finally:
        if config is not None:
            close_model(model)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
    if dist.is_initialized():
        dist.destroy_process_group()
