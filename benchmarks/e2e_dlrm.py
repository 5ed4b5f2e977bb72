#!/usr/bin/env python3
"""End-to-end DLRM on power-law data: stock TorchRec vs the BagPipe PS, on this machine.

Configurations (same model, data and cache capacity; world size 2, gloo, CPU):

* ``stock``: TorchRec's own sharders, tables local to the trainers (the upper bound);
* ``ps_nocache``: BagPipe with ``--read-mode ps``: every row fetched from the PS every step;
* ``lru``: a bounded LRU cache without lookahead (``--eviction-policy lru --lookahead 0``);
* ``bagpipe_prescan`` / ``bagpipe_online``: the oracle cache with lookahead prefetch;
* ``bagpipe_collective``: ``bagpipe_online`` with collective aggregation (ranks all-reduce
  the active rows' gradients, one designated rank commits each row to the PS);
* ``bagpipe_mixed``: per-table placement, ``bagpipe_online`` for the 3 largest tables only
  (``--placement-min-rows``), the other 23 on TorchRec's stock sharding in the same
  EmbeddingBagCollection.

Tables (``--table-sizes``): ``criteo`` (default) has Criteo 1TB's 26 categorical
cardinalities scaled so the largest has ``--num-embeddings`` rows (skewed sizes, as real
models have: the 3 largest hold 78 % of the rows); ``uniform`` gives every table
``--num-embeddings`` rows. Every configuration but ``bagpipe_mixed`` puts all 26 tables on
BagPipe (``--placement-min-rows 0``); the cache is ``--cache-fraction`` of the BagPipe
tables' rows.

Each configuration runs `examples/dlrm/dlrm_main.py` in its own 2-rank process group. For
each it prints one JSON line per metric: samples/s (measured), cache hit rate, PS rows and
bytes per step, the runtime's time per step on the training thread (``runtime_critical_ms``,
against the stock step) and on its workers (``runtime_worker_ms``), and the modelled step
time and samples/s under a link model for each preset (25 GbE TCP, 100 Gb RDMA):
``step = compute + exposed network time``, where compute is the stock configuration's
measured median step time and the network time comes from the run's deterministic counters
(see `model_step`), all-reduce and ID-exchange traffic
included. ``--compute-ms`` adds the same predictions for assumed step times (e.g. an
accelerator-class DLRM step), tagged ``compute_source: "assumed"``. Baselines are measured
in the same run. A PNG plots samples/s and hit rate per configuration.

``--shaped-link``: a real network instead of (and checking) the model. The PS shards run as
separate server processes over TCP (`dlrm_ranks.PSServers`, one per rank, each on its own
port) and `link_shaping.ShapedLink` shapes their traffic on loopback with ``tc`` (prio, or
htb where the kernel has no prio, + u32 port filters + one tbf per shard and direction: a
full-duplex link per shard; with as many shards as ranks each rank's traffic gets one link's
bandwidth) to the rate that moves as many bytes per compute step as a 25 GbE link
(``--link-gbps``) does under a 2 ms accelerator step (``--link-step-ms``): rate = 25 Gb/s x
2 ms / (the stock configuration's measured median step on this machine). For the no-cache
PS, LRU and BagPipe prescan (``--shaped-configs``), each repeat runs every configuration over
the servers unshaped, then shaped; it reports the measured samples/s on the shaped link
(baseline: the no-cache PS on the same link), and the link model's prediction for the same
run: `model_step` with the configuration's own unshaped median step as compute, the shaped
run's counters and the link as measured through a shaped calibration port (payload bytes/s,
round trip), against the shaped runs' measured median step (``shaped_model_step_ms``,
``model_error`` = |modelled - measured| / measured; the target is within 15%). Where
shaping is impossible (no root, no tc, lo already shaped by someone else, the kernel refuses)
it says so in a ``shaped_link`` line and reports only the model's predictions. The shaping is
removed when the section ends, also on errors and on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from dlrm_ranks import REPO, PSServers, free_port, run_dlrm
from link_shaping import ShapedLink, ShapingUnavailable, link_rate, measure_link

BENCH = "e2e_dlrm"

# Criteo 1TB's categorical cardinalities (cat_0 .. cat_25), before TorchRec's example caps
# them at 40M: the shape of the `criteo` table sizes.
CRITEO_1TB_ROWS = [
    227_605_432, 39_060, 17_295, 7_424, 20_265, 3, 7_122, 1_543, 63, 130_229_467,
    3_067_956, 405_282, 10, 2_209, 11_938, 155, 4, 976, 14, 292_775_614, 40_790_948,
    187_188_510, 590_152, 12_973, 108, 36,
]
# Tables bagpipe_mixed puts on BagPipe: the largest ones.
MIXED_BAGPIPE_TABLES = 3


def table_sizes(shape: str, rows: int) -> list[int]:
    """Rows of the 26 tables: Criteo 1TB's shape scaled so the largest has `rows`, or
    `rows` each."""
    if shape == "uniform":
        return [rows] * len(CRITEO_1TB_ROWS)
    top = max(CRITEO_1TB_ROWS)
    return [max(1, round(n * rows / top)) for n in CRITEO_1TB_ROWS]


@dataclass(frozen=True)
class Link:
    """A network between a trainer and the PS: one-way latency, bandwidth, window."""

    name: str
    rtt_s: float
    bytes_per_s: float
    window: int  # requests in flight before waiting for replies


PRESETS = [
    Link("25GbE-TCP", rtt_s=50e-6, bytes_per_s=25e9 / 8 * 0.9, window=8),
    Link("100Gb-RDMA", rtt_s=5e-6, bytes_per_s=100e9 / 8 * 0.95, window=32),
]


def run_config(argv: list[str], world: int, timeout: float) -> dict[str, Any]:
    """Runs the DLRM example on `world` spawned ranks; rank 0's results."""
    return run_dlrm(argv, world, timeout)[0]


