"""Scale by simulation (issue 24 item 3): the BagPipe runtime at W = 2 ... 128 ranks, in process.

For each trace (benchmarks/traces.py: zipf1.05, drifting, arrival) and world size W, W rank
threads run the real BagPipeController (torchrec_bagpipe/testing/simulate.py) over the same
kind of batches: every rank `batch` samples x `features` ids per step (one fused table of
`features` tables of rows / features rows each, pooling factor 1), an oracle cache of
`cache_pct` % of the rows per rank, lookahead L, in `ps` aggregation (gradients to the PS),
in `collective` aggregation (all-reduce of active rows, one rank submits each) and in
`writeback` aggregation (every cache holds the union's rows and owns them: only rows no cache
holds commit, evicted rows are written back; docs/writeback.md). Reported per
(trace, W, aggregation), from the controllers' counters, per rank per step (means over ranks
and the steps):
  * hit_rate (accesses read from the cache), served_from_cache (hits + prefetch-served);
  * ps_bytes: rows fetched from the PS + keys and gradients sent to it + evicted rows written
    back (writeback: keys, weights and optimizer state; the final flush, a one-off, is not a
    step's traffic);
  * allreduce_bytes: the fp32 payload this rank all-reduced (a ring moves 2 (W-1)/W of it
    out and as much in);
  * planner_ms (the controller's planner counter) and metadata_ms (thread CPU time inside
    the cache metadata's calls, measured by a wrapper around the native object).
Beside them, for the same batches, the bytes TorchRec's all-to-alls would move per rank per
step (`torchrec_bytes`, formulas in docs/scale_sim.md; D = dim, ids int64, values fp32):
  * table-wise (TW): table f lives on rank f mod W; every rank sends its ids of f (8 B each)
    to the owner, the owner returns each rank's pooled output (B x D x 4 B), the backward
    sends each rank's output gradient (B x D x 4 B) back: per table sum over ranks r != owner
    of 8 n(r, f) + 8 B D;
  * row-wise (RW): table f is split into W contiguous row blocks; every id goes to its block's
    rank (8 B if remote), the pooled partials of the whole global batch are reduce-scattered
    ((W - 1) B D x 4 B out of each rank per table) and the output gradients all-gathered (as
    much again): per rank sum over tables of 8 x remote ids + 8 (W - 1) B D.
  Per rank = the total over ranks / W, both directions counted (sent + received), as ps_bytes
  counts a trainer's link both ways.
One JSON line per result (COMMON.md); `baseline` is TorchRec RW's bytes for the bytes lines
(ratio = BagPipe / RW) and W = 2's value for the time lines. A last line per series gives the
fitted scaling exponent b of value ~ W^b. `--quick` finishes in under 2 minutes on a quiet
machine; `--plot PATH` draws the bytes per rank against W (matplotlib, skipped when missing).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from traces import make_trace  # benchmarks/traces.py

import torchrec_bagpipe.runtime.controller as controller_module
from torchrec_bagpipe.config import ROWS_PER_CACHE_UNIT, BagPipeConfig
from torchrec_bagpipe.testing.simulate import simulate

ID_BYTES = 8
VALUE_BYTES = 4
TIMED_CALLS = {"advance", "query", "admit", "lookup", "resident", "set_version", "pin",
               "note_uses", "invalidate"}


def emit(**kw: Any) -> None:
    kw.setdefault("bench", "scale_sim")
    kw.setdefault("transport", "in-process")
    print(json.dumps(kw), flush=True)


# ---- TorchRec's all-to-all bytes for the same batches ------------------------------------

def torchrec_bytes(ranks: list[np.ndarray], features: int, rows_per_feature: int, dim: int,
                   batch: int) -> dict[str, float]:
    """Bytes per rank of one step (sent + received, averaged over ranks) under TorchRec's
    table-wise and row-wise sharding (module docstring), from the ranks' fused ids."""
    W = len(ranks)
    pooled = batch * dim * VALUE_BYTES  # one rank's pooled outputs (or their grads) per table
    tw = rw = 0.0
    for r, ids in enumerate(ranks):
        feat = ids // rows_per_feature
        local = ids - feat * rows_per_feature
        n_f = np.bincount(feat, minlength=features)
        owner_tw = np.arange(features) % W
        remote_tw = owner_tw != r
        tw += ID_BYTES * float(n_f[remote_tw].sum()) + 2 * pooled * int(remote_tw.sum())
        owner_rw = (local * W) // rows_per_feature
        rw += ID_BYTES * float((owner_rw != r).sum()) + features * 2 * (W - 1) * pooled
    # Totals sent over all ranks; each byte sent is received once: per rank both ways.
    return {"tw": 2 * tw / W, "rw": 2 * rw / W}


