#!/usr/bin/env python3
"""How exactly each implementation applies Adagrad and row-wise Adagrad: BagPipe's PS store,
stock TorchRec's fused CPU kernel (fbgemm's `SplitTableBatchedEmbeddingBagsCodegen`) and
torch's own optimizers, against the optimizer's definition.

The definition (fbgemm ``EXACT_ADAGRAD`` / ``EXACT_ROWWISE_ADAGRAD``, torch's `Adagrad`,
torchrec's `RowWiseAdagrad`): ``s += g²`` (row-wise: ``s += mean(g²)`` over the row);
``w -= lr · g / (√s + eps)``. Each implementation runs the same sequence of `--steps` sparse
updates (a random set of rows per step, gradients spanning `10^-3 .. 10` in scale) from the
same fp32 rows. At every step, each implementation's fp32 result (weights and state) is
compared with the definition evaluated in float64 on that implementation's own fp32 inputs
(its rows and state before the step, the step's gradient): the error of the update itself,
in units in the last place (ulp) of the operation's scale (for a weight the larger of the
old weight, the step and the new weight, so that a cancellation to near zero does not
inflate it; for the state the new state). `max_ulp_error` / `mean_ulp_error` per
implementation and optimizer (`baseline`: torch's fp32 optimizer), and the fraction of results
that are the correctly rounded value (`exact_fraction`). No timing.

    python benchmarks/optimizer_kernels.py [--rows 4096 --dim 32 --steps 20]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

BENCH = "optimizer_kernels"


def definition(w: np.ndarray, s: np.ndarray, g: np.ndarray, lr: float, eps: float,
               rowwise: bool) -> tuple[np.ndarray, np.ndarray]:
    """The update in float64 from fp32 inputs (w [n, d], s [n, d] or [n, 1], g [n, d])."""
    w64, s64, g64 = w.astype(np.float64), s.astype(np.float64), g.astype(np.float64)
    s1 = s64 + ((g64 * g64).mean(axis=1, keepdims=True) if rowwise else g64 * g64)
    w1 = w64 - np.float64(np.float32(lr)) * g64 / (np.sqrt(s1) + np.float64(np.float32(eps)))
    return w1, s1


def ulps(got: np.ndarray, exact: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """|got - exact| in fp32 ulps of `scale` (the magnitude the operation works at)."""
    spacing = np.spacing(np.abs(scale).astype(np.float32)).astype(np.float64)
    return np.abs(got.astype(np.float64) - exact) / spacing


class Store:
    """BagPipe: the PS's EmbeddingStore running the optimizer."""

    def __init__(self, w: np.ndarray, kind: str, lr: float, eps: float) -> None:
        from torchrec_bagpipe.ps import EmbeddingStore

        self.lr = lr
        self.store = EmbeddingStore(dim=w.shape[1], init="zeros",
                                    optimizer={"kind": kind, "eps": eps})
        self.store.assign(torch.arange(w.shape[0]), torch.from_numpy(w.copy()))

    def rows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        w, s = self.store.lookup_with_state(torch.from_numpy(ids))
        return w.numpy(), s.numpy()

    def step(self, ids: np.ndarray, g: np.ndarray) -> None:
        self.store.apply_gradients(torch.from_numpy(ids), torch.from_numpy(g), self.lr)


class Fbgemm:
    """Stock TorchRec's fused CPU kernel: one fbgemm TBE table, one id per bag."""

    def __init__(self, w: np.ndarray, kind: str, lr: float, eps: float) -> None:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            EmbeddingLocation,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        opt = EmbOptimType.EXACT_ROWWISE_ADAGRAD if kind == "rowwise_adagrad" else (
            EmbOptimType.EXACT_ADAGRAD)
        self.rowwise = kind == "rowwise_adagrad"
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(w.shape[0], w.shape[1], EmbeddingLocation.HOST, ComputeDevice.CPU)],
            optimizer=opt, learning_rate=lr, eps=eps, pooling_mode=PoolingMode.SUM)
        with torch.no_grad():
            self.tbe.split_embedding_weights()[0].copy_(torch.from_numpy(w))

    def rows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        w = self.tbe.split_embedding_weights()[0].detach()[torch.from_numpy(ids)]
        s = self.tbe.split_optimizer_states()[0][0].detach()[torch.from_numpy(ids)]
        return w.numpy().copy(), s.reshape(len(ids), -1).numpy().copy()

    def step(self, ids: np.ndarray, g: np.ndarray) -> None:
        idx = torch.from_numpy(ids)
        out = self.tbe(idx, torch.arange(len(ids) + 1, dtype=torch.int64))
        out.backward(torch.from_numpy(g))


