"""Cache policy benchmark: BagPipe's oracle (lookahead) vs LRU vs Belady's MIN, and planner speed.

Part 1 (hit rate). One rank trains over power-law traces (Zipf 0.8, 1.05, 1.2 with the hot ids
scattered over the key space) and one time-ordered trace (the hot set drifts through the key
space), through the real BagPipeController against the in-process exact PS, with cache
capacities of 0.5, 1, 5 and 10% of the rows:
  * lru:    eviction "lru", lookahead 0 (the classic cache; every miss is a PS fetch);
  * oracle: eviction "oracle", lookahead L (prefetch + furthest-next-use eviction);
  * min:    Belady's MIN with bypass, computed here offline from the whole trace (the optimum
            for a demand-fetched cache of the same capacity).
Reported per (trace, capacity): hit rate (accesses served from the cache without any fetch
for that step) and PS rows fetched per step (demand + prefetched); per lookahead L the gap to
MIN (`gap_to_min`, baseline MIN in the same run) with the window each step needs (the
reuse horizon, `reuse_horizons`: docs/adaptive_lookahead.md), and the best fixed L's gap
(`best_fixed_gap_to_min`). Then the adaptive window (`lookahead_max`, `--lookahead-max`,
default 64) from each L below it: `adaptive_gap_to_min` (value = MIN - adaptive, baseline =
the best fixed L's hit rate, ratio = adaptive / best fixed) with the mean window it ran at.
`--lookaheads`, `--traces`, `--pcts` choose the grid.

Part 2 (planner). The native step planner over a global batch of 16,384 samples x 26 features
(W = 8 ranks), Zipf 1.05 over 10M rows: ids/s and ms per global batch, against a vectorized
numpy planner computing the same facts (baseline, in its best form: one scatter per step
patches the earlier plans' next uses) in the same run; plus the controller's per-step
overhead.

Part 3 (metadata). The cache metadata's per-step calls at accelerator scale: every step is
180K IDs (7K samples x 26 features, one rank of an 8-GPU DLRM-DCNv2 step of ~3.9 ms) of Zipf
1.05 ranks over 10M rows (2M with --quick), one rank planned by the native StepPlanner
(lookahead 8), an oracle cache of 5% of the rows with key_bound = the rows, as the controller
builds it (a direct key index at this size; the `index` field says which). Each step replays
the controller's calls (runtime/controller.py, prefetch.py, step_assembly.py,
ps_aggregation.py): advance; note_uses of
the step entering the window; query(unique keys, deps, next uses inside the entered window);
admit of the misses in soonest-next-use order (the same int16 stable argsort); lookup +
set_version of the step's resident rows. Reported, medians over the timed steps of each
repeat, then the median over repeats: query + admit IDs/s (unique keys per second: the keys
the calls process) and ms per 180K-ID step, the raw IDs/s of that step, this thread's CPU
time (the machine may be shared), and the other calls' and the numpy glue's ms. There is no
second implementation to race in-run here: `baseline` is the requirement (45 M IDs/s, i.e.
a 180K-ID step's metadata in 3.9 ms), `ratio` = value / requirement. The StepPlanner's IDs/s
on the same steps (one rank) is the line after.

Every result is one JSON line. `--quick` finishes in well under a minute.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from traces import SCATTER, make_trace, zipf_ranks  # benchmarks/traces.py

from torchrec_bagpipe._native import C
from torchrec_bagpipe.config import ROWS_PER_CACHE_UNIT, BagPipeConfig
from torchrec_bagpipe.testing.simulate import simulate


def emit(**kw) -> None:
    kw.setdefault("threads", 1)
    kw.setdefault("transport", "in-process")
    print(json.dumps(kw), flush=True)


def belady_min(trace: list[list[np.ndarray]], capacity: int,
               keep_sets: bool = False) -> tuple[int, int] | tuple[int, int, list[np.ndarray]]:
    """Hits and accesses of Belady's MIN with bypass over per-step unique keys (one rank);
    with `keep_sets`, also the rows resident after each step."""
    steps = [np.unique(per[0]) for per in trace]
    never = np.iinfo(np.int64).max
    nxt: list[np.ndarray] = [None] * len(steps)  # type: ignore[list-item]
    last: dict[int, int] = {}
    for t in range(len(steps) - 1, -1, -1):
        keys = steps[t]
        nxt[t] = np.array([last.get(int(k), never) for k in keys], dtype=np.int64)
        for k in keys.tolist():
            last[k] = t
    res_k = np.zeros(0, dtype=np.int64)
    res_n = np.zeros(0, dtype=np.int64)
    hits = accesses = 0
    kept: list[np.ndarray] = []
    for t, keys in enumerate(steps):
        accesses += keys.size
        hits += int(np.isin(keys, res_k, assume_unique=True).sum())
        allk = np.concatenate([keys, res_k])  # this step's next uses first: they are current
        alln = np.concatenate([nxt[t], res_n])
        uk, first = np.unique(allk, return_index=True)
        un = alln[first]
        keep = un != never
        uk, un = uk[keep], un[keep]
        if uk.size > capacity:
            sel = np.argpartition(un, capacity - 1)[:capacity]
            uk, un = uk[sel], un[sel]
        res_k, res_n = uk, un
        if keep_sets:
            kept.append(np.sort(uk))
    if keep_sets:
        return hits, accesses, kept
    return hits, accesses


def reuse_horizons(trace: list[list[np.ndarray]], capacity: int, hi: int) -> np.ndarray:
    """Per step t, the window an oracle needs at t (one rank): the smallest w <= hi such that
    `capacity` of the rows it may keep after t (MIN's resident rows after step t, which include
    step t's kept keys) are read again within steps t+1..t+w, i.e. the capacity-th soonest
    reuse among the candidates. A row whose next use lies beyond that horizon is one MIN
    evicts or bypasses anyway; a window shorter than it leaves kept rows without a known next
    use (ranked as "never", evicted in arbitrary order). `hi` where the trace runs out first.
    The measure of docs/adaptive_lookahead.md (the planner's own rule reads its cache)."""
    _, _, kept = belady_min(trace, capacity, keep_sets=True)
    steps = [np.unique(per[0]) for per in trace]
    out = np.empty(len(steps), dtype=np.int64)
    for t in range(len(steps)):
        cand = kept[t]
        have = np.zeros(0, dtype=np.int64)
        w = 0
        while w < hi and t + w + 1 < len(steps) and have.size < min(capacity, cand.size):
            w += 1
            have = np.union1d(have, np.intersect1d(cand, steps[t + w], assume_unique=True))
        out[t] = w
    return out


def run_policy(trace, rows: int, capacity_rows: int, policy: str, lookahead: int, dim: int,
               lookahead_max: int = 0):
    cfg = BagPipeConfig(
        optimization_cache_capacity=max(1, capacity_rows // ROWS_PER_CACHE_UNIT),
        eviction_policy=policy,
        lookahead=lookahead,
        lookahead_max=lookahead_max,
        gradient_division=True,
        prepared_batches=2,
    )
    t0 = time.perf_counter()
    res = simulate(cfg, trace, num_keys=rows, dim=dim, lr=0.01)
    wall = time.perf_counter() - t0
    m = res.metrics[0]
    return m, wall


def part_hit_rate(args) -> None:
    kinds, pcts = args.traces, args.pcts
    for kind in kinds:
        trace = make_trace(kind, args.rows, args.steps, args.batch, seed=1)
        for pct in pcts:
            cap = max(ROWS_PER_CACHE_UNIT,
                      math.ceil(args.rows * pct / 100 / ROWS_PER_CACHE_UNIT)
                      * ROWS_PER_CACHE_UNIT)
            common = dict(bench="cache_policy", trace=kind, capacity_pct=pct,
                          capacity_rows=cap, rows=args.rows, batch=args.batch,
                          steps=args.steps, dim=args.dim)
            mh, acc = belady_min(trace, cap)
            min_rate = mh / acc
            lru, _ = run_policy(trace, args.rows, cap, "lru", 0, args.dim)
            lru_rate = lru["hits"] / lru["accesses"]
            lru_fetch = (lru["demand_fetched"] + lru["prefetched"]) / args.steps
            emit(**common, metric="hit_rate", policy="lru", lookahead=0, value=lru_rate,
                 unit="fraction", baseline=min_rate, ratio=lru_rate / min_rate if min_rate else 0)
            emit(**common, metric="ps_rows_per_step", policy="lru", lookahead=0, value=lru_fetch,
                 unit="rows", baseline=(acc - mh) / args.steps,
                 ratio=lru_fetch / max((acc - mh) / args.steps, 1e-9))
            emit(**common, metric="hit_rate", policy="min", lookahead=args.steps, value=min_rate,
                 unit="fraction", baseline=lru_rate, ratio=min_rate / lru_rate if lru_rate else 0)
            fixed: dict[int, float] = {}
            need = reuse_horizons(trace, cap, max(args.lookaheads))
            for look in args.lookaheads:
                orc, wall = run_policy(trace, args.rows, cap, "oracle", look, args.dim)
                rate = orc["hits"] / orc["accesses"]
                fixed[look] = rate
                emit(**common, metric="gap_to_min", policy="oracle", lookahead=look,
                     value=min_rate - rate, unit="fraction", baseline=min_rate,
                     ratio=rate / min_rate if min_rate else 0.0,
                     needed_window_median=float(np.median(need)),
                     needed_window_p90=float(np.percentile(need, 90)),
                     steps_window_short=float(np.mean(need > look)))
                fetch = (orc["demand_fetched"] + orc["prefetched"]) / args.steps
                emit(**common, metric="hit_rate", policy="oracle", lookahead=look, value=rate,
                     unit="fraction", baseline=lru_rate,
                     ratio=rate / lru_rate if lru_rate else float("inf"),
                     min_hit_rate=min_rate, gap_to_min=min_rate - rate,
                     prefetch_served=orc["prefetch_served"] / orc["accesses"])
                emit(**common, metric="ps_rows_per_step", policy="oracle", lookahead=look,
                     value=fetch, unit="rows", baseline=lru_fetch,
                     ratio=fetch / lru_fetch if lru_fetch else 0.0,
                     demand_rows_per_step=orc["demand_fetched"] / args.steps)
                emit(**common, metric="controller_step_ms", policy="oracle", lookahead=look,
                     value=wall / args.steps * 1e3, unit="ms", baseline=None, ratio=None)
            best = max(fixed, key=lambda k: fixed[k])
            emit(**common, metric="best_fixed_gap_to_min", policy="oracle", lookahead=best,
                 value=min_rate - fixed[best], unit="fraction", baseline=min_rate,
                 ratio=fixed[best] / min_rate if min_rate else 0.0)
            for look in args.lookaheads:
                if look >= args.lookahead_max:
                    continue
                ada, _ = run_policy(trace, args.rows, cap, "oracle", look, args.dim,
                                    lookahead_max=args.lookahead_max)
                rate = ada["hits"] / ada["accesses"]
                # baseline: the best fixed window's hit rate in this run.
                emit(**common, metric="adaptive_gap_to_min", policy="oracle_adaptive",
                     lookahead=look, lookahead_max=args.lookahead_max, value=min_rate - rate,
                     unit="fraction", baseline=fixed[best],
                     ratio=rate / fixed[best] if fixed[best] else 0.0, min_hit_rate=min_rate,
                     best_fixed_lookahead=best, window_mean=ada["window_mean"],
                     fixed_window_mean=float(look),
                     ps_rows_per_step=(ada["demand_fetched"] + ada["prefetched"]) / args.steps)


class NumpyPlanner:
    """A vectorized numpy planner computing the same per-step facts (the baseline).

    Its best form: per key the step and the unique index of this rank's last read, so the
    next-use patch of earlier plans is one scatter into a flat array of every retained
    plan's next uses (no pass over the lookahead window)."""

    def __init__(self, world: int, rank: int, lookahead: int, num_keys: int) -> None:
        self.world, self.rank, self.look = world, rank, lookahead
        self.last = np.full(num_keys, -1, dtype=np.int32)      # last step touching a key
        self.own_last = np.full(num_keys, -1, dtype=np.int32)  # rank's last read ...
        self.own_pos = np.zeros(num_keys, dtype=np.int64)      # ... its flat next-use index
        self.next_flat = np.zeros(0, dtype=np.int64)           # every plan's next uses
        self.plans: list[dict] = []

    def add_step(self, per_rank: list[np.ndarray]) -> None:
        s = len(self.plans)
        own = per_rank[self.rank]
        uniq, inverse = np.unique(own, return_inverse=True)
        ranks_u = [np.unique(k) for k in per_rank]
        allk = np.concatenate(ranks_u)
        union, counts = np.unique(allk, return_counts=True)
        mine = np.isin(union, uniq, assume_unique=True)
        others = union[counts > mine.astype(np.int64)]
        dep = self.last[uniq].astype(np.int64)
        shared = np.isin(uniq, others, assume_unique=True)
        prev = self.own_last[uniq].astype(np.int64)
        base = self.next_flat.size
        self.next_flat = np.concatenate([self.next_flat, np.full(uniq.size, -1, np.int64)])
        patch = (prev >= 0) & (s - prev <= self.look)
        self.next_flat[self.own_pos[uniq[patch]]] = s
        self.last[union] = s
        self.own_last[uniq] = s
        self.own_pos[uniq] = np.arange(base, base + uniq.size)
        self.plans.append(dict(unique=uniq, inverse=inverse, dep=dep, shared=shared,
                               others=others, next_use=(base, uniq.size)))


def part_planner(args) -> None:
    world = 8
    per_rank = args.samples * 26 // world
    rng = np.random.default_rng(7)
    steps = [[(zipf_ranks(rng, per_rank, args.planner_rows, 1.05) * SCATTER)
              % args.planner_rows for _ in range(world)] for _ in range(args.planner_steps)]
    flat = []
    for per in steps:
        off = np.zeros(world + 1, dtype=np.int64)
        np.cumsum([x.size for x in per], out=off[1:])
        flat.append((np.concatenate(per), off))
    ids = per_rank * world
    common = dict(bench="cache_policy", dim=0, samples=args.samples, features=26,
                  world_size=world, ids_per_step=ids, rows=args.planner_rows)
    native_wall, native_cpu, base_wall = [], [], []
    for _ in range(args.repeats):
        planner = C.StepPlanner(world, 0, 200, args.planner_rows, False)
        for keys, off in flat:
            w0, c0 = time.perf_counter(), time.thread_time()
            planner.add_step(keys, off)
            native_wall.append(time.perf_counter() - w0)
            native_cpu.append(time.thread_time() - c0)
        base = NumpyPlanner(world, 0, 200, args.planner_rows)
        for per in steps:
            w0 = time.perf_counter()
            base.add_step(per)
            base_wall.append(time.perf_counter() - w0)
    med = float(np.median(native_wall))
    med_cpu = float(np.median(native_cpu))
    bmed = float(np.median(base_wall))
    emit(**common, metric="planner_ids_per_s", value=ids / med, unit="ids/s",
         baseline=ids / bmed, ratio=bmed / med, cpu_ids_per_s=ids / med_cpu)
    emit(**common, metric="planner_ms_per_global_batch", value=med * 1e3, unit="ms",
         baseline=bmed * 1e3, ratio=med / bmed, cpu_ms=med_cpu * 1e3, target_ms=21.0)


def part_overhead(args) -> None:
    """Controller per-step time with an in-process PS: oracle cache vs no cache (read_mode ps)."""
    rows = args.rows
    trace = make_trace("zipf1.05", rows, args.overhead_steps, args.overhead_batch, seed=3)
    cap = max(1, rows // 100 // ROWS_PER_CACHE_UNIT)
    results = {}
    oracle = BagPipeConfig(optimization_cache_capacity=cap, lookahead=8, gradient_division=True)
    for name, cfg in (
        ("no_cache", BagPipeConfig(read_mode="ps", gradient_division=True)),
        ("oracle", oracle),
    ):
        walls = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            simulate(cfg, trace, num_keys=rows, dim=args.dim, lr=0.01)
            walls.append((time.perf_counter() - t0) / args.overhead_steps)
        results[name] = float(np.median(walls))
    emit(bench="cache_policy", metric="controller_step_ms", policy="oracle",
         lookahead=oracle.lookahead,
         value=results["oracle"] * 1e3, unit="ms", baseline=results["no_cache"] * 1e3,
         ratio=results["oracle"] / results["no_cache"], dim=args.dim,
         ids_per_step=args.overhead_batch, rows=rows)


METADATA_TARGET_IDS_PER_S = 45e6  # issue 14: a 180K-ID step's query + admit in <= 4 ms


def part_metadata(args) -> None:
    """Query + admit at accelerator scale, in the controller's call pattern (docstring)."""
    ids, look, world = 180_000, 8, 1
    rows = args.metadata_rows
    rng = np.random.default_rng(11)
    steps = [(zipf_ranks(rng, ids, rows, 1.05) * SCATTER) % rows
             for _ in range(args.metadata_steps)]
    off = np.array([0, ids], dtype=np.int64)
    plan_wall = []
    planner = C.StepPlanner(world, 0, look, rows, False)
    for keys in steps:
        t0 = time.perf_counter()
        planner.add_step(keys, off)
        plan_wall.append(time.perf_counter() - t0)
    plans = [planner.plan(t) for t in range(len(steps))]
    units = max(1, rows // 20 // ROWS_PER_CACHE_UNIT)  # 5% of the rows
    per_repeat = []
    for _ in range(args.repeats):
        meta = C.BagPipeCacheMetadata(units, "oracle", key_bound=rows)  # as the controller
        rec: dict[str, list[float]] = {k: [] for k in (
            "qa_wall", "qa_cpu", "query", "admit", "other", "glue", "unique", "hits")}
        entered = -1
        for t, p in enumerate(plans):
            w0 = time.perf_counter()
            meta.advance(t)
            upto = min(t + look, len(plans) - 1)
            for s in range(entered + 1, upto + 1):
                entered = s
                if s <= t:
                    continue
                ps = plans[s]
                noted = (ps["prev_use"] >= 0) & (ps["prev_use"] < t)
                if noted.any():
                    meta.note_uses(ps["unique"][noted], s)
            U, deps, next_use = p["unique"], p["dep"], p["next_use"]
            if entered < t + look:
                next_use = np.where(next_use <= entered, next_use, -1)
            w1 = time.perf_counter()
            c1 = time.thread_time()
            hit_pos, _, miss_pos, _ = meta.query(U, deps, next_use)
            w2 = time.perf_counter()
            c2 = time.thread_time()
            miss_nu = next_use[miss_pos]
            rank = np.where(miss_nu < 0, look + 1, miss_nu - t).astype(np.int16)
            order = np.argsort(rank, kind="stable")
            mp = miss_pos[order]
            mk, md, mn = U[mp], deps[mp], miss_nu[order]
            w3 = time.perf_counter()
            c3 = time.thread_time()
            meta.admit(mk, md, mn)
            w4 = time.perf_counter()
            c4 = time.thread_time()
            slots = meta.lookup(U)
            slots = slots[slots >= 0]
            if slots.size:
                meta.set_version(slots, t)
            w5 = time.perf_counter()
            if t < args.metadata_warmup:
                continue
            rec["qa_wall"].append((w2 - w1) + (w4 - w3))
            rec["qa_cpu"].append((c2 - c1) + (c4 - c3))
            rec["query"].append(w2 - w1)
            rec["admit"].append(w4 - w3)
            rec["other"].append((w1 - w0) + (w5 - w4))
            rec["glue"].append(w3 - w2)
            rec["unique"].append(U.size)
            rec["hits"].append(hit_pos.size)
        per_repeat.append({k: float(np.median(v)) for k, v in rec.items()}
                          | {"hit_rate": sum(rec["hits"]) / sum(rec["unique"])})
    m = {k: float(np.median([r[k] for r in per_repeat])) for k in per_repeat[0]}
    value = m["unique"] / m["qa_wall"]
    common = dict(bench="cache_policy", dim=0, rows=rows, ids_per_step=ids, lookahead=look,
                  capacity_rows=units * ROWS_PER_CACHE_UNIT, policy="oracle",
                  unique_per_step=m["unique"], hit_rate=m["hit_rate"], repeats=args.repeats,
                  steps=len(plans) - args.metadata_warmup,
                  index="direct" if meta.direct_index else "hash")
    emit(**common, metric="metadata_query_admit_ids_per_s", value=value, unit="ids/s",
         baseline=METADATA_TARGET_IDS_PER_S, ratio=value / METADATA_TARGET_IDS_PER_S,
         baseline_kind="requirement", cpu_ids_per_s=m["unique"] / m["qa_cpu"],
         raw_ids_per_s=ids / m["qa_wall"], query_ms=m["query"] * 1e3,
         admit_ms=m["admit"] * 1e3)
    emit(**common, metric="metadata_ms_per_180k_id_step", value=m["qa_wall"] * 1e3, unit="ms",
         baseline=ids / METADATA_TARGET_IDS_PER_S * 1e3,
         ratio=m["qa_wall"] / (ids / METADATA_TARGET_IDS_PER_S), baseline_kind="requirement",
         cpu_ms=m["qa_cpu"] * 1e3, other_calls_ms=m["other"] * 1e3, glue_ms=m["glue"] * 1e3,
         all_calls_ms=(m["qa_wall"] + m["other"]) * 1e3)
    pmed = float(np.median(plan_wall))
    emit(**common, metric="metadata_planner_ids_per_s", value=ids / pmed, unit="ids/s",
         baseline=METADATA_TARGET_IDS_PER_S, ratio=ids / pmed / METADATA_TARGET_IDS_PER_S,
         baseline_kind="requirement", planner_ms_per_step=pmed * 1e3, world_size=world)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="CI-sized run (well under a minute)")
    p.add_argument("--part", choices=["all", "hit_rate", "planner", "overhead", "metadata"],
                   default="all")
    p.add_argument("--lookaheads", type=int, nargs="+", default=None,
                   help="oracle lookaheads of the hit-rate part (default: by mode)")
    p.add_argument("--lookahead-max", type=int, default=64,
                   help="the adaptive window's bound (BagPipeConfig.lookahead_max) of the "
                        "hit-rate part's adaptive runs, one per lookahead below it")
    p.add_argument("--traces", nargs="+", default=None, help="hit-rate traces (default: all)")
    p.add_argument("--pcts", type=float, nargs="+", default=None,
                   help="hit-rate cache sizes in %% of the rows (default: 0.5 1 5 10)")
    args = p.parse_args(argv)
    chosen_looks, chosen_traces, chosen_pcts = args.lookaheads, args.traces, args.pcts
    if args.quick:
        args.rows, args.steps, args.batch, args.lookaheads = 20_000, 40, 1024, [4, 32]
        args.samples, args.planner_rows, args.planner_steps = 16384, 2_000_000, 6
        args.overhead_steps, args.overhead_batch, args.repeats = 20, 2048, 2
        args.metadata_rows, args.metadata_steps, args.metadata_warmup = 2_000_000, 14, 6
    else:
        args.rows, args.steps, args.batch, args.lookaheads = 100_000, 150, 4096, [4, 16, 64]
        args.samples, args.planner_rows, args.planner_steps = 16384, 10_000_000, 12
        args.overhead_steps, args.overhead_batch, args.repeats = 50, 8192, 3
        args.metadata_rows, args.metadata_steps, args.metadata_warmup = 10_000_000, 40, 20
    args.dim = 4
    if chosen_looks:
        args.lookaheads = chosen_looks
    args.traces = chosen_traces or ["zipf0.8", "zipf1.05", "zipf1.2", "time_ordered"]
    args.pcts = chosen_pcts or [0.5, 1.0, 5.0, 10.0]
    if args.part in ("all", "planner"):
        part_planner(args)
    if args.part in ("all", "overhead"):
        part_overhead(args)
    if args.part in ("all", "metadata"):
        part_metadata(args)
    if args.part in ("all", "hit_rate"):
        part_hit_rate(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
