"""Hostile clients for the server hardening tests: slowloris connections, a connection
flood, and a legitimate client whose latency is measured meanwhile.

The attackers connect from other loopback addresses (127.0.0.2, 127.0.0.3: other hosts, as
far as the server's per-address accounting is concerned) and run on a thread of their own
with non-blocking sockets, so a few thousand connections cost one Python thread.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from dataclasses import dataclass, field

import ps_wire as w
import torch

from torchrec_bagpipe.ps import PSClient


class Attack:
    """Keeps up to `connections` connections to `address` open from `sources` (round robin),
    reconnecting whatever the server closes. `trickle`: every `interval` seconds each
    connection sends the next byte of a Hello it never completes (slowloris); otherwise
    connections send nothing (a flood of idle connections; `interval` then paces reconnects)."""

    def __init__(self, address: tuple[str, int], connections: int, *, trickle: bool,
                 interval: float = 0.5, sources: tuple[str, ...] = ("127.0.0.2", "127.0.0.3")):
        self.address = address
        self.connections = connections
        self.trickle = trickle
        self.interval = interval
        self.sources = sources
        self.opened = 0
        self.closed_by_server = 0
        self._hello = w.hello("not-the-job-token")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Attack:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _connect(self) -> tuple[socket.socket, int] | None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind((self.sources[self.opened % len(self.sources)], 0))
            s.setblocking(False)
            rc = s.connect_ex(self.address)
            if rc not in (0, errno.EINPROGRESS):
                s.close()
                return None
        except OSError:
            s.close()
            return None
        self.opened += 1
        return s, 0

    def _run(self) -> None:
        conns: list[tuple[socket.socket, int]] = []
        try:
            while not self._stop.is_set():
                while len(conns) < self.connections and not self._stop.is_set():
                    c = self._connect()
                    if c is None:
                        break
                    conns.append(c)
                kept: list[tuple[socket.socket, int]] = []
                for s, sent in conns:
                    try:
                        if self.trickle and sent < len(self._hello) - 1:
                            s.send(self._hello[sent:sent + 1])
                            sent += 1
                        else:
                            # Probe for the server's close without sending anything.
                            if s.recv(1, socket.MSG_PEEK) == b"":
                                raise ConnectionResetError
                        kept.append((s, sent))
                    except (BlockingIOError, InterruptedError):
                        kept.append((s, sent))
                    except OSError:
                        self.closed_by_server += 1
                        s.close()
                conns = kept
                self._stop.wait(self.interval)
        finally:
            for s, _ in conns:
                s.close()


@dataclass
class Latencies:
    """Seconds per operation of the legitimate client, by kind."""

    round_trip: list[float] = field(default_factory=list)  # commit + get, established client
    new_client: list[float] = field(default_factory=list)  # connect + open + lookup + close
    errors: list[str] = field(default_factory=list)

    @staticmethod
    def p99(xs: list[float]) -> float:
        if not xs:
            return float("nan")
        s = sorted(xs)
        return s[min(len(s) - 1, int(0.99 * len(s)))]

    def summary(self) -> str:
        return (f"{len(self.round_trip)} round trips p99 {1e3 * self.p99(self.round_trip):.1f} ms, "
                f"{len(self.new_client)} new clients p99 {1e3 * self.p99(self.new_client):.1f} ms, "
                f"{len(self.errors)} errors")


class LegitimateClient:
    """A trainer rank of a one-rank job: an established client committing and reading back
    step after step, plus a brand-new client (connect, authenticate, open, read, close)
    every `new_every` seconds."""

    DIM = 4

    def __init__(self, address: str, token: str) -> None:
        self.address = address
        self.token = token
        self.client = self._open()
        self.step = 0

    def _open(self, table: str = "legit") -> PSClient:
        return PSClient([self.address], table=table, dim=self.DIM, lr=0.5, init="zeros",
                        job_token=self.token, timeout=60.0, connect_timeout=30.0)

    def measure(self, seconds: float, new_every: float = 0.2) -> Latencies:
        out = Latencies()
        keys = torch.tensor([1, 2, 3])
        grads = torch.ones(3, self.DIM)
        end = time.monotonic() + seconds
        next_new = time.monotonic()
        while time.monotonic() < end:
            t0 = time.monotonic()
            try:
                self.client.commit(self.step, keys, grads)
                rows = self.client.get(keys, self.step)
                assert rows.shape == (3, self.DIM)
                self.step += 1
                out.round_trip.append(time.monotonic() - t0)
            except Exception as e:  # the failure under test
                out.errors.append(f"round trip: {e!r}")
                return out
            if time.monotonic() >= next_new:
                next_new = time.monotonic() + new_every
                t0 = time.monotonic()
                try:
                    with self._open("probe") as c:
                        c.lookup(keys)
                    out.new_client.append(time.monotonic() - t0)
                except Exception as e:
                    out.errors.append(f"new client: {e!r}")
        return out

    def close(self) -> None:
        self.client.close()
