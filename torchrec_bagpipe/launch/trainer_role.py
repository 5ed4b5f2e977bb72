"""The trainer role: one node's trainers under torchrun, wired to the job's PS shards.

    python -m torchrec_bagpipe.launch.trainer_role --rendezvous HOST:PORT --run-id ID \\
        --node-rank N --nnodes NN --nproc-per-node M --ps-servers K train.py ARGS...

It reads the job token and the K PS addresses from the job's store (`rendezvous.JobStore`,
waiting for the PS role), hands them to the trainers in the environment
(``BAGPIPE_JOB_TOKEN``, ``BAGPIPE_PS_ADDRESSES``, ``BAGPIPE_PS_TYPE``: what `BagPipeJob`
reads), and runs ``torchrun --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-conf
is_host=0`` on the same store. torchrun's output reaches our stdout/stderr directly, each
line behind torchrun's own prefix (``[trainer <global rank>]``, through
``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``); ``--log-dir``/``--redirects`` are torchrun's.
While torchrun runs the node sends heartbeats; when it exits the node records its status,
which tells the PS shards when to drain. If another node fails, or a PS shard starts draining
or exits early, this node stops its trainers (SIGTERM, then SIGKILL after the grace period).
With K = 0 the shards live inside the trainers (`BagPipeConfig`'s zero-config deployment)
and only torchrun's rendezvous uses the store.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torchrec_bagpipe.launch.processes import Child, Interrupted, run_role
from torchrec_bagpipe.launch.ps_role import add_rendezvous_arguments, rendezvous_endpoint
from torchrec_bagpipe.launch.rendezvous import HEARTBEAT_S, JobStore, TrainerWatch

__all__ = ["TrainerNode", "main", "rewrite_ps_type", "run_trainer_node"]

PREFIX_TEMPLATE = "[${role_name} ${rank}] "


def rewrite_ps_type(command: list[str], single_node: bool, default: str | None,
                    force: str | None = None) -> tuple[list[str], str]:
    """The command with its ``--ps-type`` made effective, and that PS type: `force` (the
    transport of the job's PS servers) if given, else the command's, else `default`, else
    local; one node without `force` always uses the local backend (shards in the trainers,
    or the launcher's TCP servers reached over loopback)."""
    out = list(command)
    named: str | None = None
    index: int | None = None
    for i, a in enumerate(out):
        if a == "--ps-type" and i + 1 < len(out):
            named, index = out[i + 1].lower(), i + 1
        elif a.startswith("--ps-type="):
            named, index = a.split("=", 1)[1].lower(), i
    chosen = named or default or "local"
    if force:
        chosen = force
    elif single_node:
        chosen = "local"
    if index is not None:
        out[index] = "--ps-type=" + chosen if out[index].startswith("--ps-type=") else chosen
    return out, chosen


@dataclass
class TrainerNode:
    """One node's share of a job (what `run_trainer_node` needs)."""

    endpoint: str
    run_id: str
    command: list[str]
    nnodes: int = 1
    node_rank: int = 0
    nproc_per_node: int = 1
    ps_servers: int = 0
    # With PS servers: their transport (tcp, rdma), which the trainers must use; without:
    # the default when the command names none (one node: local).
    ps_type: str | None = None
    tee: int = 3
    log_dir: str | None = None
    redirects: str | None = None
    max_restarts: int = 0
    rendezvous_timeout: float = 600.0
    grace_period: float = 10.0
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    # Another reason to stop (e.g. the one-node launcher's PS processes died), or None.
    abort: Callable[[], str | None] | None = None


def torchrun_command(node: TrainerNode) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run",
           "--nnodes", str(node.nnodes), "--nproc-per-node", str(node.nproc_per_node),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", node.endpoint,
           "--rdzv-id", node.run_id, "--rdzv-conf", "is_host=0",
           "--max-restarts", str(node.max_restarts), "--role", "trainer",
           "--tee", str(node.tee)]
    if node.log_dir:
        cmd += ["--log-dir", node.log_dir]
    if node.redirects:
        cmd += ["--redirects", node.redirects]
    first = node.command[0]
    if first == "-m" or first.endswith(".py") or os.path.isfile(first):
        cmd += node.command
    else:
        cmd += ["--no-python", *node.command]
    return cmd


def _heartbeat(endpoint: str, node: TrainerNode, stop: threading.Event) -> None:
    store = JobStore(endpoint, node.run_id, timeout=node.rendezvous_timeout)
    while True:
        store.beat(node.node_rank)
        if stop.wait(HEARTBEAT_S):
            return


def _failure(store: JobStore, node: TrainerNode) -> str | None:
    """Why this node should stop its trainers early, or None."""
    why = node.abort() if node.abort is not None else None
    if why:
        return why
    for n, status in store.trainers_done(node.nnodes).items():
        if n != node.node_rank and status != "0":
            return f"trainer node {n} ended with status {status}"
    for shard, why in store.ps_draining_reasons(range(node.ps_servers)).items():
        return f"PS shard {shard} is draining ({why})"
    for shard, status in store.ps_exit_statuses(range(node.ps_servers)).items():
        return f"PS shard {shard} exited (status {status}) while training"
    return None


def run_trainer_node(node: TrainerNode, store: JobStore | None = None) -> int:
    """Runs this node's trainers to the end (see module doc); their exit status. REQUIRES:
    SIGINT/SIGTERM raise `Interrupted` in this thread (`trap_signals`)."""
    store = store or JobStore(node.endpoint, node.run_id, timeout=node.rendezvous_timeout)
    env = dict(node.env)
    if node.ps_servers and node.ps_type:
        command, ps_type = rewrite_ps_type(node.command, False, None, force=node.ps_type)
    else:
        command, ps_type = rewrite_ps_type(node.command, node.nnodes == 1, node.ps_type)
    env["BAGPIPE_PS_TYPE"] = ps_type
    env.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", PREFIX_TEMPLATE)
    if node.ps_servers:
        env["BAGPIPE_JOB_TOKEN"] = env.get("BAGPIPE_JOB_TOKEN") or store.agree_token(
            secrets.token_hex(16), node.rendezvous_timeout)
        addresses = store.ps_addresses(node.ps_servers, node.rendezvous_timeout, node.abort)
        env["BAGPIPE_PS_ADDRESSES"] = ",".join(addresses)
        print(f"[trainer node {node.node_rank}] PS shards: {env['BAGPIPE_PS_ADDRESSES']}",
              flush=True)
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(node.endpoint, node, stop), daemon=True)
    beat.start()
    status = 1
    trainers: Child | None = None
    try:
        trainers = Child(torchrun_command(dataclasses.replace(node, command=command)), env)
        while True:
            rc = trainers.wait(HEARTBEAT_S / 4)
            if rc is not None:
                status = rc
                break
            why = _failure(store, node)
            if why:
                print(f"[trainer node {node.node_rank}] {why}; stopping the trainers",
                      flush=True)
                trainers.stop(node.grace_period)
                break
    except Interrupted:
        print(f"[trainer node {node.node_rank}] interrupted; stopping the trainers", flush=True)
        status = 130
    finally:
        if trainers is not None and trainers.poll() is None:
            trainers.stop(node.grace_period)
        stop.set()
        beat.join(timeout=HEARTBEAT_S * 2)
        store.trainer_done(node.node_rank, str(status))
    return status


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m torchrec_bagpipe.launch.trainer_role",
                                description="One trainer node of a BagPipe job (torchx "
                                            "trainer role).")
    add_rendezvous_arguments(p)
    p.add_argument("--node-rank", type=int, required=True, help="this node's index")
    p.add_argument("--nnodes", type=int, required=True, help="trainer nodes")
    p.add_argument("--nproc-per-node", type=int, default=1, help="trainers on this node")
    p.add_argument("--store-host-node", type=int, default=-1,
                   help="the node that hosts the store when no PS role does (-1: none)")
    p.add_argument("--ps-servers", type=int, default=0,
                   help="PS shards of the PS role (0: shards live in the trainers)")
    p.add_argument("--ps-type", choices=["local", "tcp", "rdma"], default=None,
                   help="with --ps-servers: the servers' transport (tcp, rdma), imposed on "
                        "the command; without: the default when the command names none "
                        "(one node: local)")
    p.add_argument("--tee", type=int, default=3, help="torchrun --tee (default 3)")
    p.add_argument("--log-dir", default=None, help="torchrun --log-dir")
    p.add_argument("--redirects", default=None, help="torchrun --redirects")
    p.add_argument("--max-restarts", type=int, default=0, help="torchrun --max-restarts")
    p.add_argument("--grace-period", type=float, default=10.0,
                   help="seconds between SIGTERM and SIGKILL when stopping the trainers")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the training script (or -m module) and its arguments")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else list(args.command)
    if not command:
        p.error("no training command given")
    if not 0 <= args.node_rank < args.nnodes or args.nproc_per_node < 1 or args.ps_servers < 0:
        p.error("need 0 <= --node-rank < --nnodes, --nproc-per-node >= 1, --ps-servers >= 0")
    endpoint = rendezvous_endpoint(args)
    node = TrainerNode(
        endpoint=endpoint, run_id=args.run_id, command=command, nnodes=args.nnodes,
        node_rank=args.node_rank, nproc_per_node=args.nproc_per_node,
        ps_servers=args.ps_servers, ps_type=args.ps_type, tee=args.tee, log_dir=args.log_dir,
        redirects=args.redirects, max_restarts=args.max_restarts,
        rendezvous_timeout=args.rendezvous_timeout, grace_period=args.grace_period,
    )
    hosting = args.node_rank == args.store_host_node

    def body() -> int:
        store = JobStore(endpoint, args.run_id, host=hosting, timeout=args.rendezvous_timeout)
        status = run_trainer_node(node, store)
        if hosting:  # the store outlives every node's use of it (bounded)
            watch = TrainerWatch(store, args.nnodes, args.rendezvous_timeout, 15 * HEARTBEAT_S)
            deadline = time.monotonic() + args.rendezvous_timeout
            while not watch.all_done() and time.monotonic() < deadline:
                time.sleep(HEARTBEAT_S / 4)
        return status

    return run_role(body, f"[trainer node {args.node_rank}]")


if __name__ == "__main__":
    sys.exit(main())
