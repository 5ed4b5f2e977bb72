"""Benchmark of the PS storage engine (torchrec_bagpipe.ps.EmbeddingStore).

Workloads: 10M keys of dim 32 and 2M keys of dim 128, every key stored; batches of 4096 keys
drawn from Zipf(1.05) over key ranks, ranks scattered over the key space by a fixed random
permutation (hot keys are not neighbours). Measured with 1 and 2 store threads:

* lookup       M keys/s   store.lookup(keys, out=preallocated)
* apply_sgd    M rows/s   store.apply_sgd(keys, grads, lr)   (input rows, duplicates included)
* bytes/row    bytes      (resident + spilled bytes) / rows, maps included
* apply_<opt>  M rows/s   store.apply_gradients(keys, grads, lr) of a store running optimizer
                          <opt> (adagrad, rowwise_adagrad, adam); store_sgd: the SGD store's
                          apply_sgd rate timed in the same rotation, vs_store_sgd = the ratio
* bytes_per_row_<opt>     bytes per row of that store (its optimizer state included)

Baseline, measured in the same run over the same keys: fbgemm's pruned hash map (int64
table, load factor 0.5) -- torch.ops.fbgemm.pruned_hashmap_lookup to remap keys to dense row
ids, then torch.index_select(weights, 0, ids, out=out) for lookup and, for apply_sgd,
torch.mul(grads, -lr, out=scaled) + weights.index_add_(0, ids, scaled); for apply_<opt> the
same update written with torch ops on dense weight and state tensors: unique ids (duplicates
summed with index_add_), index_select of their rows and state, the optimizer's arithmetic
(torch.sqrt, in-place ops), index_copy_ back -- with torch.set_num_threads equal to the
store's thread count. ratio = store / baseline (bytes/row: baseline / store). The baseline
runs in its best configuration found on this machine kind:
  * its table and weights are on transparent huge pages (madvise, as the store's own memory):
    with 4 KiB pages every random row costs a TLB miss (+30-45% lookup rate measured);
  * the gradient is scaled into a reused buffer: index_add_ with alpha= takes a generic path
    about 3x slower than index_add_ of a scaled tensor;
  * OpenMP threads wait passively: spinning waits (libgomp's default) help back-to-back ops
    only on idle cores; on shared, loaded cores they stall the 2-thread ops by orders of
    magnitude (measured 0.5 M keys/s), and passive waiting costs nothing at 1 thread.
The remaining per-call allocation (the ids tensor pruned_hashmap_lookup returns, 32 KiB) has
no out= variant.

Prints one JSON line per result; medians over repeats. --quick: fewer batches and repeats
(same table sizes), about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

# torch's OpenMP threads otherwise busy-wait after every baseline op and take the cores from
# the store's threads in the next (alternating) pass, and on shared cores stall the baseline's
# own 2-thread ops (module docstring); passive waiting applies to both sides.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

from torchrec_bagpipe.ps import EmbeddingStore, OptimizerSpec
from torchrec_bagpipe.ps.optimizer_spec import adam_step_size

BATCH = 4096
ZIPF_S = 1.05
LR = 0.01
STATEFUL = ("adagrad", "rowwise_adagrad", "adam")


def zipf_batches(num_keys: int, num_batches: int, seed: int) -> list[torch.Tensor]:
    """Batches of keys: Zipf(1.05) ranks over [0, num_keys), scattered by a permutation."""
    rng = np.random.default_rng(seed)
    weights = np.arange(1, num_keys + 1, dtype=np.float64) ** -ZIPF_S
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    del weights
    perm = rng.permutation(num_keys).astype(np.int64)
    u = rng.random(num_batches * BATCH)
    ranks = np.minimum(np.searchsorted(cdf, u, side="right"), num_keys - 1)
    keys = perm[ranks]
    return [torch.from_numpy(keys[i * BATCH : (i + 1) * BATCH].copy()) for i in range(num_batches)]


Pass = Callable[[list[torch.Tensor]], None]

_MADV_HUGEPAGE = 14


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """Asks for transparent huge pages under `t`'s (not yet touched) memory; returns `t`.
    Advisory: where the kernel has THP off the memory stays on 4 KiB pages."""
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    aligned = (start + 4095) & ~4095
    if end - aligned >= 1 << 21:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(aligned),
                                  ctypes.c_size_t((end - aligned) & ~4095), _MADV_HUGEPAGE)
    return t


def timed_group(fns: list[Pass], batches: list[torch.Tensor], repeats: int) -> list[float]:
    """Median seconds of a pass of each fn over `batches`, run in turn so that load changes
    on a shared machine hit every side alike. Each timed pass follows a short untimed warm-up
    of the same side (the other sides' passes evicted its caches): steady state."""
    warm = batches[: max(1, len(batches) // 8)]
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, acc in zip(fns, times):
            fn(warm)
            t0 = time.perf_counter()
            fn(batches)
            acc.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def timed_pair(
    fa: Pass, fb: Pass, batches: list[torch.Tensor], repeats: int
) -> tuple[float, float]:
    """timed_group of a store side and its baseline."""
    ta, tb = timed_group([fa, fb], batches, repeats)
    return ta, tb


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def filled_store(num_keys: int, dim: int, threads: int, optimizer: str) -> EmbeddingStore:
    """A store holding every key of [0, num_keys) (rows at their initial value)."""
    store = EmbeddingStore(
        dim=dim, num_threads=threads, init="uniform", init_bound=0.01, optimizer=optimizer
    )
    store.reserve(num_keys)
    all_keys = torch.arange(num_keys, dtype=torch.int64)
    chunk = 1 << 20
    for i in range(0, num_keys, chunk):
        k = all_keys[i : i + chunk]
        store.lookup(k, out=torch.empty((k.numel(), dim)))  # inserts every key
    return store


def torch_update(
    spec: OptimizerSpec, w: torch.Tensor, s: torch.Tensor, g: torch.Tensor, lr: float
) -> None:
    """The optimizer's update of gathered rows w and state s in place, as a torch user would
    write it (the baseline: speed, not bitwise equality)."""
    if spec.kind == "adagrad":
        s += g * g
        w -= lr * g / (s.sqrt() + spec.eps)
    elif spec.kind == "rowwise_adagrad":
        s += (g * g).mean(dim=1, keepdim=True)
        w -= g * (lr / (s.sqrt() + spec.eps))
    else:
        dim = w.shape[1]
        m, v = s[:, :dim], s[:, dim:]
        m.mul_(spec.beta1).add_(g, alpha=1 - spec.beta1)
        v.mul_(spec.beta2).addcmul_(g, g, value=1 - spec.beta2)
        w -= lr * m / (v.sqrt() + spec.eps)


def run_workload(
    num_keys: int, dim: int, threads_list: list[int], args: argparse.Namespace
) -> None:
    batches = zipf_batches(num_keys, args.batches, seed=dim)
    total = len(batches) * BATCH
    distinct = sum(int(torch.unique(b).numel()) for b in batches)
    out = torch.empty((BATCH, dim), dtype=torch.float32)
    grads = torch.randn((BATCH, dim), generator=torch.Generator().manual_seed(0))
    all_keys = torch.arange(num_keys, dtype=torch.int64)

    # Baseline table: fbgemm pruned hash map (int64, load 0.5) + a dense weight matrix, both
    # on huge pages (see the module docstring).
    cap = 2 * num_keys
    table = on_huge_pages(torch.empty((cap, 2), dtype=torch.int64)).fill_(-1)
    table_offsets = torch.tensor([0, cap], dtype=torch.int64)
    torch.ops.fbgemm.pruned_hashmap_insert(
        all_keys, all_keys, torch.tensor([0, num_keys], dtype=torch.int64), table, table_offsets
    )
    weights = on_huge_pages(torch.empty((num_keys, dim), dtype=torch.float32)).zero_()
    scaled = torch.empty_like(grads)
    bag = torch.tensor([0, BATCH], dtype=torch.int64)
    baseline_bytes = (table.numel() * 8 + weights.numel() * 4) / num_keys

    common = {"dim": dim, "keys": num_keys, "batch": BATCH, "zipf": ZIPF_S, "transport": "none"}

    def base_lookup(batches: list[torch.Tensor]) -> None:
        for b in batches:
            ids = torch.ops.fbgemm.pruned_hashmap_lookup(b, bag, table, table_offsets)
            torch.index_select(weights, 0, ids, out=out)

    def base_sgd(batches: list[torch.Tensor]) -> None:
        for b in batches:
            ids = torch.ops.fbgemm.pruned_hashmap_lookup(b, bag, table, table_offsets)
            torch.mul(grads, -LR, out=scaled)
            weights.index_add_(0, ids, scaled)

    def measure(
        metric: str,
        unit: str,
        ours_fn: Pass,
        base_fn: Pass,
        sgd_fn: Pass | None = None,
        **extra: object,
    ) -> float:
        if sgd_fn is None:
            t_store, t_base = timed_pair(ours_fn, base_fn, batches, args.repeats)
        else:  # the store's own SGD in the same rotation: a load-proof comparison
            t_store, t_base, t_sgd = timed_group([ours_fn, base_fn, sgd_fn], batches, args.repeats)
            extra["store_sgd"] = round(total / t_sgd / 1e6, 2)
            extra["vs_store_sgd"] = round(t_sgd / t_store, 3)
        ours, base = total / t_store / 1e6, total / t_base / 1e6
        emit(
            bench="ps_store",
            metric=metric,
            value=round(ours, 2),
            unit=unit,
            baseline=round(base, 2),
            ratio=round(ours / base, 3),
            threads=threads,
            **extra,
            **common,
        )
        return ours

    def bytes_per_row(metric: str, store: EmbeddingStore, base_row: float, **extra: object) -> None:
        st = store.stats()
        per_row = (st["bytes_resident"] + st["bytes_spilled"]) / st["rows"]
        emit(
            bench="ps_store",
            metric=metric,
            value=round(per_row, 2),
            unit="bytes",
            baseline=round(base_row, 2),
            ratio=round(base_row / per_row, 3),
            threads=threads,
            **extra,
            **common,
        )

    for threads in threads_list:
        torch.set_num_threads(threads)
        store = filled_store(num_keys, dim, threads, "sgd")

        def store_lookup(batches: list[torch.Tensor], store: EmbeddingStore = store) -> None:
            for b in batches:
                store.lookup(b, out=out)

        def store_sgd(batches: list[torch.Tensor], store: EmbeddingStore = store) -> None:
            for b in batches:
                store.apply_sgd(b, grads, LR)

        measure("lookup", "M keys/s", store_lookup, base_lookup)
        measure(
            "apply_sgd",
            "M rows/s",
            store_sgd,
            base_sgd,
            distinct_rows_per_batch=round(distinct / len(batches), 1),
        )
        bytes_per_row("bytes_per_row", store, baseline_bytes, target=dim * 4 + 32)

        # The stateful optimizers: one store each, the same batches and gradients, timed in
        # turn with the torch-ops baseline and the SGD store above.
        for kind in args.optimizers:
            spec = OptimizerSpec(kind)
            opt_store = filled_store(num_keys, dim, threads, kind)
            state = spec.initial_state(num_keys, dim)
            step = [0]

            def store_apply(
                batches: list[torch.Tensor],
                store: EmbeddingStore = opt_store,
                spec: OptimizerSpec = spec,
                step: list[int] = step,
            ) -> None:
                for b in batches:
                    step[0] += 1
                    lr = LR
                    if spec.kind == "adam":
                        lr = adam_step_size(LR, spec.beta1, spec.beta2, step[0])
                    store.apply_gradients(b, grads, lr)

            def base_apply(
                batches: list[torch.Tensor],
                spec: OptimizerSpec = spec,
                state: torch.Tensor = state,
            ) -> None:
                for b in batches:
                    ids = torch.ops.fbgemm.pruned_hashmap_lookup(b, bag, table, table_offsets)
                    uniq, inv = torch.unique(ids, return_inverse=True)
                    g = torch.zeros((uniq.numel(), dim)).index_add_(0, inv, grads)
                    w = weights.index_select(0, uniq)
                    s = state.index_select(0, uniq)
                    torch_update(spec, w, s, g, LR)
                    weights.index_copy_(0, uniq, w)
                    state.index_copy_(0, uniq, s)

            measure(
                f"apply_{kind}",
                "M rows/s",
                store_apply,
                base_apply,
                sgd_fn=store_sgd,
                optimizer=kind,
            )
            bytes_per_row(
                f"bytes_per_row_{kind}",
                opt_store,
                baseline_bytes + spec.state_dim(dim) * 4,
                optimizer=kind,
                state_bytes=spec.state_dim(dim) * 4,
            )
            del opt_store, store_apply, base_apply, state
            gc.collect()
        del store, store_lookup, store_sgd
        gc.collect()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches and repeats")
    parser.add_argument("--batches", type=int, default=None, help="batches per pass")
    parser.add_argument("--repeats", type=int, default=None, help="timed passes (median)")
    parser.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    parser.add_argument(
        "--optimizers",
        nargs="*",
        choices=STATEFUL,
        default=list(STATEFUL),
        help="stateful optimizers to measure (apply_<optimizer> lines)",
    )
    parser.add_argument(
        "--workload", choices=["all", "d32", "d128"], default="all", help="which table(s)"
    )
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply the key counts (0.01: cache-resident)"
    )
    args = parser.parse_args()
    if args.batches is None:
        args.batches = 64 if args.quick else 256
    if args.repeats is None:
        args.repeats = 3 if args.quick else 7
    if args.workload in ("all", "d32"):
        run_workload(int(10_000_000 * args.scale), 32, args.threads, args)
    if args.workload in ("all", "d128"):
        run_workload(int(2_000_000 * args.scale), 128, args.threads, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