def model_step(compute_s: float, counters: dict[str, float], steps: int, world: int,
               link: Link) -> tuple[float, float]:
    """(exposed network time, modelled step time) of one rank: compute plus the network
    time left exposed.

    Per rank and step, from the runtime's counters:
    * demand gets block the step: a round trip per get plus their bytes;
    * the gradient commit to the PS is on the critical path in the measured fraction of
      steps whose reads waited for the previous commit (`dependency_waits / steps`);
    * background traffic overlaps the step's compute, only its excess is exposed: prefetch
      gets (a window of them in flight), the commits' bytes, and the collectives between
      trainers on the same link: ring all-reduces of the gradients (collective
      aggregation: 2 (W-1) / W of the payload each way, 2 (W-1) latency hops each) and the
      online planner's ID all-gather ((W-1) peers' messages received).
    """
    per = 1.0 / max(1, steps * world)
    row_bytes = counters.get("fetched_bytes", 0.0) * per
    demand = counters.get("demand_fetched", 0.0) * per
    prefetched = counters.get("prefetched", 0.0) * per
    rows = max(1.0, demand + prefetched)
    demand_bytes = row_bytes * demand / rows
    prefetch_bytes = row_bytes * prefetched / rows
    demand_gets = counters.get("demand_gets", 0.0) * per
    prefetch_gets = counters.get("prefetch_gets", 0.0) * per
    commit_bytes = counters.get("gradient_payload_bytes", 0.0) * per
    allreduce_bytes = counters.get("allreduce_payload_bytes", 0.0) * per
    id_bytes = counters.get("id_exchange_bytes", 0.0) * per
    collectives = counters.get("collectives_issued", 0.0) * per
    # Keys travel with each get: 8 bytes per requested row.
    demand_time = demand_gets * link.rtt_s + (demand_bytes + 8 * demand) / link.bytes_per_s
    prefetch_time = (prefetch_gets * link.rtt_s / link.window
                     + (prefetch_bytes + 8 * prefetched) / link.bytes_per_s)
    commit_time = link.rtt_s + commit_bytes / link.bytes_per_s
    ring = 2.0 * (world - 1) / world if world > 1 else 0.0
    collective_time = (collectives * 2 * max(0, world - 1) * link.rtt_s
                       + (ring * allreduce_bytes + (world - 1) * id_bytes) / link.bytes_per_s)
    waits = counters.get("dependency_waits", 0.0) / max(1.0, counters.get("steps", 1.0))
    commit_exposed = waits * commit_time
    background = (prefetch_time + (1.0 - waits) * commit_bytes / link.bytes_per_s
                  + collective_time)
    exposed = demand_time + commit_exposed + max(0.0, background - compute_s)
    return exposed, compute_s + exposed