# ---- timing the cache metadata -------------------------------------------------------------

class _TimedMetadata:
    """Forwards to a native BagPipeCacheMetadata, adding each batch call's thread CPU time."""

    def __init__(self, inner: Any, clock: list[float], lock: threading.Lock) -> None:
        self._inner, self._clock, self._lock = inner, clock, lock

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in TIMED_CALLS:
            return attr

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.thread_time()
            try:
                return attr(*a, **k)
            finally:
                dt = time.thread_time() - t0
                with self._lock:
                    self._clock[0] += dt
        return timed


class _TimedC:
    """controller_module.C for one run: BagPipeCacheMetadata objects come wrapped."""

    def __init__(self, real: Any, clock: list[float]) -> None:
        self._real, self._clock, self._lock = real, clock, threading.Lock()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        if name != "BagPipeCacheMetadata":
            return attr
        return lambda *a, **k: _TimedMetadata(attr(*a, **k), self._clock, self._lock)


# ---- one run -------------------------------------------------------------------------------

def run_one(trace: list[list[np.ndarray]], args: argparse.Namespace, aggregation: str,
            ) -> dict[str, float]:
    """Simulates `trace`; per-rank-per-step means of the counters (module docstring)."""
    W, steps = len(trace[0]), len(trace)
    units = max(1, math.ceil(args.rows * args.cache_pct / 100 / ROWS_PER_CACHE_UNIT))
    cfg = BagPipeConfig(optimization_cache_capacity=units, eviction_policy="oracle",
                        lookahead=args.lookahead, prepared_batches=2, gradient_division=True,
                        bagpipe_aggregation=aggregation)
    clock = [0.0]
    real_c = controller_module.C
    controller_module.C = _TimedC(real_c, clock)
    try:
        t0 = time.perf_counter()
        res = simulate(cfg, trace, num_keys=args.rows, dim=args.dim, lr=0.01,
                       timeout=args.timeout)
        wall = time.perf_counter() - t0
    finally:
        controller_module.C = real_c
    m = res.metrics
    acc = sum(x["accesses"] for x in m)
    per = float(W * steps)
    return {
        "hit_rate": sum(x["hits"] for x in m) / acc,
        "served_from_cache": sum(x["hits"] + x["prefetch_served"] for x in m) / acc,
        "ps_bytes": sum(x["fetched_bytes"] + x["gradient_payload_bytes"]
                        + x["write_back_bytes"] for x in m) / per,
        "write_back_bytes": sum(x["write_back_bytes"] for x in m) / per,
        "fetched_bytes": sum(x["fetched_bytes"] for x in m) / per,
        "gradient_bytes": sum(x["gradient_payload_bytes"] for x in m) / per,
        "allreduce_bytes": sum(x["allreduce_payload_bytes"] for x in m) / per,
        "id_exchange_bytes": sum(x["id_exchange_bytes"] for x in m) / per,
        "accesses": acc / per,
        "planner_ms": 1e3 * sum(x["planner_s"] for x in m) / per,
        "metadata_ms": 1e3 * clock[0] / per,
        "wall_s": wall,
    }


def fit_exponent(ws: list[int], values: list[float]) -> float:
    """b of value ~ a * W^b (least squares in log-log); nan with < 2 positive points."""
    pts = [(math.log(w), math.log(v)) for w, v in zip(ws, values) if v > 0]
    if len(pts) < 2:
        return float("nan")
    x, y = np.array(pts).T
    return float(np.polyfit(x, y, 1)[0])


