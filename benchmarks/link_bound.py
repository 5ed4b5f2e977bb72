#!/usr/bin/env python3
"""Link-bound DLRM at MLPerf shape: every configuration against the bound of its own counters.

BagPipe's claim lives where moving embeddings dominates the step. This benchmark builds that
regime on one machine and reports, per configuration, how close each gets to what its link
traffic allows (issue 24):

* shape: per-rank batch 2,048, dim 128, Criteo 1TB's 26 cardinalities scaled so the largest
  table has ``--num-embeddings`` rows, one id per feature, Zipf 1.05 popularity whose hot set
  drifts through ``--drift`` of each table's key space over the run (``--drift 0``: a
  stationary stream); 2 ranks (gloo), the cache ``--cache-fraction`` of the rows;
* compute: the example's ``--emulated_compute_ms`` (``--compute-ms``): every step sleeps that
  long after its work, the time an accelerator computes while the host is free, so the
  runtime's background threads overlap it as they would a GPU step;
* PS: one shard server process per rank (`dlrm_ranks.PSServers`), each on its own TCP port,
  every port shaped on loopback to `rate` bytes/s per direction (`link_shaping.ShapedLink`);
  ``rate = 25 Gb/s x gpu_step / step``: a 25 GbE link relative to the step a GPU takes for
  the same batch (anchor: MLPerf DLRM-DCNv2 on 8 x H100, ``--anchor-step-ms`` 3.9 ms per step
  at ``--anchor-batch`` 7,000 samples per GPU, scaled linearly to the batch) as the measured
  step of stock TorchRec on this machine (a calibration run) is to that GPU step;
* trainer link, two cases: ``unshaped`` (one node, NVLink-class) and ``shaped`` (trainers on
  separate nodes): the ranks' gloo traffic is bound to 127.0.0.11 (an address label on lo,
  ``GLOO_SOCKET_IFNAME``) and passes one token bucket at W x `rate` (gloo's connecting
  sockets are not bound, so the directions of a pair cannot be told apart by address: one
  bucket for the W ranks' symmetric traffic);
* configurations: stock TorchRec, PS without cache (``ps_nocache``, the baseline), LRU
  without lookahead, BagPipe prescan, online, collective aggregation, write-back aggregation
  (``writeback``: the caches own their rows; evicted rows cross the PS link back) and mixed
  placement (the 3 largest tables on BagPipe); ``--steps`` (>= 100 in full mode) steps,
  ``--repeats`` rounds, round robin over configurations and trainer-link cases; medians over
  the rounds. With ``--step-budget`` (``--quick``: 6 s) a case whose predicted step is long
  runs fewer steps (`plan_steps`, `predict_step`), at least ``--min-steps``; its lines carry
  ``steps``.
  The calibration run is the first round's stock run with an unshaped trainer link.

Per configuration and trainer link (`bound_model`): the bound is the slowest of compute (the
stock configuration's median step with an unshaped trainer link), the PS link (the larger
direction's bytes over the W shard links: rows fetched down; gradients and requested keys up)
and, when shaped, the trainer link (all-reduce ring and id all-gather bytes, TorchRec's
all-to-alls for stock-sharded tables, the dense all-reduce); every term comes from the run's
own counters. The link model (`link_model_step`) adds what cannot overlap: demand fetches
(a round trip per get plus their bytes), commits the next step waited for, and stock
TorchRec's all-to-alls. Lines (JSON, ``bench: link_bound``), each with ``config`` and
``trainer_link``:

* ``samples_per_s``: measured, ``ratio`` against ``baseline_config: ps_nocache``;
* ``bound_samples_per_s`` with ``bound_by`` (compute / ps_link / trainer_link) and the
  seconds per step of each resource;
* ``bound_fraction``: measured / bound (target >= 0.85);
* ``cap``: the speed-up over ps_nocache the bytes it saves allow (bound / ps_nocache's
  bound); ``cap_fraction``: measured speed-up / cap (target >= 0.85 for collective and prescan);
* ``model_error``: |link model's step / measured median step - 1| (target <= 0.15);
* ``online_vs_prescan`` (target >= 0.95), ``shaped_link`` (the rates and the calibrated link),
  ``load`` (/proc/loadavg before and after), ``wall_s``.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dlrm_ranks import PSServers, free_port, run_dlrm
from e2e_dlrm import MIXED_BAGPIPE_TABLES, table_sizes
from link_shaping import ShapedLink, ShapingUnavailable, link_rate, measure_link

BENCH = "link_bound"
CONFIGS = ("stock", "ps_nocache", "lru", "prescan", "online", "collective", "writeback",
           "mixed")
TRAINER_LINKS = ("unshaped", "shaped")
TRAINER_ADDR = "127.0.0.11"
TRAINER_IFACE = "lo:bagpipe"  # an address label on lo (IFNAMSIZ: at most 15 characters)
TARGETS = {"bound_fraction": 0.85, "cap_fraction": 0.85, "model_error": 0.15,
           "online_vs_prescan": 0.95}
DENSE_FEATURES = 13
KEY_BYTES = 8        # one int64 key per requested or committed row
LENGTH_BYTES = 4     # an int32 length per sample and feature in TorchRec's id all-to-all


def gpu_step_s(batch: int, anchor_step_ms: float = 3.9, anchor_batch: int = 7000) -> float:
    """The step a GPU takes for `batch` samples: the MLPerf anchor scaled linearly."""
    if batch < 1 or anchor_step_ms <= 0 or anchor_batch < 1:
        raise ValueError(f"need batch >= 1 and a positive anchor, got {batch}, "
                         f"{anchor_step_ms} ms, {anchor_batch}")
    return anchor_step_ms / 1e3 * batch / anchor_batch


def dense_params(dim: int, dense_layers: list[int], over_layers: list[int],
                 tables: int) -> int:
    """Parameters of DLRM's dense and over arch (the dense all-reduce's payload, floats)."""
    n, fin = 0, DENSE_FEATURES
    for out in dense_layers:
        n += fin * out + out
        fin = out
    features = tables + 1
    fin = dim + features * (features - 1) // 2
    for out in over_layers:
        n += fin * out + out
        fin = out
    return n


def stock_trainer_bytes(sharding: dict[str, str], sizes: dict[str, int], batch: int,
                        dim: int, world: int) -> float:
    """Bytes all ranks together send to each other per step for TorchRec's stock-sharded
    tables: per table, the id all-to-all and the pooled embeddings forward and their
    gradients back (table-wise / column-wise: (W-1)/W of the global batch's rows leave their
    owner; row-wise: each rank's partial sums for the other ranks' samples), or a
    data-parallel table's gradient all-reduce (ring: 2 (W-1)/W of the table each rank)."""
    if world < 2:
        return 0.0
    frac = (world - 1) / world
    total = 0.0
    for table, kind in sharding.items():
        kind = kind.lower().rsplit(".", 1)[-1]
        ids = world * batch * frac * (KEY_BYTES + LENGTH_BYTES)
        pooled = world * batch * frac * dim * 4
        if "data_parallel" in kind:
            total += world * 2 * frac * sizes[table] * dim * 4
        elif "row_wise" in kind and "table" not in kind:
            total += ids + 2 * world * pooled
        else:
            total += ids + 2 * pooled
    return total