def _bytes_per_step(r: dict[str, Any], world: int) -> float:
    c = r["bagpipe"].get("counters", {})
    total = (c.get("fetched_bytes", 0.0) + c.get("gradient_payload_bytes", 0.0)
             + c.get("allreduce_payload_bytes", 0.0))
    return total / max(1, r["steps"] * world)


def emit(metric: str, value: float, unit: str, baseline: float | None, **extra: Any) -> None:
    line = {"bench": BENCH, "metric": metric, "value": value, "unit": unit,
            "baseline": baseline,
            "ratio": (value / baseline) if baseline else None, "threads": 1, **extra}
    print(json.dumps(line), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a short run (< 3 min)")
    p.add_argument("--steps", type=int, default=None, help="training batches per rank")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--num-embeddings", type=int, default=None,
                   help="rows of the largest table (criteo) or of each table (uniform)")
    p.add_argument("--table-sizes", choices=["criteo", "uniform"], default="criteo",
                   help="criteo: Criteo 1TB's 26 cardinalities scaled to --num-embeddings; "
                        "uniform: --num-embeddings rows each")
    p.add_argument("--dim", type=int, default=64, help="embedding dim (TorchRec's default)")
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--cache-fraction", type=float, default=0.05,
                   help="cache rows as a fraction of all table rows")
    p.add_argument("--lookahead", type=int, default=8)
    p.add_argument("--repeats", type=int, default=None, help="runs per configuration")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--configs", default="stock,ps_nocache,lru,bagpipe_prescan,bagpipe_online,"
                                        "bagpipe_collective,bagpipe_mixed")
    p.add_argument("--png", default=None, help="plot path (default: benchmarks/e2e_dlrm.png)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--shaped-link", action="store_true",
                   help="also run PS shards as TCP servers on a tc-shaped loopback link and "
                        "check the link model against it (module docstring)")
    p.add_argument("--shaped-configs", default="ps_nocache,lru,bagpipe_prescan",
                   help="configurations run on the shaped link")
    p.add_argument("--link-gbps", type=float, default=25.0,
                   help="reference link of the shaped run (Gb/s)")
    p.add_argument("--link-step-ms", type=float, default=2.0,
                   help="the accelerator step the reference link serves (ms)")
    p.add_argument("--compute-ms", type=str, default=None,
                   help="comma-separated assumed compute times per step (ms) for the link "
                        "model, e.g. an accelerator-class DLRM step; predictions for each "
                        "are printed besides those for the stock run's measured median step "
                        "(tagged compute_source=assumed)")
    args = p.parse_args(argv)
    try:
        assumed_ms = [float(v) for v in (args.compute_ms or "").split(",") if v.strip()]
    except ValueError:
        p.error(f"--compute-ms must be comma-separated numbers, got {args.compute_ms!r}")
    if any(not ms > 0 for ms in assumed_ms):
        p.error(f"--compute-ms values must be > 0, got {args.compute_ms!r}")
    steps = args.steps or (40 if args.quick else 200)
    batch = args.batch_size or (256 if args.quick else 1024)
    rows = args.num_embeddings or (20_000 if args.quick else 200_000)
    repeats = args.repeats or (1 if args.quick else 3)
    world = args.world_size
    sizes = table_sizes(args.table_sizes, rows)
    largest = sorted(sizes, reverse=True)[:MIXED_BAGPIPE_TABLES]
    if args.table_sizes == "uniform" and "bagpipe_mixed" in args.configs.split(","):
        p.error("bagpipe_mixed places the largest tables on BagPipe: use --table-sizes criteo")

    def units(table_rows: int) -> int:
        return max(1, int(table_rows * args.cache_fraction) // 64)

    def cache(table_rows: int) -> list[str]:
        return ["--optimization-cache-capacity", str(units(table_rows))]
    common = [
        "--batch_size", str(batch), "--limit_train_batches", str(steps),
        "--limit_val_batches", "2", "--limit_test_batches", "2",
        "--num_embeddings_per_feature", ",".join(map(str, sizes)),
        "--embedding_dim", str(args.dim),
        "--dense_arch_layer_sizes", f"64,{args.dim}", "--over_arch_layer_sizes", "64,32,1",
        "--learning_rate", "0.05", "--zipf_alpha", str(args.zipf), "--seed", "1",
        "--no_progress",
    ]
    every = ["--placement-min-rows", "0"]
    bagpipe = [*every, *cache(sum(sizes))]
    lookahead = ["--lookahead", str(args.lookahead)]
    configs = {
        "stock": ["--sharder", "torchrec"],
        "ps_nocache": [*every, "--read-mode", "ps"],
        "lru": [*bagpipe, "--eviction-policy", "lru", "--lookahead", "0"],
        "bagpipe_prescan": [*bagpipe, "--optimization-prescan", *lookahead],
        "bagpipe_online": [*bagpipe, *lookahead],
        "bagpipe_collective": [*bagpipe, *lookahead, "--bagpipe-aggregation", "collective"],
        "bagpipe_mixed": ["--placement-min-rows", str(largest[-1]), *cache(sum(largest)),
                          *lookahead],
    }
    chosen = [c for c in args.configs.split(",") if c]
    shaped_names = [c for c in args.shaped_configs.split(",") if c] if args.shaped_link else []
    for c in chosen + shaped_names:
        if c not in configs or (c in shaped_names and c == "stock"):
            p.error(f"unknown configuration {c!r}")
    if args.shaped_link and "stock" not in chosen:
        chosen.insert(0, "stock")  # its step sets the shaped link's rate
    results: dict[str, dict[str, Any]] = {}
    started = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in chosen}
    # Round-robin over repeats, so machine noise and warm-up spread over every configuration.
    for _ in range(repeats):
        for name in chosen:
            with tempfile.TemporaryDirectory() as tmp:
                runs[name].append(run_config([*common, *configs[name],
                                              "--metrics_json", os.path.join(tmp, "m.json")],
                                             world, args.timeout))
    for name in chosen:
        step_medians = [statistics.median(r["step_times"]) for r in runs[name]
                        if r["step_times"]]
        results[name] = {
            "samples_per_s": statistics.median(r["samples_per_s"] for r in runs[name]),
            "step_s": statistics.median(step_medians) if step_medians else float("nan"),
            "bagpipe": runs[name][-1].get("bagpipe", {}),
            "steps": runs[name][-1]["steps"],
        }
    base = results.get("stock")
    # (source, compute seconds per step) for the link model: the stock run's measured median
    # step, then each assumed (accelerator-class) step time.
    computes: list[tuple[str, float]] = []
    if base and base["step_s"] == base["step_s"]:
        computes.append(("measured", base["step_s"]))
    for ms in assumed_ms:
        emit("assumed_compute_ms", ms, "ms/step", None, config="all", compute_source="assumed")
        computes.append(("assumed", ms / 1e3))
    nocache = results.get("ps_nocache")
    nocache_bytes = _bytes_per_step(nocache, world) if nocache and nocache["bagpipe"] else None
    modelled_25g: dict[str, float] = {}
    if base and computes and computes[0][0] == "measured":
        modelled_25g["stock"] = world * batch / computes[0][1]
    for name, r in results.items():
        placed = runs[name][-1].get("placement", {})
        extra = {"config": name, "dim": args.dim, "transport": "local", "world_size": world,
                 "batch_size": batch, "table_sizes": args.table_sizes, "largest_table": rows,
                 "cache_units": units(sum(largest) if name == "bagpipe_mixed" else sum(sizes)),
                 "bagpipe_tables": len(placed.get("bagpipe", []))}
        emit("samples_per_s", r["samples_per_s"], "samples/s",
             base["samples_per_s"] if base else None, baseline_config="stock", **extra)
        s = r["bagpipe"]
        if not s:
            continue
        counters = s.get("counters", {})
        emit("hit_rate", s.get("hit_rate", 0.0), "fraction", None, **extra)
        emit("served_from_cache_rate", s.get("served_rate", 0.0), "fraction", None, **extra)
        per_step = max(1, r["steps"] * world)
        emit("ps_rows_per_step", s.get("fetched_rows", 0.0) / per_step, "rows/rank/step",
             None, **extra)
        emit("ps_bytes_per_step", _bytes_per_step(r, world), "bytes/rank/step", nocache_bytes,
             baseline_config="ps_nocache", **extra)
        # Where the time goes: the runtime's time per rank and step on the training thread
        # (baseline: the stock step, so the ratio is the fraction of a stock step) and on its
        # worker threads.
        if "runtime_critical_ms" in s:
            emit("runtime_critical_ms", s["runtime_critical_ms"], "ms/step",
                 1e3 * base["step_s"] if base else None, baseline_config="stock_step",
                 **extra)
            emit("runtime_worker_ms", s.get("runtime_worker_ms", 0.0), "ms/step", None, **extra)
        emit("allreduce_bytes_per_step", counters.get("allreduce_payload_bytes", 0.0) / per_step,
             "bytes/rank/step", None, **extra)
        for source, compute_s in computes:
            tag = {"compute_source": source, "compute_ms": 1e3 * compute_s}
            for link in PRESETS:
                exposed, t = model_step(compute_s, counters, r["steps"], world, link)
                e_nc = t_nc = None
                if nocache and nocache["bagpipe"]:
                    e_nc, t_nc = model_step(compute_s, nocache["bagpipe"]["counters"],
                                            nocache["steps"], world, link)
                emit("exposed_network_ms", 1e3 * exposed, "ms/step",
                     1e3 * e_nc if e_nc is not None else None, link=link.name,
                     baseline_config="ps_nocache", **tag, **extra)
                emit("modelled_step_s", t, "s", compute_s, link=link.name,
                     baseline_config="stock_compute", **tag, **extra)
                emit("modelled_samples_per_s", world * batch / t, "samples/s",
                     world * batch / t_nc if t_nc else None, link=link.name,
                     baseline_config="ps_nocache", **tag, **extra)
                if link is PRESETS[0] and source == "measured":
                    modelled_25g[name] = world * batch / t
    if args.shaped_link and base:
        shaped_section(args, common, configs, shaped_names, world, batch, repeats,
                       base["step_s"], extra={"dim": args.dim, "world_size": world,
                                              "batch_size": batch,
                                              "table_sizes": args.table_sizes,
                                              "largest_table": rows,
                                              "cache_units": units(sum(sizes))})
    emit("wall_s", time.perf_counter() - started, "s", None, config="all")
    _plot(results, modelled_25g, args.png or os.path.join(REPO, "benchmarks", "e2e_dlrm.png"))
    return 0


