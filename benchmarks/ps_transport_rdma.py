"""PS transport benchmark for the rdma (UCX) backend, next to local and tcp.

One JSON line per result: get and commit throughput (rows/s and GB/s) for dim 32 and 128 and
1 and 2 shards, the round trip of an empty commit, and per-step transport counters (packets
written, one-sided writes, doorbells, ACK waits) — over ``local``, ``tcp``, ``rdma-sm``
(UCX_TLS=sm: frames written one-sided into the shard's registered slots, then flush +
doorbell) and ``rdma-tcp`` (UCX_TLS=tcp: frames carried by doorbells). Every throughput line
carries the same in-run raw baseline as the tcp benchmark — raw loopback TCP socket bandwidth
(GB/s) measured in this run — and the ratio to it; round trips are compared with a raw TCP
ping-pong. A link model (latency + bytes / bandwidth, bounded in-flight window; presets
``100Gb-RDMA`` and ``25GbE-TCP``) turns each configuration's counters into the step time it
predicts on a real fabric (``model_*`` lines).

Usage: python benchmarks/ps_transport_rdma.py [--quick] [--transports local,tcp,rdma-sm,rdma-tcp]
       python benchmarks/ps_transport_rdma.py --ucx-endpoints nodeB:7000,nodeC:7000  (a fabric)
Shards and clients share this machine's cores: compare ratios, not absolute numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from torchrec_bagpipe.ps import PSClient, PSShard, rdma

BENCH = "ps_transport"
LINKS = {  # name: (round trip seconds, bytes per second)
    "100Gb-RDMA": (3e-6, 12.5e9),
    "25GbE-TCP": (25e-6, 25e9 / 8),
}


def emit(**fields: Any) -> None:
    print(json.dumps(fields, sort_keys=False), flush=True)


def median_time(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up (connections, pools, registration caches)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---- raw baselines --------------------------------------------------------------------------

def raw_tcp_bandwidth(total: int, chunk: int = 4 << 20, repeats: int = 3) -> float:
    """Loopback TCP socket bandwidth in bytes/s (one sender thread, one receiver)."""
    def once() -> float:
        srv = socket.create_server(("127.0.0.1", 0))
        port = srv.getsockname()[1]
        buf = bytearray(chunk)

        def sink() -> None:
            conn, _ = srv.accept()
            view = memoryview(bytearray(chunk))
            got = 0
            while got < total:
                n = conn.recv_into(view)
                if n == 0:
                    break
                got += n
            conn.sendall(b"k")
            conn.close()

        th = threading.Thread(target=sink)
        th.start()
        c = socket.create_connection(("127.0.0.1", port))
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        sent = 0
        while sent < total:
            c.sendall(buf)
            sent += chunk
        c.recv(1)
        dt = time.perf_counter() - t0
        th.join()
        c.close()
        srv.close()
        return sent / dt

    return statistics.median(once() for _ in range(repeats))


def raw_tcp_pingpong(iters: int) -> float:
    """Median round trip of a 64-byte message over loopback TCP, seconds."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def echo() -> None:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            d = conn.recv(64)
            if not d:
                break
            conn.sendall(d)
        conn.close()

    th = threading.Thread(target=echo)
    th.start()
    c = socket.create_connection(("127.0.0.1", port))
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg = b"x" * 64
    rtts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        c.sendall(msg)
        got = 0
        while got < 64:
            got += len(c.recv(64 - got))
        rtts.append(time.perf_counter() - t0)
    c.close()
    th.join()
    srv.close()
    return statistics.median(rtts)


# ---- PS set-ups ---------------------------------------------------------------------------

class Setup:
    """`shards` PS shards reached over `transport`, and one client (rank 0 of 1)."""

    def __init__(self, transport: str, shards: int, dim: int, keys: int, window: int,
                 packet_rows: int, remote: list[str] | None = None) -> None:
        self.transport = transport
        self.shards = [] if remote else [PSShard(i, shards) for i in range(shards)]
        if remote:  # shard servers started elsewhere (a real fabric): --ucx-endpoints
            endpoints = [rdma.rdma_endpoint(a) for a in remote]
        elif transport == "local":
            endpoints: list[Any] = list(self.shards)
        elif transport == "tcp":
            endpoints = [s.serve(job_token="bench").address for s in self.shards]
        elif transport.startswith("rdma"):
            rdma.require_rdma()
            if transport.startswith("rdma-"):  # rdma-sm, rdma-tcp; plain rdma: UCX_TLS as set
                os.environ["UCX_TLS"] = transport.split("-", 1)[1]
            endpoints = [s.serve_ucx(job_token="bench").address for s in self.shards]
        else:
            raise ValueError(f"unknown transport {transport!r}")
        # A table of its own per configuration and run: remote servers outlive the run.
        table = f"bench_{os.getpid()}_{int(time.time())}_d{dim}_s{shards}"
        self.client = PSClient(
            endpoints, table=table, dim=dim, lr=0.01, job_token="bench", timeout=120.0,
            init="uniform", init_bound=0.05, key_bound=keys, max_packet_rows=packet_rows,
            inflight_packets=window,
        )

    def counters(self) -> dict[str, int]:
        out = {"frames": 0, "bytes": 0, "one_sided_writes": 0, "doorbells": 0, "ack_waits": 0}
        for ch in self.client.channel_stats():
            out["frames"] += ch["frames_sent"]
            out["bytes"] += ch["bytes_sent"] + ch["bytes_received"]
            out["one_sided_writes"] += ch["one_sided_writes"]
            out["doorbells"] += ch["doorbells"]
            out["ack_waits"] += ch["slot_waits"]
        return out

    def close(self) -> None:
        self.client.close()
        for s in self.shards:
            s.close()


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