class TorchOptim:
    """torch's own fp32 optimizer on a dense parameter (rows not in the step: zero grad)."""

    def __init__(self, w: np.ndarray, kind: str, lr: float, eps: float) -> None:
        self.p = torch.nn.Parameter(torch.from_numpy(w.copy()))
        if kind == "rowwise_adagrad":
            from torchrec.optim import RowWiseAdagrad

            self.opt: torch.optim.Optimizer = RowWiseAdagrad([self.p], lr=lr, eps=eps)
        else:
            self.opt = torch.optim.Adagrad([self.p], lr=lr, eps=eps)
        self.kind = kind

    def rows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        st = self.opt.state.get(self.p)
        idx = torch.from_numpy(ids)
        w = self.p.detach()[idx].numpy().copy()
        if st is None or "sum" not in st:
            width = 1 if self.kind == "rowwise_adagrad" else w.shape[1]
            return w, np.zeros((len(ids), width), dtype=np.float32)
        return w, st["sum"][idx].reshape(len(ids), -1).numpy().copy()

    def step(self, ids: np.ndarray, g: np.ndarray) -> None:
        grad = torch.zeros_like(self.p)
        grad[torch.from_numpy(ids)] = torch.from_numpy(g)
        self.p.grad = grad
        self.opt.step()


def measure(kind: str, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(args.seed)
    w0 = rng.uniform(-0.1, 0.1, (args.rows, args.dim)).astype(np.float32)
    impls: dict[str, Callable[..., Any]] = {"bagpipe_store": Store, "fbgemm_cpu": Fbgemm,
                                            "torch": TorchOptim}
    runs = {name: cls(w0, kind, args.lr, args.eps) for name, cls in impls.items()}
    errors: dict[str, list[np.ndarray]] = {name: [] for name in runs}
    for _ in range(args.steps):
        ids = np.sort(rng.choice(args.rows, args.rows // 4, replace=False)).astype(np.int64)
        scale = np.float32(10.0 ** rng.uniform(-3, 1))
        g = (rng.standard_normal((ids.size, args.dim)) * scale).astype(np.float32)
        for name, impl in runs.items():
            w, s = impl.rows(ids)
            exact_w, exact_s = definition(w, s, g, args.lr, args.eps, kind == "rowwise_adagrad")
            impl.step(ids, g)
            w1, s1 = impl.rows(ids)
            scale = np.maximum(np.maximum(np.abs(w), np.abs(exact_w)), np.abs(exact_w - w))
            errors[name].append(np.concatenate([ulps(w1, exact_w, scale).ravel(),
                                                ulps(s1, exact_s, exact_s).ravel()]))
    out = {}
    for name, errs in errors.items():
        e = np.concatenate(errs)
        out[name] = {"max": float(e.max()), "mean": float(e.mean()),
                     "exact": float((e <= 0.5).mean())}
    return out


def emit(metric: str, value: float, unit: str, baseline: float | None, **tags: Any) -> None:
    ratio = value / baseline if baseline else None
    print(json.dumps({"bench": BENCH, "metric": metric, "value": value, "unit": unit,
                      "baseline": baseline, "ratio": ratio, "threads": 1, **tags}), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for kind in ("adagrad", "rowwise_adagrad"):
        res = measure(kind, args)
        base = res["torch"]
        for name, r in res.items():
            tags = {"optimizer": kind, "impl": name, "dim": args.dim, "steps": args.steps}
            emit("max_ulp_error", r["max"], "ulp", base["max"], **tags)
            emit("mean_ulp_error", r["mean"], "ulp", base["mean"], **tags)
            emit("exact_fraction", r["exact"], "ratio", base["exact"], **tags)
    return 0


if __name__ == "__main__":
    sys.exit(main())