@dataclass(frozen=True)
class Counters:
    """What a run moved per step, summed over ranks (bytes)."""

    steps: int
    ps_down: float             # rows fetched from the PS
    ps_up: float               # gradients + keys committed, keys of the gets
    trainer_background: float  # collective all-reduces and id all-gathers
    trainer_critical: float    # stock all-to-alls and the dense all-reduce
    demand_gets: float         # per rank
    demand_down: float         # per rank, bytes
    dependency_waits: float    # fraction of steps whose reads waited for a commit
    commit_up: float           # per rank, bytes
    wait_s: float              # per rank: the training thread blocked inside the runtime


def counters_of(result: dict[str, Any], world: int, batch: int, dim: int,
                dense: int, sizes: dict[str, int]) -> Counters:
    """Per-step traffic of one run from rank 0's results (the runtime's counters are
    summed over ranks by the example; TorchRec's traffic from its plan)."""
    steps = max(1, int(result["steps"]))
    c = result.get("bagpipe", {}).get("counters", {})
    rows = c.get("demand_fetched", 0.0) + c.get("prefetched", 0.0)
    down = c.get("fetched_bytes", 0.0)
    # (writeback: evicted rows go back up with their keys and optimizer state; the drains'
    # flushes, a one-off at the end of the run, are not a step's traffic)
    up = (c.get("gradient_payload_bytes", 0.0) + KEY_BYTES * rows
          + c.get("write_back_bytes", 0.0))
    ring = 2 * (world - 1) / world if world > 1 else 0.0
    background = (ring * c.get("allreduce_payload_bytes", 0.0)
                  + (world - 1) * c.get("id_exchange_bytes", 0.0))
    placed = result.get("placement", {})
    stock_tables = {t: k for t, k in result.get("sharding_types", {}).items()
                    if t in placed.get("stock", [])}
    critical = (stock_trainer_bytes(stock_tables, sizes, batch, dim, world)
                + world * ring * dense * 4)
    demand_rows = c.get("demand_fetched", 0.0)
    return Counters(
        steps=steps, ps_down=down / steps, ps_up=up / steps,
        trainer_background=background / steps, trainer_critical=critical,
        demand_gets=c.get("demand_gets", 0.0) / (steps * world),
        demand_down=down * demand_rows / max(1.0, rows) / (steps * world),
        dependency_waits=c.get("dependency_waits", 0.0) / max(1.0, c.get("steps", steps)),
        commit_up=c.get("gradient_payload_bytes", 0.0) / (steps * world),
        wait_s=max(0.0, c.get("runtime_critical_s", 0.0) - c.get("runtime_critical_cpu_s", 0.0))
        / (steps * world),
    )


