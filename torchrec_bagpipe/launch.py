"""`torchrec-bagpipe-launch`: one command that starts the PS shards and the trainers.

    torchrec-bagpipe-launch --nproc-per-node 2 [--ps-servers K] train.py --ps-type rdma ...

* On a single node the local backend is used whatever `--ps-type` the training command
  names (as upstream BagPipe's demo does): `--ps-type rdma|tcp` in the command is rewritten to
  `--ps-type local` and `BAGPIPE_PS_TYPE=local` is exported. Without `--ps-servers`, the PS
  shards live inside the trainers (BagPipeConfig's zero-config default); with
  `--ps-servers K`, K `torchrec-bagpipe-ps` servers are started on this node and their
  addresses handed to the trainers (`BAGPIPE_PS_ADDRESSES`).
* Trainers run under `torchrun` (torch.distributed.run); every line of every process is
  streamed with a prefix (`[trainer r]`, `[ps s]`).
* If any process fails, or on Ctrl-C / SIGTERM, everything is stopped: SIGTERM, a bounded
  grace period, then SIGKILL. Every wait is bounded. The exit status is the trainers'
  (or 130 after an interrupt, 1 when a PS server failed).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["main", "parse_args", "rewrite_ps_type"]

_PREFIX = re.compile(r"^\[default(\d+)\]:")
_TRAILING_PREFIX = re.compile(r"\[default\d+\]:$")
_LISTENING = re.compile(r"^listening (\S+):(\d+) shard \d+/\d+")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="torchrec-bagpipe-launch",
        description="Start BagPipe PS shards and torchrun trainers with one command.",
    )
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank")
    p.add_argument("--nproc-per-node", type=int, default=1, help="trainer processes per node")
    p.add_argument("--master-addr", default="127.0.0.1", help="rendezvous host")
    p.add_argument("--master-port", type=int, default=0, help="rendezvous port (0: pick one)")
    p.add_argument(
        "--ps-type", choices=["local", "tcp", "rdma"], default=None,
        help="PS transport when the training command does not name one; a single node "
             "always uses the local backend",
    )
    p.add_argument("--ps-servers", type=int, default=0,
                   help="PS server processes to start on this node (0: shards live in the "
                        "trainers)")
    p.add_argument("--ps-host", default="127.0.0.1", help="host the PS servers listen on")
    p.add_argument("--ps-server-args", default="",
                   help="extra arguments for every torchrec-bagpipe-ps server (one string)")
    p.add_argument("--startup-timeout", type=float, default=60.0,
                   help="seconds to wait for each PS server to accept connections")
    p.add_argument("--grace-period", type=float, default=10.0,
                   help="seconds between SIGTERM and SIGKILL when stopping processes")
    p.add_argument("--timeout", type=float, default=None,
                   help="stop everything after this many seconds (default: no limit)")
    p.add_argument("--log-dir", default=None, help="torchrun log directory")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the training script and its arguments")
    args = p.parse_args(list(argv))
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        p.error("no training command given")
    if args.nproc_per_node < 1 or args.nnodes < 1 or args.ps_servers < 0:
        p.error("--nproc-per-node and --nnodes must be >= 1, --ps-servers >= 0")
    args.command = command
    return args


def rewrite_ps_type(command: list[str], single_node: bool, default: str | None
                    ) -> tuple[list[str], str]:
    """The command with its `--ps-type` made effective, and that PS type."""
    out = list(command)
    named: str | None = None
    index: int | None = None
    for i, a in enumerate(out):
        if a == "--ps-type" and i + 1 < len(out):
            named, index = out[i + 1].lower(), i + 1
        elif a.startswith("--ps-type="):
            named, index = a.split("=", 1)[1].lower(), i
    chosen = named or default or "local"
    if single_node and chosen != "local":
        chosen = "local"
    if index is not None:
        if out[index].startswith("--ps-type="):
            out[index] = "--ps-type=" + chosen
        else:
            out[index] = chosen
    return out, chosen


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen
    threads: list[threading.Thread] = field(default_factory=list)
    address: str | None = None  # a PS server's "host:port", from its listening line
    listening: threading.Event = field(default_factory=threading.Event)


class Launcher:
    """Owns the child processes; every stop and wait is bounded."""

    def __init__(self, grace_period: float) -> None:
        self.grace = grace_period
        self.procs: list[_Proc] = []
        self._print_lock = threading.Lock()

    def _pump(self, stream, prefix: str, trainer: bool, proc: _Proc) -> None:
        """Copies a child's output line by line with a prefix; a segment ending in a
        carriage return (a progress bar redrawing itself) keeps its carriage return."""
        buf = b""
        state = {"rank": None, "after_cr": False}
        while True:
            chunk = stream.read1(65536) if hasattr(stream, "read1") else stream.read(4096)
            if not chunk:
                break
            buf += chunk
            while True:
                cut = min((i for i in (buf.find(b"\n"), buf.find(b"\r")) if i >= 0),
                          default=-1)
                if cut < 0:
                    break
                self._emit(buf[:cut], buf[cut:cut + 1], prefix, trainer, state, proc)
                buf = buf[cut + 1:]
        if buf:
            self._emit(buf, b"\n", prefix, trainer, state, proc)
        stream.close()
        proc.listening.set()  # EOF: the process is gone (a server that never listened)

    def _emit(self, raw: bytes, end: bytes, prefix: str, trainer: bool,
              state: dict[str, Any], proc: _Proc) -> None:
        line = raw.decode("utf-8", "replace")
        if not trainer and proc.address is None:
            m = _LISTENING.match(line)
            if m:
                proc.address = f"{m.group(1)}:{m.group(2)}"
                proc.listening.set()
        continued = state["after_cr"]
        state["after_cr"] = end == b"\r"
        if trainer:
            line = _TRAILING_PREFIX.sub("", line)  # torchrun's prefix of a redrawn bar
            m = _PREFIX.match(line)
            if m:
                state["rank"] = m.group(1)
                line = line[m.end():]
                if not line and end == b"\r":
                    return  # torchrun's prefix right before a progress bar's redraw
            elif not continued:
                state["rank"] = None
            who = f"[trainer {state['rank']}]" if state["rank"] is not None else prefix
            line = f"{who} {line}"
        else:
            line = f"{prefix} {line}"
        with self._print_lock:
            sys.stdout.write(line + ("\r" if end == b"\r" else "\n"))
            sys.stdout.flush()

    def start(self, name: str, cmd: list[str], env: dict[str, str], prefix: str,
              trainer: bool = False) -> _Proc:
        popen = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        proc = _Proc(name, popen)
        t = threading.Thread(target=self._pump, args=(popen.stdout, prefix, trainer, proc),
                             daemon=True)
        t.start()
        proc.threads.append(t)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        alive = [p for p in self.procs if p.popen.poll() is None]
        for p in alive:
            _signal_group(p.popen, signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        for p in alive:
            try:
                p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p.popen, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.popen.wait(timeout=5.0)
        for p in self.procs:
            for t in p.threads:
                t.join(timeout=2.0)


def _signal_group(popen: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(popen.pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        popen.send_signal(sig)


class _Interrupted(Exception):
    pass


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    single_node = args.nnodes == 1
    command, ps_type = rewrite_ps_type(args.command, single_node, args.ps_type)
    env = dict(os.environ)
    env["BAGPIPE_PS_TYPE"] = ps_type
    launcher = Launcher(args.grace_period)

    def on_signal(signum: int, frame: object) -> None:
        raise _Interrupted(signum)

    old_int = signal.signal(signal.SIGINT, on_signal)
    old_term = signal.signal(signal.SIGTERM, on_signal)
    status = 1
    try:
        if single_node and args.ps_type not in (None, "local"):
            print(f"[launch] single node: using the local PS backend instead of "
                  f"{args.ps_type}", flush=True)
        addresses = []
        servers = []
        if args.ps_servers:
            # One secret per job: the servers refuse every client that lacks it.
            env.setdefault("BAGPIPE_JOB_TOKEN", secrets.token_hex(16))
        for s in range(args.ps_servers):
            cmd = [sys.executable, "-m", "torchrec_bagpipe.ps.server", "--shard-id", str(s),
                   "--num-shards", str(args.ps_servers), "--host", args.ps_host, "--port", "0",
                   *(["--transport", "rdma"] if ps_type == "rdma" else []),
                   *args.ps_server_args.split()]
            servers.append(launcher.start(f"ps{s}", cmd, env, f"[ps {s}]"))
        deadline = time.monotonic() + args.startup_timeout
        for proc in servers:
            proc.listening.wait(max(0.0, deadline - time.monotonic()))
            if proc.address is None:
                raise RuntimeError(
                    f"PS server {proc.name} did not start listening within "
                    f"{args.startup_timeout}s (status {proc.popen.poll()})"
                )
            addresses.append(proc.address)
        if addresses:
            env["BAGPIPE_PS_ADDRESSES"] = ",".join(addresses)
            print(f"[launch] PS servers: {env['BAGPIPE_PS_ADDRESSES']}", flush=True)
        port = args.master_port or _free_port(args.master_addr)
        torchrun = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(args.nnodes), "--node-rank", str(args.node_rank),
            "--nproc-per-node", str(args.nproc_per_node),
            "--master-addr", args.master_addr, "--master-port", str(port),
            "--tee", "3",
        ]
        if args.log_dir:
            torchrun += ["--log-dir", args.log_dir]
        if command[0].endswith(".py") or os.path.isfile(command[0]):
            torchrun += command
        else:
            torchrun += ["--no-python", *command]
        env.setdefault("OMP_NUM_THREADS", "1")
        trainers = launcher.start("trainers", torchrun, env, "[trainers]", trainer=True)
        started = time.monotonic()
        while True:
            rc = trainers.popen.poll()
            if rc is not None:
                status = rc
                break
            dead = [p for p in servers if p.popen.poll() is not None]
            if dead:
                p = dead[0]
                print(f"[launch] PS server {p.name} exited with status {p.popen.returncode}; "
                      "stopping the trainers", flush=True)
                status = 1
                break
            if args.timeout is not None and time.monotonic() - started > args.timeout:
                print(f"[launch] --timeout {args.timeout}s reached; stopping everything",
                      flush=True)
                status = 124
                break
            time.sleep(0.1)
    except _Interrupted:
        print("[launch] interrupted; stopping everything", flush=True)
        status = 130
    except (RuntimeError, TimeoutError) as e:
        print(f"[launch] {e}; stopping everything", flush=True)
        status = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            launcher.stop_all()
        finally:
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old_term)
    if status != 0:
        print(f"[launch] exit status {status}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
