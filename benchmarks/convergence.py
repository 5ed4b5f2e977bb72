#!/usr/bin/env python3
"""Convergence: the DLRM example trained by stock TorchRec and by BagPipe, step by step.

For each dataset, the same model (`examples/dlrm/dlrm_main.py`'s DLRM) starts from the same
initial weights (one unsharded state dict, loaded into both) and trains on the same batches
on 2 gloo ranks: once with TorchRec's stock sharders (tables local to the trainers, fused
CPU kernels) and once with BagPipe (tables on the PS, bounded caches, lookahead prefetch).
Datasets:

* ``synthetic``: the example's power-law data (a hidden logistic model of the features);
* ``criteo``: Criteo-format TSV days written from the same kind of hidden model (dense
  counts, 32-bit hex categorical values hashed into the tables by TorchRec's reader), turned
  into NPY files by TorchRec's own preprocessing (`npy_preproc_criteo`), read through
  ``--in_memory_binary_criteo_path`` (train: days 0-22, val/test: halves of day 23).

It prints one JSON line per result: per-step loss differences (max, mean, last; the loss of a
step is the mean of both ranks' batch losses), the final training loss, and the validation
and test AUROC of both runs (`baseline` = stock TorchRec), and plots both loss curves and
their difference in a PNG. ``--optimizer`` picks the embedding optimizer: ``sgd``,
``adagrad`` (dlrm_main's ``--adagrad``) or ``rowwise_adagrad``
(`torchrec.optim.RowWiseAdagrad` on the tables, Adagrad for the dense part).

With ``--reference`` (default on) the same model is also trained in one process on the
global batch with torch's own optimizers (`examples/dlrm/single_process.py`): the definition
both distributed runs should reproduce. ``ref_*`` lines give each run's loss differences from
it (``run``: ``bagpipe`` or ``stock``), so for Adagrad and row-wise Adagrad they say which of
BagPipe's PS and stock TorchRec's fused CPU kernels matches the optimizer's definition, and
by how much the other differs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from typing import Any

from dlrm_ranks import REPO, RankError, run_dlrm

BENCH = "convergence"
DAYS = 24


def write_criteo_tsv_days(out_dir: str, rows_per_day: list[int], num_embeddings: int,
                          seed: int) -> list[str]:
    """Criteo TSV days from `PowerLawCriteoDataset`'s hidden model: label, 13 dense counts
    (``floor(50 x)``, 5 % empty), 26 categorical ids written as 32-bit hex values that hash
    (mod `num_embeddings`) back to the id (3 % empty)."""
    import numpy as np
    import torch

    from torchrec_bagpipe.datasets import PowerLawCriteoDataset

    rng = np.random.default_rng(seed)
    paths = []
    for day, rows in enumerate(rows_per_day):
        data = PowerLawCriteoDataset([num_embeddings] * 26, rows, 1, seed=seed, stream=day)
        batch = data.batch(0)
        ids = batch.sparse_features.values().reshape(26, rows).T.numpy()
        raw = ids + num_embeddings * rng.integers(0, (2**32 - 1) // num_embeddings,
                                                  size=ids.shape)
        dense = torch.floor(batch.dense_features * 50).to(torch.int64).numpy()
        labels = batch.labels.to(torch.int64).numpy()
        lines = []
        for i in range(rows):
            d = ["" if rng.random() < 0.05 else str(v) for v in dense[i]]
            c = ["" if rng.random() < 0.03 else format(int(v), "x") for v in raw[i]]
            lines.append("\t".join([str(labels[i]), *d, *c]))
        path = os.path.join(out_dir, f"day_{day}")
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        paths.append(path)
    return paths


def preprocess(tsv_dir: str, npy_dir: str) -> None:
    """TorchRec's own preprocessing script, as a user runs it."""
    from torchrec.datasets.scripts import npy_preproc_criteo

    os.makedirs(npy_dir, exist_ok=True)
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON lines only
        npy_preproc_criteo.main(["--input_dir", tsv_dir, "--output_dir", npy_dir,
                                 "--dataset_name", "criteo_1tb"])


def embedding_optimizer(name: str, lr: float, eps: float | None) -> tuple[list[str], Any]:
    """(extra dlrm_main flags, `embedding_optimizer` argument of `main`) for `name`; `eps`:
    Adagrad's epsilon (None: the optimizer's own default: torchrec's RowWiseAdagrad 1e-10,
    which stock TorchRec replaces by fbgemm's 1e-8 when it fuses the optimizer)."""
    if name == "sgd":
        return [], None
    flags = ["--adagrad"] + (["--eps", str(eps)] if eps is not None else [])
    if name == "adagrad":
        return flags, None
    if name == "rowwise_adagrad":
        from torchrec.optim import RowWiseAdagrad

        return flags, (RowWiseAdagrad, {"lr": lr, **({"eps": eps} if eps is not None else {})})
    raise ValueError(f"unknown optimizer {name!r}")