def compute_of(step_s: float, c: Counters, stock_step_s: float, has_runtime: bool,
               link: Link | None = None) -> float:
    """A configuration's compute per step: its measured step less the time its training
    thread was blocked inside the runtime (waiting for rows, commits, peers: the runtime's
    wall time there less its CPU time); stock TorchRec's is its step with an unshaped trainer
    link (no counters; its all-to-alls then take ~nothing). On a shaped trainer link the
    stock-sharded tables' all-to-alls and the dense all-reduce (outside the runtime, on the
    critical path: `link_model_step` adds them) are taken out too."""
    if not has_runtime:
        return stock_step_s
    critical = 0.0
    if link is not None and link.trainer_rate is not None:
        critical = c.trainer_critical / (link.world * link.trainer_rate)
    return max(0.0, step_s - c.wait_s - critical)


@dataclass(frozen=True)
class Link:
    """Rates (bytes/s per direction of one link) and the shaped link's round trip."""

    ps_rate: float
    trainer_rate: float | None  # per rank; None: unshaped
    rtt_s: float
    shards: int
    world: int


def bound_model(compute_s: float, c: Counters, link: Link) -> dict[str, float]:
    """Seconds per step each resource needs (compute, PS link, trainer link) and the bound:
    the slowest, everything else overlapping it."""
    ps = max(c.ps_down, c.ps_up) / (link.shards * link.ps_rate)
    trainer = 0.0
    if link.trainer_rate is not None:
        trainer = ((c.trainer_background + c.trainer_critical)
                   / (link.world * link.trainer_rate))
    times = {"compute": compute_s, "ps_link": ps, "trainer_link": trainer}
    by = max(times, key=lambda k: times[k])
    return {**{f"{k}_s": v for k, v in times.items()}, "bound_s": times[by],
            "bound_by": by}  # type: ignore[dict-item]


def link_model_step(compute_s: float, c: Counters, link: Link) -> float:
    """The modelled step: compute plus what cannot overlap it (demand gets: a round trip each
    plus their bytes; the commits a step waited for; stock TorchRec's all-to-alls and the
    dense all-reduce when the trainer link is shaped), and never under the link occupancy."""
    b = bound_model(compute_s, c, link)
    exposed = (c.demand_gets * link.rtt_s + c.demand_down / link.ps_rate
               + c.dependency_waits * (link.rtt_s + c.commit_up / link.ps_rate))
    if link.trainer_rate is not None:
        exposed += c.trainer_critical / (link.world * link.trainer_rate)
    return max(compute_s + exposed, b["ps_link_s"], b["trainer_link_s"])