# ---- measurements ------------------------------------------------------------------------

def bench_config(transport: str, shards: int, dim: int, rows: int, repeats: int, window: int,
                 packet_rows: int, raw_bw: float, raw_rtt: float, rtt_iters: int,
                 remote: list[str] | None = None) -> None:
    keys_total = rows * 4
    st = Setup(transport, shards, dim, keys_total, window, packet_rows, remote)
    try:
        g = torch.Generator().manual_seed(dim * 7 + shards)
        keys = torch.randperm(keys_total, generator=g)[:rows].contiguous()
        grads = torch.randn(rows, dim, generator=g)
        common = dict(bench=BENCH, transport=transport, dim=dim, shards=shards, rows=rows,
                      threads=1, window=window, packet_rows=packet_rows)
        # Seed the rows so that gets read stored values.
        st.client.assign(keys, torch.zeros(rows, dim))
        row_bytes = dim * 4 + 8  # payload per row: the fp32 row plus its int64 key
        # get
        out = torch.empty(rows, dim)
        t = median_time(lambda: st.client.get_async(keys, -1, out=out).wait(), repeats)
        rps = rows / t
        emit(metric="get_rows_per_s", value=rps, unit="rows/s", baseline=raw_bw / row_bytes,
             ratio=rps / (raw_bw / row_bytes), **common)
        emit(metric="get_gb_per_s", value=rps * dim * 4 / 1e9, unit="GB/s", baseline=raw_bw / 1e9,
             ratio=rps * dim * 4 / raw_bw, **common)
        # commit (counters per step from the channel stats)
        step = [0]
        before = st.counters()

        def one_commit() -> None:
            st.client.commit(step[0], keys, grads)
            step[0] += 1

        t = median_time(one_commit, repeats)
        after = st.counters()
        nsteps = step[0]
        per = {k: (after[k] - before[k]) / nsteps for k in after}
        rps = rows / t
        emit(metric="commit_rows_per_s", value=rps, unit="rows/s", baseline=raw_bw / row_bytes,
             ratio=rps / (raw_bw / row_bytes), **common)
        emit(metric="commit_gb_per_s", value=rps * row_bytes / 1e9, unit="GB/s",
             baseline=raw_bw / 1e9, ratio=rps * row_bytes / raw_bw, **common)
        for name, unit in (("frames", "packets/step"), ("one_sided_writes", "writes/step"),
                           ("doorbells", "doorbells/step"), ("ack_waits", "waits/step")):
            emit(metric=f"commit_{name}_per_step", value=per[name], unit=unit, baseline=None,
                 ratio=None, **common)
        # empty commit round trip vs a raw ping-pong
        def empty() -> None:
            st.client.commit(step[0], keys[:0], grads[:0])
            step[0] += 1

        rtt = median_time(empty, rtt_iters)
        emit(metric="empty_commit_rtt_us", value=rtt * 1e6, unit="us", baseline=raw_rtt * 1e6,
             ratio=rtt / raw_rtt, **common)
        # What the link model predicts for this step's counters on a real fabric (there, the
        # rdma backend writes frames one-sided: RC verbs have native RMA).
        for link in LINKS:
            if link.endswith("RDMA") != transport.startswith("rdma"):
                continue
            secs = model_step_seconds(link, per["frames"], per["bytes"], window, shards,
                                      one_sided=transport.startswith("rdma"))
            emit(metric="model_commit_rows_per_s", value=rows / secs, unit="rows/s",
                 baseline=LINKS[link][1] / row_bytes,
                 ratio=(rows / secs) / (LINKS[link][1] / row_bytes), link=link, **common)
    finally:
        st.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repeats (< 60 s)")
    ap.add_argument("--transports", default="local,tcp,rdma-sm,rdma-tcp")
    ap.add_argument("--window", type=int, default=8, help="inflight_packets per shard")
    ap.add_argument("--packet-rows", type=int, default=4096, help="max_packet_rows")
    ap.add_argument("--ucx-endpoints", default="",
                    help="host:port,... of running `torchrec-bagpipe-ps --transport rdma "
                         "--job-token bench` servers (a real fabric); measures transport 'rdma' "
                         "against them instead of in-process shards")
    args = ap.parse_args()
    repeats = 3 if args.quick else 7
    transports = [t for t in args.transports.split(",") if t]
    remote = [a for a in args.ucx_endpoints.split(",") if a]
    if remote:
        transports = ["rdma"]
    if not rdma.HAVE_UCX:
        dropped = [t for t in transports if t.startswith("rdma")]
        transports = [t for t in transports if not t.startswith("rdma")]
        if dropped:
            emit(bench=BENCH, metric="note", value=0, unit="", baseline=None, ratio=None,
                 note=f"{dropped} not measured: this build has no UCX")
    raw_bw = raw_tcp_bandwidth(64 << 20 if args.quick else 512 << 20)
    raw_rtt = raw_tcp_pingpong(200 if args.quick else 2000)
    emit(bench=BENCH, metric="raw_tcp_gb_per_s", value=raw_bw / 1e9, unit="GB/s",
         baseline=raw_bw / 1e9, ratio=1.0, transport="raw")
    emit(bench=BENCH, metric="raw_tcp_rtt_us", value=raw_rtt * 1e6, unit="us",
         baseline=raw_rtt * 1e6, ratio=1.0, transport="raw")
    for transport in transports:
        for dim in (32, 128):
            rows = (1 << 16) if dim == 32 else (1 << 14)
            if not args.quick:
                rows *= 4
            for shards in ((len(remote),) if remote else (1, 2)):
                bench_config(transport, shards, dim, rows, repeats, args.window,
                             args.packet_rows, raw_bw, raw_rtt, 50 if args.quick else 500,
                             remote or None)


if __name__ == "__main__":
    main()
