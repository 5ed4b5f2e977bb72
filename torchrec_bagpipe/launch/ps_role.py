"""The PS role: one PS shard server per replica, announced through the rendezvous store.

    python -m torchrec_bagpipe.launch.ps_role --rendezvous HOST:PORT --run-id ID \\
        --replica-id I --num-replicas K --nnodes N [--host 0.0.0.0] [--server-args "..."]

Replica I starts ``torchrec-bagpipe-ps --shard-id I --num-shards K --port 0`` (its output is
copied behind ``[ps I]``; its documented ``listening HOST:PORT`` line gives the port),
publishes ``ADVERTISE_HOST:PORT`` in the job's store (`rendezvous.JobStore`), and serves until
every one of the N trainer nodes is done (or lost: its heartbeat stopped for
``--heartbeat-timeout`` seconds), then drains the server (SIGTERM) and exits with the
server's status. A drain before that (the role interrupted, or the server's own ``draining``
line after a SIGTERM from elsewhere) is published (``ps/draining/I``) so the trainer nodes
stop at once. The replica named by ``--store-host-replica`` (default 0) hosts the store
and stays up until the other replicas have exited. SIGINT/SIGTERM drains and exits early.
Every wait is bounded.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shlex
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence

from torchrec_bagpipe.launch.processes import Child, Interrupted, run_role
from torchrec_bagpipe.launch.rendezvous import HEARTBEAT_S, JobStore, TrainerWatch

__all__ = ["advertised_host", "main", "rendezvous_endpoint"]

_LISTENING = re.compile(r"^listening (\S+):(\d+) shard \d+/\d+")
_DRAINING = re.compile(r"^draining shard \d+/\d+: (.*)$")
_NODELIST = re.compile(r"^([^\[,]*)\[(\d+)")


def add_rendezvous_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("rendezvous")
    g.add_argument("--rendezvous", default=None,
                   help="HOST:PORT of the job's store (else --rendezvous-host-env and "
                        "--rendezvous-port)")
    g.add_argument("--rendezvous-host-env", default=None,
                   help="environment variable holding the store's host (torchx's rank0_env; "
                        "unset or empty: localhost)")
    g.add_argument("--rendezvous-port", type=int, default=29500,
                   help="the store's port with --rendezvous-host-env (default 29500)")
    g.add_argument("--run-id", required=True, help="the job's id (torchx app_id)")
    g.add_argument("--rendezvous-timeout", type=float, default=600.0,
                   help="seconds to wait for the store and for the other roles (default 600)")


def rendezvous_endpoint(args: argparse.Namespace) -> str:
    """HOST:PORT of the store from --rendezvous or --rendezvous-host-env/--rendezvous-port.
    A Slurm node list (``node[3-5]``, ``a,b``) stands for its first host."""
    if args.rendezvous:
        return str(args.rendezvous)
    host = os.environ.get(args.rendezvous_host_env or "", "") or "localhost"
    m = _NODELIST.match(host)
    if m:
        host = m.group(1) + m.group(2)
    host = host.split(",")[0]
    return f"{host}:{args.rendezvous_port}"


def advertised_host(bind_host: str, advertise: str | None) -> str:
    """The host trainers dial: --advertise-host, else the bind address unless it is a
    wildcard, else this machine's fully qualified name."""
    if advertise:
        return advertise
    if bind_host in ("0.0.0.0", "::", ""):
        return socket.getfqdn()
    return bind_host


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m torchrec_bagpipe.launch.ps_role",
                                description="One PS shard of a BagPipe job (torchx PS role).")
    add_rendezvous_arguments(p)
    p.add_argument("--replica-id", type=int, required=True, help="this shard's index")
    p.add_argument("--num-replicas", type=int, required=True, help="number of PS shards")
    p.add_argument("--store-host-replica", type=int, default=0,
                   help="the replica that hosts the store (-1: another process does)")
    p.add_argument("--nnodes", type=int, required=True, help="trainer nodes to serve")
    p.add_argument("--host", default="0.0.0.0", help="address the server binds")
    p.add_argument("--advertise-host", default=None,
                   help="host trainers dial (default: --host, or this machine's name when "
                        "--host is a wildcard)")
    p.add_argument("--transport", choices=["tcp", "rdma"], default="tcp")
    p.add_argument("--server-args", default="",
                   help="extra torchrec-bagpipe-ps arguments (one string)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="the job's whole-job checkpoint directory (every node sees it): this "
                        "shard checkpoints into its ps/shard-<i> part")
    p.add_argument("--resume", default=None,
                   help="resume from the whole-job checkpoint in this directory: this shard "
                        "restores its part of the manifest's set")
    p.add_argument("--startup-timeout", type=float, default=60.0,
                   help="seconds for the server to listen (default 60)")
    p.add_argument("--trainer-start-timeout", type=float, default=1800.0,
                   help="seconds for every trainer node's first heartbeat (default 1800)")
    p.add_argument("--heartbeat-timeout", type=float, default=60.0,
                   help="a trainer node silent this long is lost (default 60)")
    p.add_argument("--grace-period", type=float, default=45.0,
                   help="seconds the server has to drain after SIGTERM (default 45)")
    return p