def _median_step(runs: list[dict[str, Any]]) -> float:
    meds = [statistics.median(r["step_times"]) for r in runs if r["step_times"]]
    return statistics.median(meds) if meds else float("nan")


def shaped_section(args: argparse.Namespace, common: list[str], configs: dict[str, list[str]],
                   names: list[str], world: int, batch: int, repeats: int, stock_step_s: float,
                   extra: dict[str, Any]) -> None:
    """The --shaped-link runs and their lines (module docstring)."""
    rate = link_rate(args.link_gbps, args.link_step_ms, stock_step_s)
    ports = [free_port() for _ in range(world)]
    calib_port = free_port()
    token = secrets.token_hex(16)
    unshaped: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    shaped: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    probes: list[tuple[float, float, float]] = []
    reason: str | None = None
    recipe: str | None = None

    def run_on_servers(name: str) -> dict[str, Any]:
        with PSServers(ports, token) as servers, tempfile.TemporaryDirectory() as tmp:
            return run_config([*common, *configs[name], "--ps-type", "tcp", "--ps-addresses",
                               *servers.addresses, "--job-token", token,
                               "--metrics_json", os.path.join(tmp, "m.json")],
                              world, args.timeout)

    for _ in range(repeats):
        for name in names:
            unshaped[name].append(run_on_servers(name))
        if reason is not None:
            continue
        try:
            with ShapedLink([*ports, calib_port], rate) as link:
                recipe = link.recipe
                probes.append(measure_link(calib_port, nbytes=max(1 << 20, int(rate / 4))))
                for name in names:
                    shaped[name].append(run_on_servers(name))
        except ShapingUnavailable as e:
            reason = str(e)
    common_extra = {**extra, "transport": "tcp", "link_rate_bytes_per_s": rate,
                    "reference_link": f"{args.link_gbps:g} Gb/s under a "
                                      f"{args.link_step_ms:g} ms step",
                    "stock_step_ms": 1e3 * stock_step_s}
    if probes:
        up = statistics.median(p[0] for p in probes)
        down = statistics.median(p[1] for p in probes)
        rtt = statistics.median(p[2] for p in probes)
        link = Link("shaped", rtt_s=rtt, bytes_per_s=min(up, down), window=8)
        emit("shaped_link", rate, "bytes/s", None, config="all", shaping=f"tc {recipe}",
             measured_up_bytes_per_s=up, measured_down_bytes_per_s=down, measured_rtt_us=1e6 * rtt,
             **common_extra)
    else:
        link = Link("shaped (not installed)", rtt_s=PRESETS[0].rtt_s, bytes_per_s=rate, window=8)
        emit("shaped_link", rate, "bytes/s", None, config="all",
             shaping=f"unavailable, link model only: {reason}", **common_extra)
    measured = {n: statistics.median(r["samples_per_s"] for r in shaped[n])
                for n in names if shaped[n]}
    nocache = measured.get("ps_nocache")
    for name in names:
        tag = {"config": name, **common_extra, "link": link.name}
        compute_s = _median_step(unshaped[name])
        unshaped_sps = statistics.median(r["samples_per_s"] for r in unshaped[name])
        runs = shaped[name] or unshaped[name]
        counters = runs[-1]["bagpipe"].get("counters", {})
        _, t = model_step(compute_s, counters, runs[-1]["steps"], world, link)
        model_sps = world * batch / t
        if name in measured:
            m = measured[name]
            step_s = _median_step(shaped[name])
            emit("shaped_samples_per_s", m, "samples/s", nocache, baseline_config="ps_nocache",
                 unshaped_samples_per_s=unshaped_sps, **tag)
            # Like with like: the model adds the exposed network time to the unshaped median
            # step, so it is checked against the shaped runs' median step.
            emit("shaped_model_step_ms", 1e3 * t, "ms", 1e3 * step_s,
                 baseline_config=f"{name}: median step measured on the shaped link",
                 model_error=abs(t / step_s - 1.0), target_error=0.15,
                 model_samples_per_s=model_sps, compute_ms=1e3 * compute_s, **tag)
        else:
            emit("shaped_model_samples_per_s", model_sps, "samples/s", None,
                 unshaped_samples_per_s=unshaped_sps, compute_ms=1e3 * compute_s, **tag)
    if nocache and "bagpipe_prescan" in measured:
        emit("shaped_prescan_vs_nocache", measured["bagpipe_prescan"] / nocache, "ratio", None,
             config="bagpipe_prescan", baseline_config="ps_nocache", target=1.5, **common_extra)


def _plot(results: dict[str, dict[str, Any]], modelled: dict[str, float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(results)
    x = np.arange(len(names))
    sps = [results[n]["samples_per_s"] for n in names]
    mod = [modelled.get(n, float("nan")) for n in names]
    hit = [100.0 * (results[n]["bagpipe"] or {}).get("hit_rate", 0.0) for n in names]
    served = [100.0 * (results[n]["bagpipe"] or {}).get("served_rate", 0.0) for n in names]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    ax[0].bar(x - 0.2, sps, 0.4, label="measured (this machine)")
    ax[0].bar(x + 0.2, mod, 0.4, label=f"modelled, {PRESETS[0].name}")
    ax[0].set_ylabel("samples/s (2 ranks)")
    ax[0].legend(fontsize=8)
    ax[1].bar(x - 0.2, hit, 0.4, label="hits")
    ax[1].bar(x + 0.2, served, 0.4, label="hits + prefetch-served")
    ax[1].set_ylabel("unique row accesses (%)")
    ax[1].legend(fontsize=8)
    for a in ax:
        a.set_xticks(x, names, rotation=25)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(json.dumps({"bench": BENCH, "metric": "plot", "value": path, "unit": "path",
                      "baseline": None, "ratio": None}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
