"""PS transport throughput and latency, against raw loopback baselines measured in the same run.

Prints one JSON line per result:
  {"bench", "metric", "value", "unit", "baseline", "ratio", "threads", "dim", "transport", ...}

* get / commit throughput (rows/s and GB/s of row payload) for dim 32 and 128, 1 and 2 shards,
  over the local (in-process) and tcp transports, and rdma (UCX) over shared memory
  (``rdma-sm``: packets written one-sided into the shard's registered slots, a flush and a
  doorbell per batch) and over TCP (``rdma-tcp``: packets carried by their doorbells);
  baseline: one raw TCP stream on 127.0.0.1 (same machine, same run) moving the same bytes,
  at its best write size of 256 KiB, 1 MiB and 4 MiB; ratio = transport GB/s / raw GB/s.
* empty-commit round trip (a W=1 step with no rows: chunk, ACK, commit notification)
  against a raw TCP ping-pong of the same frame sizes; ratio = raw / transport (1 = as fast).
* per step: packets (writes), bytes and ACK waits (times the window of in-flight packets was
  full); for rdma also one_sided_writes and doorbells.
* context: the shard's own store read / SGD rate for the same rows (an EmbeddingStore in this
  process), and ``bound_gbps``: what a pipeline that must both move the bytes over loopback
  and read/update them in the store would reach if the two ran one after the other (a serial
  estimate, not a hard cap): 1 / (1/raw + 1/store) for tcp and rdma
  and the store rate for local; ``ratio_vs_bound`` = transport / bound.

The tcp shards run in this process on the server's native threads (the same code as the
`torchrec-bagpipe-ps` program); client and shard therefore share the machine's cores, as they
do when a trainer hosts its shard. Medians over repeats. ``--quick`` finishes in under 60 s.

Usage: python benchmarks/ps_transport.py [--quick] [--rows N] [--repeats R] [--transports tcp]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchrec_bagpipe.ps import EmbeddingStore, PSClient, PSShard, rdma
from torchrec_bagpipe.testing import _C_testing as tools

GB = 1e9


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


# Write sizes the raw stream tries; it is reported at its best (the baseline's best
# configuration: small writes pay a syscall each, very large ones overrun the socket buffers).
RAW_WRITE_BYTES = (256 << 10, 1 << 20, 4 << 20)


def raw_gbps(nbytes: int, repeats: int) -> float:
    """GB/s of one raw loopback TCP stream moving nbytes: the median over repeats for each
    write size in RAW_WRITE_BYTES (interleaved), the best of those."""
    secs: dict[int, list[float]] = {w: [] for w in RAW_WRITE_BYTES}
    for _ in range(repeats):
        for w in RAW_WRITE_BYTES:
            secs[w].append(tools.raw_loopback_seconds(nbytes, w))
    return max(nbytes / statistics.median(v) / GB for v in secs.values())


def store_gbps(keys: torch.Tensor, dim: int, repeats: int) -> tuple[float, float]:
    """(read, sgd) GB/s of an in-process EmbeddingStore on the same rows."""
    rows = keys.shape[0]
    store = EmbeddingStore(dim=dim, init="zeros")
    store.assign(keys, torch.zeros(rows, dim))
    out = torch.empty(rows, dim)
    grads = torch.randn(rows, dim)
    reads, sgds = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        store.lookup(keys, out=out, insert_missing=False)
        reads.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        store.apply_sgd(keys, grads, 0.01)
        sgds.append(time.perf_counter() - t0)
    payload = rows * dim * 4
    return payload / statistics.median(reads) / GB, payload / statistics.median(sgds) / GB


def bound(transport: str, raw: float, store: float) -> float:
    return store if transport == "local" else 1.0 / (1.0 / raw + 1.0 / store)


def make_job(transport: str, shards: int, dim: int, max_rows: int, window: int
             ) -> tuple[PSClient, list[PSShard], list[Any]]:
    shard_objs = [PSShard(shard_id=i, num_shards=shards) for i in range(shards)]
    servers: list[Any] = []
    if transport == "local":
        endpoints: list[Any] = shard_objs
    elif transport.startswith("rdma-"):  # rdma-sm / rdma-tcp: UCX over that UCX_TLS
        os.environ["UCX_TLS"] = transport.split("-", 1)[1]
        servers = [s.serve_ucx(host="127.0.0.1", port=0, job_token="bench") for s in shard_objs]
        endpoints = [srv.address for srv in servers]
    else:
        servers = [s.serve(host="127.0.0.1", port=0, job_token="bench") for s in shard_objs]
        endpoints = [srv.address for srv in servers]
    client = PSClient(endpoints, table="bench", dim=dim, lr=0.01, init="zeros",
                      partitioner="modulo", max_packet_rows=max_rows, inflight_packets=window,
                      job_token="bench", timeout=120.0)
    return client, shard_objs, servers


def close_job(client: PSClient, servers: list[Any]) -> None:
    client.close()
    for s in servers:
        s.stop()


def counters(client: PSClient) -> dict[str, int]:
    """The client's counters plus the rdma transport's (summed over shards)."""
    c = dict(client.stats())
    channels = client.channel_stats()
    c["one_sided_writes"] = sum(ch["one_sided_writes"] for ch in channels)
    c["doorbells"] = sum(ch["doorbells"] for ch in channels)
    return c


def per_step(before: dict[str, int], after: dict[str, int], steps: int) -> dict[str, float]:
    keys = ["packets", "bytes_sent", "ack_waits"]
    if "one_sided_writes" in before:
        keys += ["one_sided_writes", "doorbells"]
    return {k: (after[k] - before[k]) / steps for k in keys}


def bench_throughput(transport: str, shards: int, dim: int, rows: int, repeats: int,
                     raw: dict[int, float], stores: dict[tuple[int, int], tuple[float, float]],
                     max_rows: int, window: int) -> None:
    client, _, servers = make_job(transport, shards, dim, max_rows, window)
    try:
        keys = torch.randperm(rows * 4, generator=torch.Generator().manual_seed(dim))[:rows]
        grads = torch.randn(rows, dim)
        client.assign(keys, torch.zeros(rows, dim))  # materialise the rows once
        payload = rows * dim * 4
        base = raw[payload]
        read_gbps, sgd_gbps = stores[(rows, dim)]
        common = {"threads": 1, "dim": dim, "transport": transport, "shards": shards,
                  "rows": rows, "max_packet_rows": max_rows, "inflight_packets": window,
                  "baseline_unit": "GB/s (raw loopback TCP stream)"}

        out = torch.empty(rows, dim)
        client.get_async(keys, -1, out=out).wait()  # warm-up
        times = []
        before = counters(client)
        for _ in range(repeats):
            t0 = time.perf_counter()
            client.get_async(keys, -1, out=out).wait()
            times.append(time.perf_counter() - t0)
        counts = per_step(before, counters(client), repeats)
        t = statistics.median(times)
        emit(bench="ps_transport", metric="get_rows_per_s", value=rows / t, unit="rows/s",
             baseline=None, ratio=None, **common)
        cap = bound(transport, base, read_gbps)
        emit(bench="ps_transport", metric="get_gbps", value=payload / t / GB, unit="GB/s",
             baseline=base, ratio=payload / t / GB / base, bound_gbps=cap,
             ratio_vs_bound=payload / t / GB / cap, **common, **counts)

        times = []
        before = counters(client)
        for step in range(repeats + 1):
            t0 = time.perf_counter()
            client.commit_async(step, keys, grads).wait()
            if step > 0:  # step 0 was the warm-up
                times.append(time.perf_counter() - t0)
        counts = per_step(before, counters(client), repeats + 1)
        t = statistics.median(times)
        emit(bench="ps_transport", metric="commit_rows_per_s", value=rows / t, unit="rows/s",
             baseline=None, ratio=None, **common)
        cap = bound(transport, base, sgd_gbps)
        emit(bench="ps_transport", metric="commit_gbps", value=payload / t / GB, unit="GB/s",
             baseline=base, ratio=payload / t / GB / base, bound_gbps=cap,
             ratio_vs_bound=payload / t / GB / cap, **common, **counts,
             note="includes the shard's SGD on every row")
    finally:
        close_job(client, servers)


def bench_round_trip(transport: str, iterations: int) -> None:
    """Empty-commit round trips, interleaved in blocks with raw ping-pongs so both see the
    same machine load (medians over all blocks)."""
    client, _, servers = make_job(transport, 1, 32, 4096, 8)
    try:
        empty_k = torch.zeros(0, dtype=torch.int64)
        empty_g = torch.zeros(0, 32)
        client.commit(0, empty_k, empty_g)
        times: list[float] = []
        raw: list[float] = []
        blocks = 10
        step = 1
        before = counters(client)
        for _ in range(blocks):
            raw.extend(tools.raw_pingpong_seconds(iterations // blocks, 88))
            for _ in range(iterations // blocks):
                t0 = time.perf_counter()
                client.commit_async(step, empty_k, empty_g).wait()
                times.append(time.perf_counter() - t0)
                step += 1
        counts = per_step(before, counters(client), step - 1)
        us = statistics.median(times) * 1e6
        raw_us = statistics.median(raw) * 1e6
        emit(bench="ps_transport", metric="empty_commit_round_trip_us", value=us, unit="us",
             baseline=raw_us, ratio=raw_us / us, threads=1, dim=32, transport=transport,
             shards=1, baseline_unit="us (raw TCP ping-pong of 88-byte frames, interleaved)",
             **counts)
    finally:
        close_job(client, servers)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a CI-sized run (under 60 s)")
    p.add_argument("--rows", type=int, default=None, help="rows per get / commit batch")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--max-packet-rows", type=int, default=4096)
    p.add_argument("--inflight-packets", type=int, default=8)
    p.add_argument("--transports", default=None,
                   help="comma-separated subset of local,tcp,rdma-sm,rdma-tcp (default: all)")
    args = p.parse_args()
    rows = args.rows or (32768 if args.quick else 131072)
    repeats = args.repeats or (3 if args.quick else 7)
    dims = (32, 128)
    started = time.perf_counter()

    raw = {rows * d * 4: raw_gbps(rows * d * 4, repeats) for d in dims}
    for d in dims:
        emit(bench="ps_transport", metric="raw_loopback_gbps", value=raw[rows * d * 4],
             unit="GB/s", baseline=None, ratio=None, threads=1, dim=d, transport="raw-tcp",
             bytes=rows * d * 4)
    stores = {}
    for d in dims:
        keys = torch.randperm(rows * 4, generator=torch.Generator().manual_seed(d))[:rows]
        stores[(rows, d)] = store_gbps(keys, d, repeats)
        for metric, value in zip(("store_read_gbps", "store_sgd_gbps"), stores[(rows, d)]):
            emit(bench="ps_transport", metric=metric, value=value, unit="GB/s", baseline=None,
                 ratio=None, threads=1, dim=d, transport="in-process store", rows=rows)
    pings = tools.raw_pingpong_seconds(2000 if args.quick else 10000, 88)
    raw_us = statistics.median(pings) * 1e6
    emit(bench="ps_transport", metric="raw_pingpong_us", value=raw_us, unit="us", baseline=None,
         ratio=None, threads=1, transport="raw-tcp", msg_bytes=88)

    transports = ["local", "tcp"]
    if rdma.HAVE_UCX:
        transports += ["rdma-sm", "rdma-tcp"]
    else:
        emit(bench="ps_transport", metric="note", value=None, unit=None, baseline=None,
             ratio=None, note="rdma not measured: this build has no UCX")
    if args.transports:
        wanted = args.transports.split(",")
        unknown = set(wanted) - {"local", "tcp", "rdma-sm", "rdma-tcp"}
        if unknown:
            p.error(f"--transports: unknown {sorted(unknown)}")
        transports = [t for t in transports if t in wanted]
    for transport in transports:
        for shards in (1, 2):
            for d in dims:
                bench_throughput(transport, shards, d, rows, repeats, raw, stores,
                                 args.max_packet_rows, args.inflight_packets)
        bench_round_trip(transport, 500 if args.quick else 3000)
    emit(bench="ps_transport", metric="wall_seconds", value=time.perf_counter() - started,
         unit="s", baseline=None, ratio=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
