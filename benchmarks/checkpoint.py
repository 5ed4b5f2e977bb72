"""Benchmark of incremental (chained) PS checkpoints vs full ones (issue 23 item 1).

A store of `--rows` rows (every key stored, dim `--dim`, Adagrad: the optimizer state is as
wide as the weights) takes rounds of updates on a Zipf workload: each round updates a set of
distinct rows drawn by Zipf(1.05) weights over key ranks (scattered over the key space by a
fixed permutation), sampled without replacement (Gumbel top-k) until `touched_fraction` of
the rows (0.01, 0.1, 0.5) were touched. After each round, in the same state and in
alternating order (the machine is shared; the two are interleaved):

* incremental: ``store.checkpoint(chain_dir, step)`` -- an increment of the changed rows (and
  state) linked to a full base written before the first round (a policy that never compacts,
  so every round adds a link);
* full (the baseline, today's periodic checkpoint): ``store.save(full_dir)``.

Lines (one JSON object each; medians over the rounds):

* checkpoint_bytes  bytes    data bytes written (manifest not counted); ratio = incr / full
* checkpoint_s      s        wall time of one checkpoint, fsyncs included; ratio = incr / full
* restore_s         s        ``EmbeddingStore.load`` of the chain (base + n increments) vs of
                             the full checkpoint of the same step (checked bitwise equal);
                             ratio = chain / full
* stall_ms          ms       training stall per periodic checkpoint of an in-process PS shard
                             (``checkpoint_every``): a step is a get of its rows at the
                             previous step, the trainer's compute (``--stall-compute-ms``, a
                             sleep: a GPU's step leaves the CPU free) and the commit of their
                             gradients (Zipf batches);
                             (step time summed with checkpoints - without) / checkpoints, the
                             the runs (none, incremental, full, background,
                             background_full) interleaved over repeats. Lines by `config`:
                             incremental vs full (blocking: the commit that reaches the
                             checkpoint writes it), background vs incremental and
                             background_full vs full (checkpoint_background: the write runs
                             beside the later steps' commits, from a copy-on-write snapshot);
                             touched_fraction is the rows touched between checkpoints.
                             Each run's chain starts with an untimed base, so the timed
                             checkpoints are increments (full modes: full ones). A
                             background write still running at the next checkpoint is
                             waited for (one write at a time): background_full, whose
                             write outlasts the interval, measures that wait.

* restore_s (config ``reshard``)  s   restoring a whole set of ``shards_from`` PS shards onto
                             ``shards_to`` (``PSShard(restore=[...])``: every new shard
                             loads each old part and keeps its rows; every row checked
                             bitwise) vs the same set restored onto ``shards_from`` shards
                             (each its own part); summed over the new shards (a serial
                             bound: the shards of a job restore in parallel). The trainers
                             of a resumed job (2 -> 1, 1 -> 2) load their dense state from
                             one file whatever the count; the PS rows are the cost.

Wall times are of a loaded 2-core machine and of its disk (page cache and fsync); bytes are
exact. --quick: 100k rows, 3 rounds per fraction (under a minute).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchrec_bagpipe.ps import EmbeddingStore

ZIPF_S = 1.05
BENCH = "checkpoint"


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def zipf_rows(rng: np.random.Generator, perm: np.ndarray, log_w: np.ndarray,
              count: int) -> torch.Tensor:
    """`count` distinct keys drawn by Zipf weight without replacement (Gumbel top-k)."""
    score = log_w + rng.gumbel(size=log_w.shape[0])
    ranks = np.argpartition(-score, count - 1)[:count]
    return torch.from_numpy(np.sort(perm[ranks]))


def contents(store: EmbeddingStore) -> dict[int, bytes]:
    out = {}
    for k, r, s in store.export(chunk_rows=1 << 16, with_state=True):
        for key, row, st in zip(k.tolist(), r.numpy(), s.numpy()):
            out[key] = row.tobytes() + st.tobytes()
    return out


def run_fraction(rows: int, dim: int, fraction: float, rounds: int, work: Path,
                 verify: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    perm = rng.permutation(rows).astype(np.int64)
    log_w = -ZIPF_S * np.log(np.arange(1, rows + 1, dtype=np.float64))
    store = EmbeddingStore(dim=dim, init="uniform", init_bound=0.01, optimizer="adagrad")
    store.reserve(rows)
    all_keys = torch.arange(rows, dtype=torch.int64)
    for i in range(0, rows, 1 << 18):
        k = all_keys[i:i + (1 << 18)]
        store.lookup(k, out=torch.empty((k.numel(), dim)))  # every key stored
    chain_dir, full_dir = work / "chain", work / "full"
    never = {"full_every": 1 << 30, "chain_fraction": 1e30}
    base = store.checkpoint(chain_dir, 0, {"step": "0"}, **never)
    assert not base["incremental"]
    touched = max(1, int(rows * fraction))
    inc_bytes, full_bytes, inc_s, full_s = [], [], [], []
    for step in range(1, rounds + 1):
        keys = zipf_rows(rng, perm, log_w, touched)
        grads = torch.from_numpy(rng.standard_normal((keys.numel(), dim), dtype=np.float32))
        store.apply_gradients(keys, grads, 0.01)
        meta = {"step": str(step)}

        for kind in ("incr", "full") if step % 2 else ("full", "incr"):
            t0 = time.perf_counter()
            if kind == "incr":
                r = store.checkpoint(chain_dir, step, meta, **never)
                inc_s.append(time.perf_counter() - t0)
                assert r["incremental"] and r["rows"] == keys.numel(), r
                inc_bytes.append(r["bytes"])
            else:
                store.save(full_dir, meta)
                full_s.append(time.perf_counter() - t0)
                full_bytes.append(EmbeddingStore.checkpoint_info(full_dir)["chain"][0]["bytes"])
    common = {"bench": BENCH, "touched_fraction": fraction, "rows": rows, "dim": dim,
              "optimizer": "adagrad", "rounds": rounds}
    b_inc, b_full = statistics.median(inc_bytes), statistics.median(full_bytes)
    emit(metric="checkpoint_bytes", value=b_inc, unit="bytes", baseline=b_full,
         ratio=b_inc / b_full, **common)
    s_inc, s_full = statistics.median(inc_s), statistics.median(full_s)
    emit(metric="checkpoint_s", value=s_inc, unit="s", baseline=s_full, ratio=s_inc / s_full,
         **common)
    # Restore: the chain (base + `rounds` increments) vs the full checkpoint, interleaved.
    chain_t, full_t = [], []
    for rep in range(3):
        order = (("chain", chain_dir), ("full", full_dir))
        for name, d in order if rep % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            loaded = EmbeddingStore.load(d)
            (chain_t if name == "chain" else full_t).append(time.perf_counter() - t0)
            if verify and rep == 0:
                if name == "chain":
                    got = contents(loaded)
                else:
                    assert contents(loaded) == got, "chain and full checkpoint differ"
            del loaded
    r_chain, r_full = statistics.median(chain_t), statistics.median(full_t)
    emit(metric="restore_s", value=r_chain, unit="s", baseline=r_full, ratio=r_chain / r_full,
         increments=rounds, bitwise_equal=verify, **common)


def run_stall(rows: int, dim: int, steps: int, every: int, repeats: int, work: Path,
              seed: int, compute_ms: float) -> None:
    from torchrec_bagpipe.ps import PSClient, PSShard, ShardSpec

    rng = np.random.default_rng(seed)
    perm = torch.from_numpy(rng.permutation(rows).astype(np.int64))
    w = np.arange(1, rows + 1, dtype=np.float64) ** -ZIPF_S
    cdf = np.cumsum(w) / w.sum()
    batches = [perm[torch.from_numpy(np.searchsorted(cdf, rng.random(4096)))]
               for _ in range(steps)]
    grads = [torch.from_numpy(rng.standard_normal((4096, dim), dtype=np.float32))
             for _ in range(steps)]
    touched = statistics.mean(
        len(torch.unique(torch.cat(batches[i:i + every]))) / rows
        for i in range(0, steps - every + 1, every))
    # Blocking and background (checkpoint_background) periodic checkpoints, incremental and
    # full; `every // 2` steps after the last checkpoint so a background write is inside
    # the timed window too.
    configs = {"none": None, "incremental": (True, False), "full": (False, False),
               "background": (True, True), "background_full": (False, True)}
    totals: dict[str, list[float]] = {mode: [] for mode in configs}
    modes = list(totals)
    run_steps = steps + every // 2
    for rep in range(repeats):
        for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:
            d = work / f"{mode}-{rep}"
            incremental, background = configs[mode] or (True, False)
            spec = ShardSpec(checkpoint_dir=d, checkpoint_every=0 if mode == "none" else every,
                             checkpoint_incremental=incremental,
                             checkpoint_background=background)
            with PSShard(spec) as shard, PSClient(
                    [shard], table="t", dim=dim, lr=0.01, init="uniform", init_bound=0.01,
                    optimizer="adagrad", timeout=600.0) as c:
                keys = torch.arange(rows, dtype=torch.int64)
                for i in range(0, rows, 1 << 18):
                    shard.assign("t", keys[i:i + (1 << 18)],
                                 torch.zeros((min(1 << 18, rows - i), dim)))
                if mode != "none":
                    shard.checkpoint()  # the chain's base, untimed: the window is steady state
                t0 = time.perf_counter()
                for step in range(run_steps):
                    c.get(batches[step % steps], step - 1)
                    if compute_ms > 0:
                        time.sleep(compute_ms / 1e3)  # the trainer's step (a GPU's, off-CPU)
                    c.commit(step, batches[step % steps], grads[step % steps])
                c.get(batches[0], run_steps - 1)  # the last step (and its checkpoint) applied
                totals[mode].append(time.perf_counter() - t0)
            shutil.rmtree(d, ignore_errors=True)
    checkpoints = steps // every
    base = statistics.median(totals["none"])
    stall = {mode: (statistics.median(t) - base) / checkpoints * 1e3
             for mode, t in totals.items() if mode != "none"}
    common = dict(bench=BENCH, touched_fraction=touched, rows=rows, dim=dim,
                  optimizer="adagrad", steps=run_steps, checkpoint_every=every,
                  repeats=repeats, compute_ms=compute_ms,
                  step_ms_without=base / run_steps * 1e3)
    # value / baseline pairs: incremental vs full (blocking), then each background mode vs
    # its blocking twin.
    for value, baseline in (("incremental", "full"), ("background", "incremental"),
                            ("background_full", "full")):
        v, b = stall[value], stall[baseline]
        emit(metric="stall_ms", value=v, unit="ms", baseline=b,
             ratio=v / b if b > 0 else None, config=value, baseline_config=baseline,
             **common)


def _restore_all(num_shards: int, restore: list[str] | None,
                 dirs: list[str]) -> tuple[float, list[Any]]:
    from torchrec_bagpipe.ps import PSShard

    t0 = time.perf_counter()
    shards = [PSShard(shard_id=i, num_shards=num_shards,
                      restore=restore if restore is not None else dirs[i])
              for i in range(num_shards)]
    return time.perf_counter() - t0, shards


def run_resume(rows: int, dim: int, repeats: int, work: Path, verify: bool) -> None:
    """A set of K shards restored onto K' (2 -> 1, 1 -> 2) vs onto K."""
    from torchrec_bagpipe.ps import PSClient, PSShard

    keys = torch.arange(rows, dtype=torch.int64)
    for k_from, k_to in ((2, 1), (1, 2)):
        shards = [PSShard(shard_id=i, num_shards=k_from, checkpoint_dir=work / f"k{k_from}-{i}")
                  for i in range(k_from)]
        with PSClient(shards, table="t", dim=dim, lr=0.01, init="uniform", init_bound=0.01,
                      optimizer="adagrad", timeout=600.0) as c:
            g = torch.Generator().manual_seed(k_from)
            for i in range(0, rows, 1 << 17):
                k = keys[i:i + (1 << 17)]
                c.commit(i >> 17, k, torch.randn(k.numel(), dim, generator=g))
            c.checkpoint(label="set")
            want = c.lookup(keys, with_state=True) if verify else None
        for s in shards:
            s.close()
        dirs = [str(work / f"k{k_from}-{i}" / "set") for i in range(k_from)]
        same_t, reshard_t = [], []
        for rep in range(repeats):
            for mode in ("same", "reshard") if rep % 2 == 0 else ("reshard", "same"):
                if mode == "same":
                    t, restored = _restore_all(k_from, None, dirs)
                    same_t.append(t)
                else:
                    t, restored = _restore_all(k_to, dirs, dirs)
                    reshard_t.append(t)
                    if verify and rep == 0:
                        with PSClient(restored, table="t", dim=dim, lr=0.01, init="uniform",
                                      init_bound=0.01, optimizer="adagrad",
                                      expected_step=restored[0].restored["t"]) as c:
                            assert torch.equal(c.lookup(keys, with_state=True), want)
                for s in restored:
                    s.close()
        value, base = statistics.median(reshard_t), statistics.median(same_t)
        emit(metric="restore_s", value=value, unit="s", baseline=base, ratio=value / base,
             config="reshard", bench=BENCH, shards_from=k_from, shards_to=k_to, rows=rows,
             dim=dim, optimizer="adagrad", repeats=repeats, bitwise_equal=verify)
        for d in work.iterdir():
            shutil.rmtree(d)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5, help="checkpoints per fraction")
    p.add_argument("--fractions", type=float, nargs="*", default=[0.01, 0.1, 0.5])
    p.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--no-verify", action="store_true", help="skip the bitwise comparison")
    p.add_argument("--stall-steps", type=int, default=60)
    p.add_argument("--stall-every", type=int, default=10)
    p.add_argument("--stall-repeats", type=int, default=3)
    p.add_argument("--stall-compute-ms", type=float, default=5.0,
                   help="the trainer's step between a get and its commit (a sleep: off-CPU)")
    p.add_argument("--parts", nargs="*", choices=("fractions", "stall", "resume"),
                   default=["fractions", "stall", "resume"], help="what to measure")
    p.add_argument("--quick", action="store_true", help="100k rows, 3 rounds")
    args = p.parse_args()
    if args.quick:
        args.rows, args.rounds, args.stall_steps, args.stall_repeats = 100_000, 3, 30, 3
    root = Path(tempfile.mkdtemp(prefix="bagpipe-ckbench-", dir=args.dir))
    try:
        for i, fraction in enumerate(args.fractions if "fractions" in args.parts else []):
            work = root / f"f{i}"
            work.mkdir()
            run_fraction(args.rows, args.dim, fraction, args.rounds, work,
                         not args.no_verify, seed=i)
            shutil.rmtree(work)
        if "stall" in args.parts:
            work = root / "stall"
            work.mkdir()
            run_stall(args.rows, args.dim, args.stall_steps, args.stall_every,
                      args.stall_repeats, work, seed=99, compute_ms=args.stall_compute_ms)
        if "resume" in args.parts:
            work = root / "resume"
            work.mkdir()
            run_resume(args.rows, args.dim, 3, work, not args.no_verify)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