def plan_steps(max_steps: int, predicted_s: float | None, budget_s: float | None,
               min_steps: int) -> int:
    """Steps of one run: as many as `budget_s` seconds of training hold at the predicted
    step, at least `min_steps` and at most `max_steps`; `max_steps` without a budget or a
    prediction (full mode: every run its ``--steps``)."""
    if not budget_s or predicted_s is None or not predicted_s > 0:
        return max_steps
    return max(min(min_steps, max_steps), min(max_steps, int(budget_s / predicted_s)))


def predict_step(config: str, trainer_link: str,
                 runs: dict[tuple[str, str], list[dict[str, Any]]], compute_s: float,
                 shaped: Link, batch: int, dim: int, dense: int,
                 sizes: dict[str, int]) -> float | None:
    """The step a run of (config, trainer_link) is expected to take, from what this
    benchmark measured so far: its own last run; on the shaped trainer link, the link model
    of its unshaped run's counters at the `shaped` link's rates (never under that run's
    step); unshaped, for a configuration with every table on the PS, ps_nocache's step (a
    cache only saves bytes). None: nothing to go by."""
    if runs.get((config, trainer_link)):
        return _mean_step(runs[(config, trainer_link)][-1])
    if trainer_link == "shaped" and runs.get((config, "unshaped")):
        r = runs[(config, "unshaped")][-1]
        step = _mean_step(r)
        cnt = counters_of(r, shaped.world, batch, dim, dense, sizes)
        own = compute_of(step, cnt, compute_s, bool(r.get("bagpipe")))
        return max(step, link_model_step(own, cnt, shaped))
    if config not in ("stock", "ps_nocache", "mixed") and runs.get(("ps_nocache", trainer_link)):
        return _mean_step(runs[("ps_nocache", trainer_link)][-1])
    return None


def cap(bound_s: float, nocache_bound_s: float) -> float:
    """The speed-up over ps_nocache that a configuration's bytes allow."""
    return nocache_bound_s / bound_s


def emit(metric: str, value: Any, unit: str, baseline: float | None = None,
         **extra: Any) -> dict[str, Any]:
    ratio = (value / baseline) if baseline and isinstance(value, (int, float)) else None
    line = {"bench": BENCH, "metric": metric, "value": value, "unit": unit,
            "baseline": baseline, "ratio": ratio, **extra}
    print(json.dumps(line), flush=True)
    return line


def loadavg() -> str:
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def _ip_addr(op: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", "addr", op, f"{TRAINER_ADDR}/32", "dev", "lo", "label",
                           TRAINER_IFACE], capture_output=True, text=True, timeout=10,
                          check=False)


@contextlib.contextmanager
def trainer_address() -> Iterator[dict[str, str] | None]:
    """Binds the trainers' gloo traffic to TRAINER_ADDR (an address label on lo), so tc can
    shape it; yields the ranks' environment, or None where the address cannot be added.
    The address goes on every exit path: an exception, SIGINT, SIGTERM / SIGHUP (`main`
    turns them into SystemExit), interpreter exit (atexit); one left by a run that died by
    SIGKILL is taken over and removed too."""
    r = _ip_addr("add")
    if r.returncode != 0 and "exists" not in r.stderr:
        print(f"link_bound: cannot add {TRAINER_ADDR} to lo ({r.stderr.strip()}): the trainer "
              "link stays unshaped", file=sys.stderr, flush=True)
        yield None
        return
    removed = False

    def remove() -> None:
        nonlocal removed
        if not removed:
            removed = True
            _ip_addr("del")

    atexit.register(remove)
    try:
        yield {"GLOO_SOCKET_IFNAME": TRAINER_IFACE}
    finally:
        remove()
        atexit.unregister(remove)


