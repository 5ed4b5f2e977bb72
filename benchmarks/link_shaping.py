"""Shapes the loopback traffic of chosen TCP ports to a fixed bandwidth with Linux `tc`.

Used by `e2e_dlrm.py --shaped-link`: every PS shard server listens on its own port; traffic to
the port (trainer -> shard: commits, requests) and from it (shard -> trainer: rows) each pass
their own token bucket (tbf) at `rate` bytes/s, a full-duplex link per shard. Everything else
on `lo` is classified into an unshaped band. Optionally (`hosts`, used by `link_bound.py`)
traffic to given local addresses (e.g. the trainers' collectives, bound to 127.0.0.x through
``GLOO_SOCKET_IFNAME``) passes one more tbf per address at its own rate (`host_rate`).

Recipes, the first the kernel accepts is used:
  * ``prio``: root ``prio`` qdisc (all priorities to band 1:1, unshaped), one band per shaped
    direction with a ``tbf`` child, ``u32`` filters on the port (dport / sport);
  * ``htb``: the same with a root ``htb`` qdisc (default class at 100 Gbit/s, unshaped) where
    the kernel has no ``prio`` (``htb`` only classifies; each ``tbf`` shapes).

Safety: shaping needs root and a `tc` binary; it refuses (and the caller falls back to the link
model) when `lo` already has a root qdisc other than ``noqueue`` (someone else's shaping is
never replaced). The shaping is removed when the `ShapedLink` context exits, on any exception,
on SIGTERM/SIGINT (turned into SystemExit) and at interpreter exit; a SIGKILLed process leaves
it behind, so the removal command is printed to stderr when it is installed.

Tests use `plan_commands` and a fake `runner`; nothing here runs `tc` unless `ShapedLink` is
entered with the default runner.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType, TracebackType

__all__ = ["ShapedLink", "ShapingUnavailable", "TcRunner", "link_rate", "measure_link",
           "plan_commands", "tbf_burst"]

DEV = "lo"
# lo carries GSO packets up to its 64 KiB MTU: a bucket must hold at least one of them.
_MAX_PACKET = 65536 + 1024
# Queue bytes per shaped direction: TCP backs off on its own window long before this fills,
# so nothing is dropped (a drop on lo costs a >= 200 ms retransmission timeout).
_QUEUE_LIMIT = 64 << 20

TcRunner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


class ShapingUnavailable(RuntimeError):
    """Shaping cannot be installed here (the message says why); use the link model."""


def link_rate(link_gbps: float, link_step_ms: float, step_s: float) -> float:
    """Bytes/s of a link that moves as many bytes per `step_s` step as a `link_gbps` Gb/s
    link does per `link_step_ms` ms step: the same bandwidth relative to the compute."""
    if not (link_gbps > 0 and link_step_ms > 0 and step_s > 0):
        raise ValueError(f"link_rate needs positive arguments, got {link_gbps} Gb/s, "
                         f"{link_step_ms} ms, {step_s} s")
    return link_gbps * 1e9 / 8 * (link_step_ms / 1e3) / step_s


def tbf_burst(rate_bytes_per_s: float) -> int:
    """Bucket size: two maximal lo packets, and at least 1 ms of traffic at the rate (the
    kernel's timer granularity); small against a step's MBs, so a step cannot borrow much
    from the idle time before it."""
    return int(max(2 * _MAX_PACKET, rate_bytes_per_s / 1000))


def _rate(rate_bytes_per_s: float) -> str:
    return f"{int(rate_bytes_per_s * 8)}bit"


def plan_commands(recipe: str, ports: Sequence[int], rate_bytes_per_s: float,
                  hosts: Sequence[str] = (), host_rate: float | None = None) -> list[list[str]]:
    """The `tc` argument lists (without the leading ``tc``) that install the shaping: each
    port at `rate_bytes_per_s` per direction, then traffic to each of `hosts` (IPv4
    addresses) at `host_rate`."""
    if not ports:
        raise ValueError("no ports to shape")
    if rate_bytes_per_s <= 0:
        raise ValueError(f"rate must be > 0 bytes/s, got {rate_bytes_per_s}")
    if hosts and not (host_rate is not None and host_rate > 0):
        raise ValueError(f"shaped hosts need a host_rate > 0 bytes/s, got {host_rate}")
    n_classes = 2 * len(ports) + len(hosts)
    if recipe == "prio" and n_classes + 1 > 16:
        raise ValueError("prio has at most 16 bands: 2 per shaped port + 1 per host <= 15")
    cmds: list[list[str]] = []
    if recipe == "prio":
        bands = n_classes + 1
        cmds.append(["qdisc", "add", "dev", DEV, "root", "handle", "1:", "prio", "bands",
                     str(bands), "priomap", *(["0"] * 16)])
        classes = [f"1:{2 + k}" for k in range(n_classes)]
    elif recipe == "htb":
        cmds.append(["qdisc", "add", "dev", DEV, "root", "handle", "1:", "htb", "default", "1"])
        cmds.append(["class", "add", "dev", DEV, "parent", "1:", "classid", "1:1", "htb",
                     "rate", "100gbit"])
        classes = [f"1:{10 + k}" for k in range(n_classes)]
        for c in classes:
            cmds.append(["class", "add", "dev", DEV, "parent", "1:", "classid", c, "htb",
                         "rate", "100gbit"])
    else:
        raise ValueError(f"unknown recipe {recipe!r}")
    for k, c in enumerate(classes):
        r = host_rate if k >= 2 * len(ports) and host_rate is not None else rate_bytes_per_s
        cmds.append(["qdisc", "add", "dev", DEV, "parent", c, "handle", f"{100 + k}:", "tbf",
                     "rate", _rate(r), "burst", str(tbf_burst(r)), "limit",
                     str(_QUEUE_LIMIT)])
    for i, port in enumerate(ports):
        for k, field in ((2 * i, "dport"), (2 * i + 1, "sport")):
            cmds.append(["filter", "add", "dev", DEV, "parent", "1:", "protocol", "ip", "prio",
                         "1", "u32", "match", "ip", field, str(port), "0xffff", "flowid",
                         classes[k]])
    for i, host in enumerate(hosts):
        cmds.append(["filter", "add", "dev", DEV, "parent", "1:", "protocol", "ip", "prio",
                     "1", "u32", "match", "ip", "dst", f"{host}/32", "flowid",
                     classes[2 * len(ports) + i]])
    return cmds


def _run_tc(args: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["tc", *args], capture_output=True, text=True, timeout=10,
                          check=False)


@dataclass
class _State:
    installed: bool = False


class ShapedLink:
    """Context manager: shapes `ports` on lo to `rate_bytes_per_s` per direction and port.

    Raises ShapingUnavailable on entry when it cannot (not root, no tc, lo already shaped,
    the kernel refuses every recipe); `recipe` then names nothing was installed.
    """

    def __init__(self, ports: Sequence[int], rate_bytes_per_s: float, *,
                 runner: TcRunner | None = None, check_root: bool = True,
                 hosts: Sequence[str] = (), host_rate: float | None = None) -> None:
        self.ports = list(ports)
        self.rate = float(rate_bytes_per_s)
        self.hosts = list(hosts)
        self.host_rate = host_rate
        self.recipe: str | None = None
        self._run = runner or _run_tc
        self._check_root = check_root
        self._state = _State()
        self._old_handlers: dict[int, object] = {}

    # ---- install / remove ---------------------------------------------------------------
    def _root_qdisc(self) -> str:
        r = self._run(["qdisc", "show", "dev", DEV])
        if r.returncode != 0:
            raise ShapingUnavailable(f"tc qdisc show failed: {r.stderr.strip()}")
        for line in r.stdout.splitlines():
            if " root " in f" {line} ":
                return line.split()[1]
        return "noqueue"

    def _install(self) -> None:
        if self._run is _run_tc:
            if shutil.which("tc") is None:
                raise ShapingUnavailable("no tc binary (iproute2) on this machine")
            if self._check_root and os.geteuid() != 0:
                raise ShapingUnavailable("shaping lo needs root")
        kind = self._root_qdisc()
        if kind != "noqueue":
            raise ShapingUnavailable(f"lo already has a root qdisc ({kind}): not replacing it")
        errors = []
        for recipe in ("prio", "htb"):
            cmds = plan_commands(recipe, self.ports, self.rate, self.hosts, self.host_rate)
            for i, cmd in enumerate(cmds):
                r = self._run(cmd)
                if r.returncode != 0:
                    errors.append(f"{recipe}: tc {' '.join(cmd)}: {r.stderr.strip()}")
                    if i > 0:  # the root qdisc went in: take the partial recipe out
                        self._run(["qdisc", "del", "dev", DEV, "root"])
                    break
            else:
                self.recipe = recipe
                self._state.installed = True
                print(f"link_shaping: lo shaped ({recipe}); if this process dies by SIGKILL, "
                      f"remove it with: tc qdisc del dev {DEV} root", file=sys.stderr,
                      flush=True)
                return
        raise ShapingUnavailable("the kernel refused every recipe: " + "; ".join(errors))

    def remove(self) -> None:
        """Takes the shaping out (idempotent)."""
        if not self._state.installed:
            return
        self._state.installed = False
        r = self._run(["qdisc", "del", "dev", DEV, "root"])
        if r.returncode != 0:
            print(f"link_shaping: removing the shaping failed: {r.stderr.strip()}; run: "
                  f"tc qdisc del dev {DEV} root", file=sys.stderr, flush=True)

    # ---- context manager ----------------------------------------------------------------
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.remove()
        raise SystemExit(128 + signum)

    def __enter__(self) -> ShapedLink:
        self._install()
        atexit.register(self.remove)
        for sig in (signal.SIGTERM, signal.SIGINT):
            # Not the main thread: no handler, atexit and __exit__ still remove the shaping.
            with contextlib.suppress(ValueError):
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self.remove()
        finally:
            for sig, old in self._old_handlers.items():
                signal.signal(sig, old)  # type: ignore[arg-type]
            self._old_handlers.clear()
            atexit.unregister(self.remove)


def measure_link(port: int, nbytes: int = 8 << 20, pings: int = 50,
                 timeout: float = 60.0) -> tuple[float, float, float]:
    """(upload bytes/s, download bytes/s, round trip s) of a TCP connection to `port` on
    127.0.0.1: a bulk transfer of `nbytes` each way, then `pings` 64-byte ping-pongs (median).
    Run through a shaped port it measures the link the shaping gives, payload only."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(1)
    srv.settimeout(timeout)
    errors: list[BaseException] = []

    def recv_exact(sock: socket.socket, n: int, buf: bytearray) -> None:
        got = 0
        view = memoryview(buf)
        while got < n:
            k = sock.recv_into(view[: min(len(buf), n - got)])
            if k == 0:
                raise ConnectionError("peer closed")
            got += k

    def serve() -> None:
        try:
            conn, _ = srv.accept()
            with conn:
                conn.settimeout(timeout)
                buf = bytearray(1 << 20)
                recv_exact(conn, nbytes, buf)
                conn.sendall(b"d")
                conn.sendall(bytes(nbytes))
                for _ in range(pings):
                    recv_exact(conn, 64, buf)
                    conn.sendall(bytes(64))
        except BaseException as e:  # reported by the caller
            errors.append(e)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as c:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            buf = bytearray(1 << 20)
            t0 = time.perf_counter()
            c.sendall(bytes(nbytes))
            recv_exact(c, 1, buf)  # the server has every byte
            t1 = time.perf_counter()
            recv_exact(c, nbytes, buf)
            t2 = time.perf_counter()
            rtts = []
            for _ in range(pings):
                p0 = time.perf_counter()
                c.sendall(bytes(64))
                recv_exact(c, 64, buf)
                rtts.append(time.perf_counter() - p0)
        t.join(timeout)
    finally:
        srv.close()
    if errors:
        raise errors[0]
    rtts.sort()
    return nbytes / (t1 - t0), nbytes / (t2 - t1), rtts[len(rtts) // 2]
