"""The rdma (UCX) transport on a real fabric, and what the link model predicts there.

`benchmarks/ps_transport.py` measures every transport (local, tcp, rdma over shared memory and
over TCP) on this machine against its raw loopback baselines. This script is the fabric side:

* ``--ucx-endpoints nodeB:7000,...``: get and commit throughput and the per-step counters
  (packets, one-sided writes, doorbells, ACK waits) against shard servers started elsewhere
  with ``torchrec-bagpipe-ps --transport rdma --job-token bench`` (set ``UCX_TLS`` /
  ``UCX_NET_DEVICES`` on both sides, e.g. ``rc,sm,self`` and ``mlx5_0:1``); baseline: the
  line rate of ``--link`` (not measured), ratio = measured / line rate.
* without it: the same measurements over in-process shards (``--transports``, default
  tcp,rdma-sm,rdma-tcp), baseline the in-run raw loopback TCP stream of ps_transport.py
  (at its best write size).
* either way, ``model_*`` lines: a link model (round trip + bytes / bandwidth; rounds of at
  most ``inflight_packets`` packets per shard; two round trips per round for one-sided writes:
  the flush that makes them visible, then doorbell + ACK) fed with the measured per-step
  counters predicts the step's throughput on the presets ``100Gb-RDMA`` (3 us, 12.5 GB/s) and
  ``25GbE-TCP`` (25 us, 3.125 GB/s); baseline: the preset's line rate.

One JSON line per result. Usage:
  python benchmarks/ps_rdma_fabric.py [--quick] [--transports tcp,rdma-sm,rdma-tcp]
  python benchmarks/ps_rdma_fabric.py --ucx-endpoints nodeB:7000,nodeC:7000 [--link 100Gb-RDMA]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ps_transport import raw_gbps  # the same raw loopback baseline

from torchrec_bagpipe.ps import PSClient, rdma, start_local_shards

BENCH = "ps_rdma_fabric"
GB = 1e9
LINKS = {  # name: (round trip seconds, bytes per second)
    "100Gb-RDMA": (3e-6, 12.5e9),
    "25GbE-TCP": (25e-6, 25e9 / 8),
}


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def median_time(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up (connections, pools, registration caches)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def model_step_seconds(link: str, packets: float, payload_bytes: float, window: int,
                       shards: int, one_sided: bool) -> float:
    """Bounded-window link model of one step: each shard's packets go in rounds of at most
    `window` in flight; a round costs a round trip (two for one-sided writes: the flush that
    makes the writes visible, then doorbell + ACK) plus its bytes at line rate; shards proceed
    in parallel on one client link, which also bounds the total bytes."""
    rtt, bw = LINKS[link]
    per_shard = packets / shards
    rounds = math.ceil(per_shard / window) if per_shard else 1
    rtt_eff = 2 * rtt if one_sided else rtt
    return max(payload_bytes / bw, rounds * rtt_eff + payload_bytes / shards / bw)


class Job:
    """`shards` shards over `transport` (in-process), or the servers at `remote` (rdma)."""

    def __init__(self, transport: str, shards: int, dim: int, keys: int, window: int,
                 packet_rows: int, remote: list[str]) -> None:
        self.shards = [] if remote else start_local_shards(shards)
        if remote:
            endpoints: list[Any] = [rdma.rdma_endpoint(a) for a in remote]
        elif transport == "tcp":
            endpoints = [s.serve(job_token="bench").address for s in self.shards]
        else:  # rdma-sm / rdma-tcp
            rdma.require_rdma()
            os.environ["UCX_TLS"] = transport.split("-", 1)[1]
            endpoints = [s.serve_ucx(job_token="bench").address for s in self.shards]
        # A table of its own per configuration and run: remote servers outlive the run.
        table = f"bench_{os.getpid()}_{int(time.time())}_d{dim}_s{shards}"
        self.client = PSClient(endpoints, table=table, dim=dim, lr=0.01, job_token="bench",
                               timeout=120.0, init="zeros", key_bound=keys,
                               max_packet_rows=packet_rows, inflight_packets=window)

    def counters(self) -> dict[str, int]:
        out = {"packets": 0, "bytes": 0, "one_sided_writes": 0, "doorbells": 0, "ack_waits": 0}
        for ch in self.client.channel_stats():
            out["packets"] += ch["frames_sent"]
            out["bytes"] += ch["bytes_sent"] + ch["bytes_received"]
            out["one_sided_writes"] += ch["one_sided_writes"]
            out["doorbells"] += ch["doorbells"]
            out["ack_waits"] += ch["slot_waits"]
        return out

    def close(self) -> None:
        self.client.close()
        for s in self.shards:
            s.close()


def bench(transport: str, shards: int, dim: int, rows: int, repeats: int, window: int,
          packet_rows: int, remote: list[str], baseline: float, baseline_unit: str) -> None:
    job = Job(transport, shards, dim, rows * 4, window, packet_rows, remote)
    try:
        g = torch.Generator().manual_seed(dim * 7 + shards)
        keys = torch.randperm(rows * 4, generator=g)[:rows].contiguous()
        grads = torch.randn(rows, dim, generator=g)
        job.client.assign(keys, torch.zeros(rows, dim))
        payload = rows * dim * 4
        common = {"transport": transport, "dim": dim, "shards": shards, "rows": rows,
                  "threads": 1, "inflight_packets": window, "max_packet_rows": packet_rows,
                  "baseline_unit": baseline_unit}
        out = torch.empty(rows, dim)
        t = median_time(lambda: job.client.get_async(keys, -1, out=out).wait(), repeats)
        emit(bench=BENCH, metric="get_gbps", value=payload / t / GB, unit="GB/s",
             baseline=baseline, ratio=payload / t / GB / baseline, rows_per_s=rows / t, **common)
        step = [0]

        def commit() -> None:
            job.client.commit(step[0], keys, grads)
            step[0] += 1

        before = job.counters()
        t = median_time(commit, repeats)
        after = job.counters()
        per = {k: (after[k] - before[k]) / step[0] for k in after}
        emit(bench=BENCH, metric="commit_gbps", value=payload / t / GB, unit="GB/s",
             baseline=baseline, ratio=payload / t / GB / baseline, rows_per_s=rows / t,
             note="includes the shard's SGD on every row", **common,
             **{f"{k}_per_step": v for k, v in per.items()})
        # What the link model predicts for these counters (on a fabric the rdma backend
        # writes one-sided: RC verbs have native RMA).
        for link, (_, bw) in LINKS.items():
            if link.endswith("RDMA") != transport.startswith("rdma"):
                continue
            secs = model_step_seconds(link, per["packets"], per["bytes"], window, shards,
                                      one_sided=transport.startswith("rdma"))
            emit(bench=BENCH, metric="model_commit_gbps", value=payload / secs / GB,
                 unit="GB/s", baseline=bw / GB, ratio=payload / secs / bw, link=link,
                 rows_per_s=rows / secs, **{**common, "baseline_unit": "GB/s (line rate)"})
    finally:
        job.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, few repeats (< 60 s)")
    ap.add_argument("--transports", default="tcp,rdma-sm,rdma-tcp")
    ap.add_argument("--inflight-packets", type=int, default=8)
    ap.add_argument("--max-packet-rows", type=int, default=4096)
    ap.add_argument("--ucx-endpoints", default="",
                    help="host:port,... of `torchrec-bagpipe-ps --transport rdma --job-token "
                         "bench` servers on a fabric")
    ap.add_argument("--link", default="100Gb-RDMA", choices=sorted(LINKS),
                    help="with --ucx-endpoints: the preset whose line rate is the baseline")
    args = ap.parse_args()
    repeats = 3 if args.quick else 7
    remote = [a for a in args.ucx_endpoints.split(",") if a]
    transports = ["rdma"] if remote else [t for t in args.transports.split(",") if t]
    if not rdma.HAVE_UCX:
        transports = [t for t in transports if not t.startswith("rdma")]
        emit(bench=BENCH, metric="note", value=None, unit=None, baseline=None, ratio=None,
             note="rdma not measured: this build has no UCX")
    for dim in (32, 128):
        rows = (1 << 15) if args.quick else (1 << 17)
        if remote:
            baseline, unit = LINKS[args.link][1] / GB, f"GB/s (line rate of {args.link})"
        else:
            nbytes = rows * dim * 4
            baseline, unit = raw_gbps(nbytes, repeats), "GB/s (raw loopback TCP)"
            emit(bench=BENCH, metric="raw_loopback_gbps", value=baseline, unit="GB/s",
                 baseline=None, ratio=None, dim=dim, transport="raw-tcp", bytes=nbytes)
        for transport in transports:
            for shards in ((len(remote),) if remote else (1, 2)):
                bench(transport, shards, dim, rows, repeats, args.inflight_packets,
                      args.max_packet_rows, remote, baseline, unit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