def checkpoint_server_args(checkpoint_dir: str | None, resume: str | None,
                           shard: int, num_shards: int) -> list[str]:
    """Server arguments of shard `shard` of `num_shards` in a whole-job checkpoint
    (checkpoint_manifest.py): its checkpoint directory under `checkpoint_dir` (or `resume`),
    and when resuming the set the manifest names: its own part, or, when the set was taken
    with another shard count, every part to restore re-partitioned with the set's
    partitioner (``--restore-resharded``). Raises ValueError when `resume` holds no
    manifest."""
    from torchrec_bagpipe.distributed.checkpoint_manifest import (
        ps_set_dir,
        ps_set_dirs,
        ps_shard_dir,
        read_manifest,
    )

    out: list[str] = []
    directory = checkpoint_dir or resume
    if directory:
        out += ["--checkpoint-dir", ps_shard_dir(os.path.abspath(directory), shard)]
    if resume:
        manifest = read_manifest(resume)
        if manifest is None:
            raise ValueError(f"--resume {resume}: no whole-job checkpoint there "
                             "(no MANIFEST.json)")
        root = os.path.abspath(resume)
        if manifest.ps_shards == num_shards:
            out += ["--restore-from", ps_set_dir(root, shard, manifest.label)]
        else:
            out += ["--restore-resharded", ",".join(ps_set_dirs(root, manifest)),
                    "--partitioner", manifest.partitioner]
    return out


def _start_server(args: argparse.Namespace, token: str,
                  draining: list[str]) -> tuple[Child, Callable[[], str | None]]:
    """The shard server, and a function that waits (bounded) for its listening port.
    `draining` receives the reason when the server announces it drains."""
    listening = threading.Event()
    found: list[str] = []

    def on_line(line: str) -> None:
        m = _LISTENING.match(line)
        if m and not found:
            found.append(m.group(2))
            listening.set()
        d = _DRAINING.match(line)
        if d and not draining:
            draining.append(d.group(1))

    cmd = [sys.executable, "-m", "torchrec_bagpipe.ps.server",
           "--shard-id", str(args.replica_id), "--num-shards", str(args.num_replicas),
           "--host", args.host, "--port", "0",
           *(["--transport", "rdma"] if args.transport == "rdma" else []),
           *shlex.split(args.server_args),
           *checkpoint_server_args(args.checkpoint_dir, args.resume, args.replica_id,
                                   args.num_replicas)]
    env = {**os.environ, "BAGPIPE_JOB_TOKEN": token}
    server = Child(cmd, env, prefix=f"[ps {args.replica_id}]", on_line=on_line)

    def port() -> str | None:
        deadline = time.monotonic() + args.startup_timeout
        while not listening.wait(0.1):
            if server.poll() is not None or time.monotonic() > deadline:
                return None
        return found[0]

    return server, port


def run(args: argparse.Namespace) -> int:
    endpoint = rendezvous_endpoint(args)
    me = args.replica_id
    hosting = me == args.store_host_replica
    store = JobStore(endpoint, args.run_id, host=hosting, timeout=args.rendezvous_timeout)
    token = os.environ.get("BAGPIPE_JOB_TOKEN") or store.agree_token(
        secrets.token_hex(16), args.rendezvous_timeout)
    draining: list[str] = []
    server, listening_port = _start_server(args, token, draining)
    interrupted = False
    port: str | None = None
    try:
        port = listening_port()
        if port is None:
            print(f"[ps {me}] the server did not listen within {args.startup_timeout}s "
                  f"(status {server.poll()})", flush=True)
        else:
            _serve(args, store, endpoint, f"{advertised_host(args.host, args.advertise_host)}"
                   f":{port}", server, draining)
    except Interrupted as e:
        print(f"[ps {me}] interrupted; draining", flush=True)
        # The trainers stop now (their clients are told by the server too) instead of
        # training on until the drain ends.
        store.ps_draining(me, f"its PS role got signal {e.signum}")
        interrupted = True
    finally:
        rc = server.stop(args.grace_period)
        status = 130 if interrupted else (rc if port is not None else 1)
        store.ps_exited(me, status)
    if hosting:
        _outlive_replicas(store, me, args)
    return status


def _serve(args: argparse.Namespace, store: JobStore, endpoint: str, address: str,
           server: Child, draining: list[str]) -> None:
    """Publishes the address, then returns once the trainers are done or the server died;
    a server that starts draining on its own (SIGTERM from elsewhere) is announced."""
    me = args.replica_id
    store.publish_ps(me, address)
    print(f"[ps {me}] serving shard {me}/{args.num_replicas} at {address} "
          f"(rendezvous {endpoint})", flush=True)
    trainers = TrainerWatch(store, args.nnodes, args.trainer_start_timeout, args.heartbeat_timeout)
    announced = False
    while True:
        if draining and not announced:
            store.ps_draining(me, f"its server: {draining[0]}")
            announced = True
        if server.poll() is not None:
            print(f"[ps {me}] the server exited with status {server.poll()}", flush=True)
            return
        if trainers.all_done():
            return
        time.sleep(HEARTBEAT_S / 4)


def _outlive_replicas(store: JobStore, me: int, args: argparse.Namespace) -> None:
    """The store's host waits (bounded) for the other replicas to report their exit."""
    others = [i for i in range(args.num_replicas) if i != me]
    deadline = time.monotonic() + args.grace_period + args.heartbeat_timeout
    while time.monotonic() < deadline:
        if len(store.ps_exit_statuses(others)) == len(others):
            return
        time.sleep(0.2)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 <= args.replica_id < args.num_replicas or args.nnodes < 1:
        print("ps_role: need 0 <= --replica-id < --num-replicas and --nnodes >= 1",
              file=sys.stderr)
        return 2
    return run_role(lambda: run(args), f"[ps {args.replica_id}]")


if __name__ == "__main__":
    sys.exit(main())
