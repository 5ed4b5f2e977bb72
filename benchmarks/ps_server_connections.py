"""What idle connections cost a PS shard server: its threads and resident memory.

A `torchrec-bagpipe-ps` process is measured idle (the in-run baseline), then holding N idle
connections (default 1,000) of each kind:

* ``authenticated``: connections that said Hello with the job token and then stay silent
  (trainers between steps);
* ``unauthenticated``: connections that never send a byte (held because the server is
  started with ``--max-unauthenticated`` and ``--max-unauthenticated-per-host`` above N and
  a long ``--handshake-timeout``; with the defaults they would be shed).

Prints one JSON line per result:
  {"bench", "metric", "value", "unit", "baseline", "ratio", "threads", "transport",
   "connections", "kind", "target"}
``threads``: the server process's thread count (value) against the idle server's (baseline);
``rss_above_idle_mib``: its resident memory above the idle server's, in MiB (baseline: the
idle RSS). Targets: fewer than 64 threads and less than 64 MiB above idle. Medians over
repeats (each repeat a fresh server). With ``--transports tcp,rdma`` the UCX server is
measured too: ``unauthenticated`` connections that never finish the bootstrap, and
``--rdma-connections`` (default 100) established UCX connections (PS clients of this
process, each with its own UCP worker on the server, all driven by the server's
``--progress-threads``).

Usage: python benchmarks/ps_server_connections.py [--quick] [--connections N] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchrec_bagpipe._native import C
from torchrec_bagpipe.ps import rdma, spawn_server

BENCH = "ps_server_connections"
TOKEN = "bench-token"
MIB = 1 << 20


def emit(**fields: Any) -> None:
    print(json.dumps({"bench": BENCH, **fields}), flush=True)


def _digest(token: str) -> int:
    """wire.h TokenDigest: FNV-1a then fmix64 (every frame of a connection carries it)."""
    mask = (1 << 64) - 1
    h = 0xCBF29CE484222325
    for c in token.encode():
        h = ((h ^ c) * 0x100000001B3) & mask
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & mask
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & mask
    return h ^ (h >> 33)


_MAGIC, _HELLO, _HELLO_OK = 0x31535042, 1, 2
_HEADER = struct.Struct("<IHHIiQQQ")  # wire.h FrameHeader: magic, version, type, slot, status, ...


def _hello(token: str) -> bytes:
    t = token.encode()
    body = struct.pack("<II", len(t), 0) + t
    return _HEADER.pack(_MAGIC, C.PROTOCOL_VERSION, _HELLO, 0, 0, 0, _digest(token),
                        len(body)) + body


def _proc(pid: int) -> tuple[int, int]:
    """(threads, RSS bytes) of a process, from /proc."""
    threads = rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                threads = int(line.split()[1])
            elif line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return threads, rss


def _settle(pid: int, seconds: float = 1.0) -> tuple[int, int]:
    time.sleep(seconds)
    return _proc(pid)


def _open(address: tuple[str, int], n: int, hello: bytes | None) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(address, timeout=30)
        if hello is not None:
            s.sendall(hello)
        socks.append(s)
    if hello is not None:
        for s in socks:  # HelloOk: every connection authenticated
            head = b""
            while len(head) < 40:
                chunk = s.recv(40 - len(head))
                if not chunk:
                    raise RuntimeError("the server closed an authenticated connection")
                head += chunk
            _, _, kind, _, status, *_ = _HEADER.unpack(head)
            if kind != _HELLO_OK or status != 0:
                raise RuntimeError(f"the server refused a Hello (frame type {kind}, status "
                                   f"{status})")
    return socks


def _open_ucx_clients(address: str, n: int) -> list[Any]:
    from torchrec_bagpipe.ps import PSClient

    return [PSClient([f"ucx://{address}"], table=f"t{i}", dim=4, lr=0.5, init="zeros",
                     job_token=TOKEN, inflight_packets=2, max_packet_rows=64)
            for i in range(n)]


def measure(transport: str, kind: str, n: int) -> tuple[int, int, int, int]:
    """(idle threads, idle RSS, threads with n connections, RSS with n connections)."""
    args = ["--quiet", "--max-connections", str(n + 64), "--max-unauthenticated", str(n + 64),
            "--max-unauthenticated-per-host", str(n + 64), "--handshake-timeout", "600"]
    if transport == "rdma":
        args += ["--transport", "rdma"]
    server = spawn_server(0, 1, job_token=TOKEN, args=args)
    try:
        idle_threads, idle_rss = _settle(server.pid)
        address = (server.host, server.port)
        clients: list[Any] = []
        socks: list[socket.socket] = []
        try:
            if transport == "rdma" and kind == "authenticated":
                clients = _open_ucx_clients(server.address, n)
            else:
                socks = _open(address, n, _hello(TOKEN) if kind == "authenticated" else None)
            threads, rss = _settle(server.pid)
            if server.poll() is not None:
                raise RuntimeError("the server exited")
        finally:
            for s in socks:
                s.close()
            for c in clients:
                c.close()
    finally:
        server.terminate(60)
    return idle_threads, idle_rss, threads, rss


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one repeat")
    p.add_argument("--connections", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--transports", default="tcp", help="comma-separated: tcp, rdma")
    p.add_argument("--rdma-connections", type=int, default=100,
                   help="established UCX connections measured with --transports rdma")
    args = p.parse_args()
    repeats = 1 if args.quick else args.repeats
    for transport in args.transports.split(","):
        if transport == "rdma" and not rdma.HAVE_UCX:
            emit(metric="skipped", value=None, unit=None, baseline=None, ratio=None,
                 transport=transport, reason="this build has no UCX")
            continue
        for kind in ("authenticated", "unauthenticated"):
            n = args.rdma_connections if (transport, kind) == ("rdma", "authenticated") \
                else args.connections
            runs = [measure(transport, kind, n) for _ in range(repeats)]
            idle_threads = statistics.median(r[0] for r in runs)
            idle_rss = statistics.median(r[1] for r in runs)
            threads = statistics.median(r[2] for r in runs)
            above = statistics.median((r[3] - r[1]) / MIB for r in runs)
            common = {"transport": transport, "connections": n, "kind": kind,
                      "threads": threads, "repeats": repeats}
            emit(metric="threads", value=threads, unit="threads", baseline=idle_threads,
                 ratio=round(threads / idle_threads, 3), target="< 64", **common)
            emit(metric="rss_above_idle_mib", value=round(above, 2), unit="MiB",
                 baseline=round(idle_rss / MIB, 2),
                 ratio=round((idle_rss / MIB + above) / (idle_rss / MIB), 3), target="< 64",
                 **common)
    return 0


if __name__ == "__main__":
    sys.exit(main())
