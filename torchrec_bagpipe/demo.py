"""`python -m torchrec_bagpipe.demo`: the parameter server's storage engine alone, end to end.

Loads a table into an EmbeddingStore, runs synthetic SGD steps (Zipf-distributed keys, as in
recommendation traffic) under a DRAM budget small enough that cold pages spill to disk,
checkpoints, restores, and verifies every row bit for bit against a plain numpy replay of
the same updates. (`make demo` trains the DLRM example through BagPipe instead.)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from torchrec_bagpipe.ps import EmbeddingStore
from torchrec_bagpipe.ps.store import SpillWarning


def zipf_keys(rng: np.random.Generator, num_keys: int, n: int, perm: np.ndarray) -> np.ndarray:
    """n keys: Zipf(1.05) ranks over the table, scattered by a fixed permutation."""
    ranks = rng.zipf(1.05, size=4 * n)
    ranks = ranks[ranks <= num_keys][:n]
    while ranks.size < n:  # rare: refill the tail
        more = rng.zipf(1.05, size=n)
        ranks = np.concatenate([ranks, more[more <= num_keys]])[:n]
    return perm[ranks - 1]


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=500_000, help="table rows")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--steps", type=int, default=200, help="SGD steps")
    p.add_argument("--batch", type=int, default=4096, help="keys per step")
    p.add_argument("--budget-fraction", type=float, default=0.25, help="DRAM budget / table")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args(argv)

    rng = np.random.default_rng(0)
    n, dim = args.rows, args.dim
    row_bytes = dim * 4
    budget = max(1 << 20, int(n * row_bytes * args.budget_fraction))
    work = Path(tempfile.mkdtemp(prefix="bagpipe-demo-"))
    print(f"table: {n:,} rows x dim {dim} ({_mib(n * row_bytes)}), DRAM budget {_mib(budget)}")

    # 1. Load a table (as a trainer or converter would push initial weights).
    weights = rng.uniform(-0.01, 0.01, size=(n, dim)).astype(np.float32)
    store = EmbeddingStore(
        dim=dim,
        num_threads=args.threads,
        init="zeros",
        memory_budget=budget,
        spill_dir=work / "spill",
        page_rows=1024,
    )
    store.reserve(n)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SpillWarning)
        for i in range(0, n, 65536):
            store.assign(
                torch.arange(i, min(n, i + 65536)), torch.from_numpy(weights[i : i + 65536])
            )
        print(f"loaded in {time.perf_counter() - t0:.2f} s")

        # 2. Synthetic SGD steps; the numpy replay below is the reference.
        perm = rng.permutation(n).astype(np.int64)
        reference = weights.copy()
        lr = np.float32(args.lr)
        t_sgd = 0.0
        for _ in range(args.steps):
            keys = zipf_keys(rng, n, args.batch, perm)
            grads = rng.standard_normal((args.batch, dim)).astype(np.float32)
            t0 = time.perf_counter()
            store.apply_sgd(torch.from_numpy(keys), torch.from_numpy(grads), args.lr)
            t_sgd += time.perf_counter() - t0
            uniq, inverse = np.unique(keys, return_inverse=True)
            acc = np.zeros((uniq.size, dim), dtype=np.float32)
            np.add.at(acc, inverse, grads)  # in input order, like the store
            reference[uniq] = reference[uniq] - acc * lr
        rate = args.steps * args.batch / t_sgd / 1e6
        print(f"{args.steps} SGD steps of {args.batch} keys: {rate:.1f} M rows/s")
    for w in caught:
        print(f"warning: {w.message}")
    st = store.stats()
    print(
        f"spill: {st['pages_spilled']}/{st['pages']} pages on disk ({_mib(st['bytes_spilled'])}), "
        f"{st['swap_outs']} swap-outs, {st['swap_ins']} swap-ins, resident arena "
        f"{_mib(st['bytes_resident'] - st['bytes_maps'])} <= budget {_mib(budget)}"
    )

    # 3. Checkpoint, restore (without a budget), verify.
    t0 = time.perf_counter()
    store.save(work / "checkpoint", meta={"step": str(args.steps)})
    print(f"checkpoint saved in {time.perf_counter() - t0:.2f} s")
    restored = EmbeddingStore.load(work / "checkpoint", num_threads=args.threads)
    print(f"restored {len(restored):,} rows, meta {restored.meta}")
    got = restored.lookup(torch.arange(n), insert_missing=False).numpy()
    same = np.array_equal(got.view(np.uint32), reference.view(np.uint32))
    live = np.array_equal(
        store.lookup(torch.arange(n), insert_missing=False).numpy().view(np.uint32),
        reference.view(np.uint32),
    )
    print(f"verify: restored == numpy replay bitwise: {same}; spilled store == replay: {live}")

    print("stats:", {k: v for k, v in restored.stats().items() if v})
    return 0 if same and live else 1


if __name__ == "__main__":
    sys.exit(main())