def plot(results: dict[tuple[str, str], dict[int, dict[str, float]]], path: str) -> str:
    """Bytes per rank per step against W; returns a note (written, or why not)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no plot"
    traces = sorted({t for t, _ in results})
    fig, axes = plt.subplots(1, len(traces), figsize=(5 * len(traces), 4), squeeze=False)
    for ax, tr in zip(axes[0], traces):
        for (t, agg), by_w in sorted(results.items()):
            if t != tr:
                continue
            ws = sorted(by_w)
            ax.plot(ws, [by_w[w]["ps_bytes"] for w in ws], "o-", label=f"BagPipe {agg}: PS")
            if agg in ("collective", "writeback"):
                ax.plot(ws, [by_w[w]["allreduce_bytes"] for w in ws], "s--",
                        label=f"BagPipe {agg}: all-reduce payload")
        ref = next(v for (t, _), v in results.items() if t == tr)
        ws = sorted(ref)
        ax.plot(ws, [ref[w]["torchrec_tw"] for w in ws], "k^:", label="TorchRec TW")
        ax.plot(ws, [ref[w]["torchrec_rw"] for w in ws], "kv-.", label="TorchRec RW")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks W")
        ax.set_ylabel("bytes per rank per step")
        ax.set_title(tr)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot written to {path}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a small run (< 2 min on a quiet machine)")
    p.add_argument("--worlds", default="2,8,32,128", help="comma-separated world sizes")
    p.add_argument("--traces", default="zipf1.05,drifting,arrival")
    p.add_argument("--aggregations", default="ps,collective,writeback")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch", type=int, default=None, help="samples per rank per step")
    p.add_argument("--features", type=int, default=8)
    p.add_argument("--rows", type=int, default=None)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--cache-pct", type=float, default=5.0)
    p.add_argument("--lookahead", type=int, default=4)
    p.add_argument("--horizon", type=int, default=200,
                   help="drifting / arrival: steps over which the hot set crosses the table")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--plot", default=None, help="write a PNG of bytes per rank vs W here")
    args = p.parse_args(argv)
    quick = dict(steps=6, batch=16, rows=16_384)
    full = dict(steps=24, batch=64, rows=131_072)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    worlds = [int(w) for w in args.worlds.split(",")]
    results: dict[tuple[str, str], dict[int, dict[str, float]]] = {}
    per_feature = args.rows // args.features
    for kind in args.traces.split(","):
        for W in worlds:
            trace = make_trace(kind, args.rows, args.steps, args.batch, seed=7, world=W,
                               features=args.features, horizon=args.horizon)
            tw = np.mean([torchrec_bytes(s, args.features, per_feature, args.dim,
                                         args.batch)["tw"] for s in trace])
            rw = np.mean([torchrec_bytes(s, args.features, per_feature, args.dim,
                                         args.batch)["rw"] for s in trace])
            for agg in args.aggregations.split(","):
                r = run_one(trace, args, agg) | {"torchrec_tw": float(tw),
                                                 "torchrec_rw": float(rw)}
                results.setdefault((kind, agg), {})[W] = r
                common = dict(trace=kind, world_size=W, aggregation=agg, steps=args.steps,
                              batch=args.batch, features=args.features, rows=args.rows,
                              dim=args.dim, cache_pct=args.cache_pct,
                              lookahead=args.lookahead, horizon=args.horizon, threads=W)
                for metric in ("hit_rate", "served_from_cache"):
                    emit(**common, metric=metric, value=r[metric], unit="fraction",
                         baseline=None, ratio=None)
                for metric in ("ps_bytes", "allreduce_bytes", "id_exchange_bytes"):
                    emit(**common, metric=f"{metric}_per_rank_step", value=r[metric],
                         unit="bytes", baseline=r["torchrec_rw"], baseline_config="torchrec_rw",
                         ratio=r[metric] / r["torchrec_rw"], torchrec_tw=r["torchrec_tw"],
                         torchrec_rw=r["torchrec_rw"], fetched_bytes=r["fetched_bytes"],
                         gradient_bytes=r["gradient_bytes"], accesses=r["accesses"],
                         write_back_bytes=r["write_back_bytes"])
                base = results[(kind, agg)].get(worlds[0], r)
                for metric in ("planner_ms", "metadata_ms"):
                    emit(**common, metric=f"{metric}_per_step", value=r[metric], unit="ms",
                         baseline=base[metric], baseline_config=f"world_size={worlds[0]}",
                         ratio=r[metric] / base[metric] if base[metric] else None,
                         wall_s=r["wall_s"])
    for (kind, agg), by_w in results.items():
        ws = sorted(by_w)
        for metric in ("ps_bytes", "allreduce_bytes", "torchrec_tw", "torchrec_rw",
                       "hit_rate", "metadata_ms"):
            emit(trace=kind, aggregation=agg, metric=f"scaling_exponent_{metric}",
                 value=fit_exponent(ws, [by_w[w][metric] for w in ws]), unit="exponent",
                 baseline=None, ratio=None, worlds=ws,
                 note="value ~ W^exponent, least squares in log-log", threads=max(ws))
    if args.plot:
        print(plot(results, args.plot), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