def initial_state(argv: list[str], seed: int) -> dict[str, Any]:
    """The unsharded model's weights (tables included) both runs start from."""
    import torch

    sys.path.insert(0, os.path.join(REPO, "examples", "dlrm"))
    import dlrm_main

    torch.manual_seed(seed)
    model = dlrm_main.build_model(dlrm_main.parse_args(argv), torch.device("cpu"),
                                  table_device=torch.device("cpu"))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def step_losses(per_rank: list[dict[str, Any]]) -> list[float]:
    """The global loss of each step: the mean of the ranks' batch losses (equal batches)."""
    return [sum(v) / len(v) for v in zip(*(r["train_losses"] for r in per_rank))]


def emit(metric: str, value: float | None, unit: str, baseline: float | None,
         **extra: Any) -> None:
    line = {"bench": BENCH, "metric": metric, "value": value, "unit": unit,
            "baseline": baseline,
            "ratio": (value / baseline) if value is not None and baseline else None,
            "threads": 1, **extra}
    print(json.dumps(line), flush=True)


def _one_ulp_up(state: dict[str, Any]) -> dict[str, Any]:
    import torch

    return {k: torch.nextafter(v, torch.full_like(v, math.inf)) if v.is_floating_point()
            else v for k, v in state.items()}


def _diffs(a: list[float], b: list[float]) -> list[float]:
    if len(a) != len(b):
        raise RuntimeError(f"{len(a)} steps vs {len(b)} steps")
    return [abs(x - y) for x, y in zip(a, b)]


def _emit_diffs(prefix: str, diffs: list[float], baseline: list[float], **tags: Any) -> None:
    emit(f"{prefix}max_abs_loss_diff", max(diffs), "loss", None, **tags)
    emit(f"{prefix}mean_abs_loss_diff", sum(diffs) / len(diffs), "loss", None, **tags)
    emit(f"{prefix}last_abs_loss_diff", diffs[-1], "loss", None, **tags)
    emit(f"{prefix}max_rel_loss_diff", max(d / abs(y) for d, y in zip(diffs, baseline) if y),
         "ratio", None, **tags)
    emit(f"{prefix}bitwise_equal_steps", sum(d == 0 for d in diffs), "steps", len(diffs),
         **tags)