@contextlib.contextmanager
def signals_exit() -> Iterator[None]:
    """SIGTERM and SIGHUP raise SystemExit(128 + signal) in the main thread, so every context
    manager (tc shaping, the trainer address, PS servers, ranks) unwinds as on an error."""
    def on_signal(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    old: dict[int, Any] = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(ValueError):  # not the main thread: nothing to install
            old[sig] = signal.signal(sig, on_signal)
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def build_configs(sizes: list[int], cache_fraction: float, lookahead: int
                  ) -> dict[str, list[str]]:
    def cache(rows: int) -> list[str]:
        return ["--optimization-cache-capacity", str(max(1, int(rows * cache_fraction) // 64))]
    every = ["--placement-min-rows", "0"]
    bagpipe = [*every, *cache(sum(sizes))]
    ahead = ["--lookahead", str(lookahead)]
    largest = sorted(sizes, reverse=True)[:MIXED_BAGPIPE_TABLES]
    return {
        "stock": ["--sharder", "torchrec"],
        "ps_nocache": [*every, "--read-mode", "ps"],
        "lru": [*bagpipe, "--eviction-policy", "lru", "--lookahead", "0"],
        "prescan": [*bagpipe, "--optimization-prescan", *ahead],
        "online": [*bagpipe, *ahead],
        "collective": [*bagpipe, *ahead, "--bagpipe-aggregation", "collective"],
        "writeback": [*bagpipe, *ahead, "--bagpipe-aggregation", "writeback"],
        "mixed": ["--placement-min-rows", str(largest[-1]), *cache(sum(largest)), *ahead],
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--quick", action="store_true", help="a short run (3-4 minutes)")
    a("--steps", type=int, default=None,
      help="training steps per run, the most with --step-budget (full: 100, quick: 12)")
    a("--step-budget", type=float, default=None,
      help="seconds of training per run: a configuration whose step is long runs fewer "
      "steps, as many as fit at the step this run predicts for it, at least --min-steps "
      "(full: none, every run --steps; quick: 6 s)")
    a("--min-steps", type=int, default=None, help="steps a run takes at least (quick: 4)")
    a("--repeats", type=int, default=None, help="rounds (full: 3)")
    a("--batch-size", type=int, default=2048, help="per-rank batch (MLPerf-like: >= 2048)")
    a("--dim", type=int, default=128)
    a("--num-embeddings", type=int, default=None,
      help="rows of the largest table (Criteo 1TB's shape scaled; full 400K, quick 100K)")
    a("--zipf", type=float, default=1.05)
    a("--drift", type=float, default=0.5,
      help="fraction of each table's key space the hot set drifts through over the run")
    a("--cache-fraction", type=float, default=0.05)
    a("--lookahead", type=int, default=8)
    a("--world-size", type=int, default=2)
    a("--compute-ms", type=float, default=None,
      help="emulated accelerator compute per step (ms; full 60, quick 40)")
    a("--link-gbps", type=float, default=25.0)
    a("--anchor-step-ms", type=float, default=3.9, help="GPU step of the anchor batch")
    a("--anchor-batch", type=int, default=7000, help="samples per GPU of the anchor")
    a("--configs", default=",".join(CONFIGS))
    a("--trainer-links", default=",".join(TRAINER_LINKS))
    a("--timeout", type=float, default=900.0, help="per run (s)")
    a("--dense-arch", default="64,128", help="dense arch layers (last = --dim)")
    a("--over-arch", default="64,32,1")
    a("--save", default=None, help="write every run's results here (JSON) before reporting")
    a("--report-from", default=None,
      help="report a --save file again instead of running (e.g. after changing the model)")
    args = p.parse_args(argv)
    args.steps = args.steps or (12 if args.quick else 100)
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.step_budget is None:
        args.step_budget = 6.0 if args.quick else 0.0
    args.min_steps = args.min_steps or min(args.steps, 4 if args.quick else args.steps)
    args.num_embeddings = args.num_embeddings or (100_000 if args.quick else 400_000)
    args.compute_ms = args.compute_ms if args.compute_ms is not None else (
        40.0 if args.quick else 60.0)
    args.configs = [c for c in args.configs.split(",") if c]
    args.trainer_links = [t for t in args.trainer_links.split(",") if t]
    for c in args.configs:
        if c not in CONFIGS:
            p.error(f"unknown configuration {c!r} (one of {', '.join(CONFIGS)})")
    for t in args.trainer_links:
        if t not in TRAINER_LINKS:
            p.error(f"unknown trainer link {t!r} (unshaped, shaped)")
    if "ps_nocache" not in args.configs:
        args.configs.insert(0, "ps_nocache")  # the baseline
    if "stock" not in args.configs:
        args.configs.insert(0, "stock")  # its step is the compute
    if "unshaped" not in args.trainer_links:
        args.trainer_links.insert(0, "unshaped")  # the compute is measured there
    if args.batch_size < 1 or args.steps < 2 or args.compute_ms < 0:
        p.error("need --batch-size >= 1, --steps >= 2, --compute-ms >= 0")
    if args.min_steps < 2 or args.step_budget < 0:
        p.error("need --min-steps >= 2 and --step-budget >= 0")
    args.dense_layers = [int(v) for v in args.dense_arch.split(",")]
    args.over_layers = [int(v) for v in args.over_arch.split(",")]
    if args.dense_layers[-1] != args.dim:
        p.error("the dense arch's last layer must be --dim")
    return args


def common_argv(args: argparse.Namespace, sizes: list[int], steps: int) -> list[str]:
    """The example's flags every configuration shares (one validation and one test batch,
    the fewest the example takes: the benchmark measures training only)."""
    return [
        "--batch_size", str(args.batch_size), "--limit_train_batches", str(steps),
        "--limit_val_batches", "1", "--limit_test_batches", "1",
        "--num_embeddings_per_feature", ",".join(map(str, sizes)),
        "--embedding_dim", str(args.dim), "--dense_arch_layer_sizes", args.dense_arch,
        "--over_arch_layer_sizes", args.over_arch, "--learning_rate", "0.05",
        "--zipf_alpha", str(args.zipf), "--zipf_drift", str(args.drift), "--seed", "1",
        "--no_progress", "--emulated_compute_ms", str(args.compute_ms),
    ]


def run_info(args: argparse.Namespace) -> dict[str, Any]:
    """The run's settings, carried by every line (a configuration's lines carry the steps
    its runs took in `steps`, at most --steps)."""
    return {"world_size": args.world_size, "batch_size": args.batch_size, "dim": args.dim,
            "largest_table": args.num_embeddings, "steps": args.steps,
            "step_budget_s": args.step_budget, "min_steps": args.min_steps, "zipf": args.zipf,
            "drift": args.drift, "cache_fraction": args.cache_fraction,
            "emulated_compute_ms": args.compute_ms, "repeats": args.repeats}


def _mean_step(r: dict[str, Any]) -> float:
    """A run's mean step per rank, as its samples/s counts it (flush included)."""
    if not r["samples_per_s"]:
        return float("nan")
    return r["samples"] / r["samples_per_s"] / r["steps"]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    started = time.perf_counter()
    load_before = loadavg()
    world = args.world_size
    sizes = table_sizes("criteo", args.num_embeddings)
    table_rows = {f"t_cat_{i}": n for i, n in enumerate(sizes)}
    configs = build_configs(sizes, args.cache_fraction, args.lookahead)
    dense = dense_params(args.dim, args.dense_layers, args.over_layers, len(sizes))
    if args.report_from:
        with open(args.report_from, encoding="utf-8") as f:
            saved = json.load(f)
        runs_saved = {tuple(k.split("|")): v for k, v in saved["runs"].items()}
        report(args, runs_saved, saved["compute_s"], saved["rate"], saved["measured_rate"],
               saved["rtt_s"], world, dense, table_rows, saved["info"], saved["shaped_ok"])
        return 0
    with signals_exit():
        return measure(args, started, load_before, sizes, table_rows, configs, dense)


def measure(args: argparse.Namespace, started: float, load_before: str, sizes: list[int],
            table_rows: dict[str, int], configs: dict[str, list[str]], dense: int) -> int:
    """Calibrates, runs every case round robin under the shaping, reports (`main`)."""
    world = args.world_size
    token = secrets.token_hex(16)
    ports = [free_port() for _ in range(world)]
    calib = free_port()
    info = run_info(args)

    def run(name: str, env: dict[str, str] | None, steps: int) -> dict[str, Any]:
        extra = [] if name == "stock" else ["--ps-type", "tcp", "--job-token", token]
        with contextlib.ExitStack() as stack:
            tmp = stack.enter_context(tempfile.TemporaryDirectory())
            if name != "stock":
                servers = stack.enter_context(PSServers(ports, token))
                extra += ["--ps-addresses", *servers.addresses]
            return run_dlrm([*common_argv(args, sizes, steps), *configs[name], *extra,
                             "--metrics_json", os.path.join(tmp, "m.json")],
                            world, args.timeout, env=env)[0]

    runs: dict[tuple[str, str], list[dict[str, Any]]] = {
        (c, t): [] for c in args.configs for t in args.trainer_links}
    steps_of: dict[tuple[str, str], int] = {}  # fixed in the first round, kept in the others
    with trainer_address() as env:
        # Calibration: stock TorchRec's step on this machine sets the link rate. It is the
        # first round's stock run with an unshaped trainer link too (no PS port, no shaped
        # address: the shaping installed below would not touch it).
        calibration = run("stock", None, args.steps)
        runs[("stock", "unshaped")].append(calibration)
        steps_of[("stock", "unshaped")] = args.steps
        step_s = statistics.median(calibration["step_times"])
        gpu_s = gpu_step_s(args.batch_size, args.anchor_step_ms, args.anchor_batch)
        rate = link_rate(args.link_gbps, 1e3 * gpu_s, step_s)
        hosts = [TRAINER_ADDR] if env is not None and "shaped" in args.trainer_links else []
        probes: list[tuple[float, float, float]] = []
        try:
            with ShapedLink([*ports, calib], rate, hosts=hosts,
                            host_rate=world * rate) as shaped:
                recipe = shaped.recipe
                probes.append(measure_link(calib, nbytes=max(1 << 20, int(rate / 4))))
                up, down, rtt = probes[0]
                shaped_link = Link(ps_rate=min(up, down), trainer_rate=rate, rtt_s=rtt,
                                   shards=world, world=world)
                for round_ in range(args.repeats):
                    for t in args.trainer_links:
                        if t == "shaped" and not hosts:
                            continue
                        for c in args.configs:
                            if round_ == 0 and (c, t) == ("stock", "unshaped"):
                                continue  # the calibration run
                            if (c, t) not in steps_of:
                                predicted = predict_step(
                                    c, t, runs, _mean_step(calibration), shaped_link,
                                    args.batch_size, args.dim, dense, table_rows)
                                steps_of[(c, t)] = plan_steps(args.steps, predicted,
                                                              args.step_budget, args.min_steps)
                            # Unshaped: gloo on its default address, which no filter matches.
                            runs[(c, t)].append(run(c, env if t == "shaped" else None,
                                                    steps_of[(c, t)]))
        except ShapingUnavailable as e:
            emit("shaped_link", None, "bytes/s", config="all", trainer_link="all",
                 shaping=f"unavailable: {e}", **info)
            return 1
    emit("shaped_link", rate, "bytes/s", config="all", trainer_link="all",
         shaping=f"tc {recipe}", gpu_step_ms=1e3 * gpu_s, calibration_step_ms=1e3 * step_s,
         trainer_rate_bytes_per_s=rate if hosts else None,
         measured_up_bytes_per_s=up, measured_down_bytes_per_s=down,
         measured_rtt_us=1e6 * rtt, reference=f"{args.link_gbps:g} Gb/s under a "
         f"{1e3 * gpu_s:.3f} ms GPU step", **info)
    compute_s = statistics.median(_mean_step(r) for r in runs[("stock", "unshaped")])
    if args.save:
        with open(args.save, "w", encoding="utf-8") as f:
            json.dump({"runs": {"|".join(k): v for k, v in runs.items()}, "info": info,
                       "compute_s": compute_s, "rate": rate, "measured_rate": min(up, down),
                       "rtt_s": rtt, "shaped_ok": bool(hosts)}, f, default=float)
    report(args, runs, compute_s, rate, min(up, down), rtt, world, dense, table_rows, info,
           bool(hosts))
    emit("load", f"{load_before} -> {loadavg()}", "loadavg", config="all", trainer_link="all")
    emit("wall_s", time.perf_counter() - started, "s", config="all", trainer_link="all")
    return 0


def report(args: argparse.Namespace, runs: dict[tuple[str, str], list[dict[str, Any]]],
           compute_s: float, rate: float, measured_rate: float, rtt: float, world: int,
           dense: int, sizes: dict[str, int], info: dict[str, Any], shaped_ok: bool) -> None:
    """The lines of every (configuration, trainer link) (module docstring)."""
    batch = args.batch_size
    for t in args.trainer_links:
        if t == "shaped" and not shaped_ok:
            continue
        link = Link(ps_rate=measured_rate, trainer_rate=rate if t == "shaped" else None,
                    rtt_s=rtt, shards=world, world=world)
        rows: dict[str, dict[str, Any]] = {}
        for c in args.configs:
            rs = runs[(c, t)]
            if not rs:
                continue
            cnt = counters_of(rs[-1], world, batch, args.dim, dense, sizes)
            sps = statistics.median(r["samples_per_s"] for r in rs)
            step_s = world * batch / sps
            own = compute_of(step_s, cnt, compute_s, bool(rs[-1].get("bagpipe")), link)
            b = bound_model(own, cnt, link)
            rows[c] = {"sps": sps, "step_s": step_s, "bound": b, "counters": cnt,
                       "model_s": link_model_step(own, cnt, link),
                       "bagpipe": rs[-1].get("bagpipe", {}), "steps": int(rs[-1]["steps"])}
        base = rows.get("ps_nocache")
        for c, r in rows.items():
            tag = {"config": c, "trainer_link": t, **info, "steps": r["steps"]}
            b = r["bound"]
            bound_sps = world * batch / b["bound_s"]
            emit("samples_per_s", r["sps"], "samples/s", base["sps"] if base else None,
                 baseline_config="ps_nocache", **tag)
            emit("bound_samples_per_s", bound_sps, "samples/s", None, bound_by=b["bound_by"],
                 compute_ms=1e3 * b["compute_s"], ps_link_ms=1e3 * b["ps_link_s"],
                 trainer_link_ms=1e3 * b["trainer_link_s"],
                 ps_bytes_per_step=max(r["counters"].ps_down, r["counters"].ps_up),
                 trainer_bytes_per_step=(r["counters"].trainer_background
                                         + r["counters"].trainer_critical), **tag)
            frac = r["sps"] / bound_sps
            emit("bound_fraction", frac, "fraction", None, target=TARGETS["bound_fraction"],
                 met=frac >= TARGETS["bound_fraction"], bound_by=b["bound_by"], **tag)
            if base:
                k = cap(b["bound_s"], base["bound"]["bound_s"])
                speedup = r["sps"] / base["sps"]
                emit("cap", k, "speed-up", None, baseline_config="ps_nocache", **tag)
                emit("cap_fraction", speedup / k, "fraction", None, speedup=speedup,
                     target=TARGETS["cap_fraction"], met=speedup / k >= TARGETS["cap_fraction"],
                     baseline_config="ps_nocache", **tag)
            err = abs(r["model_s"] / r["step_s"] - 1.0)
            emit("model_error", err, "fraction", None, model_step_ms=1e3 * r["model_s"],
                 measured_step_ms=1e3 * r["step_s"], target=TARGETS["model_error"],
                 met=err <= TARGETS["model_error"], **tag)
            s = r["bagpipe"]
            if s:
                emit("hit_rate", s.get("hit_rate", 0.0), "fraction", None,
                     served_from_cache=s.get("served_rate", 0.0),
                     runtime_critical_ms=s.get("runtime_critical_ms"),
                     runtime_worker_ms=s.get("runtime_worker_ms"),
                     runtime_worker_cpu_ms=s.get("runtime_worker_cpu_ms"),
                     wait_ms=1e3 * r["counters"].wait_s, **tag)
        if "online" in rows and "prescan" in rows:
            v = rows["online"]["sps"] / rows["prescan"]["sps"]
            emit("online_vs_prescan", v, "ratio", None, config="online", trainer_link=t,
                 baseline_config="prescan", target=TARGETS["online_vs_prescan"],
                 met=v >= TARGETS["online_vs_prescan"],
                 **{**info, "steps": rows["online"]["steps"],
                    "prescan_steps": rows["prescan"]["steps"]})


if __name__ == "__main__":
    sys.exit(main())