def compare(dataset: str, argv: list[str], args: argparse.Namespace,
            extra: list[str], emb_opt: Any) -> dict[str, Any]:
    """Trains with both sharders (and, with --control, stock TorchRec again from weights one
    ulp away); emits the comparison lines and returns the curves."""
    init = initial_state(argv + extra, args.seed)
    tags = {"dataset": dataset, "optimizer": args.optimizer, "steps": args.steps,
            "world": args.world_size, "batch_size": args.batch_size,
            "learning_rate": args.learning_rate, "eps": args.eps}
    plan = [("stock", "torchrec", init), ("bagpipe", "bagpipe", init)]
    if args.control:
        plan.append(("control", "torchrec", _one_ulp_up(init)))
    runs: dict[str, Any] = {}
    for key, sharder, state in plan:
        try:
            # Every table on BagPipe (by size, these small tables would stay stock).
            placement = ["--placement-min-rows", "0"] if sharder == "bagpipe" else []
            runs[key] = run_dlrm([*argv, *extra, "--sharder", sharder, *placement],
                                 args.world_size,
                                 args.timeout, initial_state=state,
                                 embedding_optimizer=emb_opt)
        except RankError as e:
            runs[key] = None
            emit("test_auroc", None, "auroc", None, run=key,
                 error=f"{e.kind}: {e.message}", **tags)
    curves: dict[str, Any] = {"dataset": dataset}
    for key, per_rank in runs.items():
        if per_rank is not None:
            curves[key] = step_losses(per_rank)
    stock, ours = runs["stock"], runs["bagpipe"]
    if stock is None:
        return curves
    if runs.get("control") is not None:
        # How far stock TorchRec itself drifts from a one-ulp change of its initial weights:
        # the scale of differences that fp32 rounding alone produces on this trajectory.
        _emit_diffs("control_", _diffs(curves["control"], curves["stock"]), curves["stock"],
                    **tags)
    if args.reference:
        sys.path.insert(0, os.path.join(REPO, "examples", "dlrm"))
        import single_process

        ref = single_process.reference_losses([*argv, *extra], init, emb_opt,
                                              world=args.world_size)
        curves["reference"] = ref
        for key in ("stock", "bagpipe"):
            if key in curves:
                _emit_diffs("ref_", _diffs(curves[key], ref), ref, run=key, **tags)
    if ours is None:
        return curves
    a, b = curves["bagpipe"], curves["stock"]
    tail = max(1, len(a) // 10)
    _emit_diffs("", _diffs(a, b), b, **tags)
    emit("final_train_loss", sum(a[-tail:]) / tail, "loss", sum(b[-tail:]) / tail,
         window_steps=tail, **tags)
    emit("first_train_loss", a[0], "loss", b[0], **tags)
    emit("val_auroc", ours[0]["val_auroc"][-1], "auroc", stock[0]["val_auroc"][-1], **tags)
    emit("test_auroc", ours[0]["test_auroc"], "auroc", stock[0]["test_auroc"], **tags)
    return curves


def _moving_average(y: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(y):
        acc += v - (y[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def _plot(all_curves: list[dict[str, Any]], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(2, len(all_curves), figsize=(6.5 * len(all_curves), 7),
                             squeeze=False, sharex="col")
    for col, curves in enumerate(all_curves):
        top, bottom = axes[0][col], axes[1][col]
        for key, color in (("stock", "tab:blue"), ("bagpipe", "tab:orange")):
            if key not in curves:
                continue
            y = curves[key]
            label = "stock TorchRec" if key == "stock" else "BagPipe"
            x = range(1, len(y) + 1)
            top.plot(x, y, color=color, lw=0.6, alpha=0.35)
            top.plot(x, _moving_average(y, 20), color=color, lw=1.8,
                     ls="-" if key == "stock" else "--", label=f"{label} (20-step mean)")
        top.set_title(f"{curves['dataset']}: training loss per step")
        top.set_ylabel("BCE loss (mean of the ranks)")
        top.legend()
        titles = []
        for key, color, label in (("bagpipe", "tab:red", "BagPipe - stock"),
                                  ("control", "tab:gray", "stock (+1 ulp init) - stock")):
            if "stock" not in curves or key not in curves:
                continue
            d = [abs(x - y) for x, y in zip(curves[key], curves["stock"])]
            steps = [i + 1 for i, v in enumerate(d) if v > 0]
            bottom.semilogy(steps, [v for v in d if v > 0], "o", ms=3, color=color,
                            label=label, alpha=0.8 if key == "bagpipe" else 0.5)
            titles.append(f"{label}: max {max(d):.2g}, bitwise equal at "
                          f"{len(d) - len(steps)}/{len(d)} steps")
            bottom.set_xlim(0, len(d) + 1)
        if titles:
            bottom.set_title("\n".join(titles), fontsize=9)
            bottom.legend(fontsize=8)
        bottom.set_ylabel("|loss difference| (> 0)")
        bottom.set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300, help="training steps (batches per rank)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--num-embeddings", type=int, default=5000, help="rows per table (26)")
    p.add_argument("--dim", type=int, default=16, help="embedding dim")
    p.add_argument("--learning-rate", type=float, default=1.0)
    p.add_argument("--optimizer", choices=["sgd", "adagrad", "rowwise_adagrad"], default="sgd")
    p.add_argument("--eps", type=float, default=None,
                   help="Adagrad's epsilon (default: dlrm_main's 1e-8 for adagrad, "
                        "RowWiseAdagrad's own 1e-10 for rowwise_adagrad)")
    p.add_argument("--datasets", default="synthetic,criteo")
    p.add_argument("--eval-batches", type=int, default=16, help="val and test batches per rank")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--png", default=None,
                   help="plot path (default: benchmarks/convergence.png)")
    p.add_argument("--control", action=argparse.BooleanOptionalAction, default=True,
                   help="also train stock TorchRec from initial weights one ulp away: the "
                        "drift fp32 rounding alone causes (default on)")
    p.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                   help="also train the single-process model on the global batch and report "
                        "each run's distance from it (default on)")
    p.add_argument("--timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    started = time.perf_counter()
    extra, emb_opt = embedding_optimizer(args.optimizer, args.learning_rate, args.eps)
    common = [
        "--batch_size", str(args.batch_size), "--limit_train_batches", str(args.steps),
        "--limit_val_batches", str(args.eval_batches),
        "--limit_test_batches", str(args.eval_batches),
        "--num_embeddings", str(args.num_embeddings), "--embedding_dim", str(args.dim),
        "--dense_arch_layer_sizes", f"64,{args.dim}", "--over_arch_layer_sizes", "64,32,1",
        "--learning_rate", str(args.learning_rate), "--seed", str(args.seed), "--no_progress",
    ]
    all_curves = []
    with tempfile.TemporaryDirectory() as tmp:
        for dataset in [d for d in args.datasets.split(",") if d]:
            if dataset == "synthetic":
                data: list[str] = []
            elif dataset == "criteo":
                train_rows = args.steps * args.batch_size * args.world_size
                per_day = math.ceil(train_rows / (DAYS - 1))
                eval_rows = 2 * args.eval_batches * args.batch_size * args.world_size
                tsv, npy = os.path.join(tmp, "tsv"), os.path.join(tmp, "npy")
                os.makedirs(tsv)
                write_criteo_tsv_days(tsv, [per_day] * (DAYS - 1) + [eval_rows],
                                      args.num_embeddings, args.seed)
                preprocess(tsv, npy)
                data = ["--in_memory_binary_criteo_path", npy]
            else:
                p.error(f"unknown dataset {dataset!r}")
            all_curves.append(compare(dataset, [*common, *data], args, extra, emb_opt))
    emit("wall_s", time.perf_counter() - started, "s", None)
    _plot(all_curves, args.png or os.path.join(REPO, "benchmarks", "convergence.png"),
          f"DLRM example, {args.world_size} ranks, {args.optimizer}, "
          f"batch {args.batch_size}/rank, lr {args.learning_rate}: same initial weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
