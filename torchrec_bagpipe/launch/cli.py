"""`torchrec-bagpipe-launch`: the one-node shortcut (PS shards and trainers, one command).

    torchrec-bagpipe-launch --nproc-per-node 2 [--ps-servers K] train.py --ps-type rdma ...

It runs the pieces of the torchx job (`torchrec_bagpipe.launch.component`) on this machine:
it hosts the job's rendezvous store on loopback, starts K PS role processes (`ps_role`:
``torchrec-bagpipe-ps`` servers that publish their addresses in the store), and runs the
trainer role (`trainer_role.run_trainer_node`: torchrun with its c10d rendezvous on the
store, output behind torchrun's own ``[trainer <rank>]`` prefixes). Without ``--ps-servers``
the PS shards live inside the trainers (BagPipeConfig's zero-config default). On one node
the local backend is used whatever ``--ps-type`` the training command names: it is rewritten
to ``--ps-type local`` and ``BAGPIPE_PS_TYPE=local`` is exported (PS servers are then reached
over loopback TCP). More nodes: the torchx component (docs/running.md, "Two nodes").

If any process fails, or on Ctrl-C / SIGTERM, everything is stopped: SIGTERM, a bounded grace
period, then SIGKILL. The exit status is the trainers' (130 after an interrupt, 124 after
``--timeout``, 1 when a PS shard failed).
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import threading
import time
from collections.abc import Sequence

from torchrec_bagpipe.launch.processes import Child, Interrupted, trap_signals
from torchrec_bagpipe.launch.rendezvous import JobStore
from torchrec_bagpipe.launch.trainer_role import TrainerNode, run_trainer_node

__all__ = ["main", "parse_args"]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="torchrec-bagpipe-launch",
        description="Start BagPipe PS shards and torchrun trainers on this machine with one "
                    "command (more machines: the torchx component, see docs/running.md).",
    )
    p.add_argument("--nproc-per-node", type=int, default=1, help="trainer processes")
    p.add_argument("--rdzv-port", type=int, default=0,
                   help="port of the job's rendezvous store on loopback (0: pick one)")
    p.add_argument("--ps-type", choices=["local", "tcp", "rdma"], default=None,
                   help="accepted for the training command's sake; one node always uses the "
                        "local backend")
    p.add_argument("--ps-servers", type=int, default=0,
                   help="PS server processes to start (0: shards live in the trainers)")
    p.add_argument("--ps-host", default="127.0.0.1", help="host the PS servers listen on")
    p.add_argument("--ps-server-args", default="",
                   help="extra arguments for every torchrec-bagpipe-ps server (one string)")
    p.add_argument("--startup-timeout", type=float, default=60.0,
                   help="seconds for each PS server to listen and for the trainers to find "
                        "them")
    p.add_argument("--grace-period", type=float, default=10.0,
                   help="seconds between SIGTERM and SIGKILL when stopping processes")
    p.add_argument("--timeout", type=float, default=None,
                   help="stop everything after this many seconds (default: no limit)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="whole-job checkpoints go here (PS servers checkpoint into "
                        "DIR/ps/shard-I; trainers get $BAGPIPE_CHECKPOINT_DIR)")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="a whole-job checkpoint every N training steps "
                        "($BAGPIPE_CHECKPOINT_EVERY; needs a checkpoint directory)")
    p.add_argument("--resume", default=None,
                   help="resume from the whole-job checkpoint in this directory (PS servers "
                        "restore its set, trainers get $BAGPIPE_RESUME); later checkpoints go "
                        "there too unless --checkpoint-dir says otherwise")
    p.add_argument("--log-dir", default=None, help="torchrun --log-dir (per-rank log files)")
    p.add_argument("--redirects", default=None,
                   help="torchrun --redirects (0-3: which streams go only to the log files)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the training script and its arguments")
    args = p.parse_args(list(argv))
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        p.error("no training command given")
    if args.nproc_per_node < 1 or args.ps_servers < 0:
        p.error("--nproc-per-node must be >= 1 and --ps-servers >= 0")
    if args.checkpoint_every < 0:
        p.error("--checkpoint-every must be >= 0")
    if args.checkpoint_every and not (args.checkpoint_dir or args.resume):
        p.error("--checkpoint-every needs --checkpoint-dir (or --resume)")
    if args.resume:
        from torchrec_bagpipe.distributed.checkpoint_manifest import read_manifest

        if read_manifest(args.resume) is None:
            p.error(f"--resume {args.resume}: no whole-job checkpoint there (no MANIFEST.json)")
    args.command = command
    return args


def _ps_command(args: argparse.Namespace, endpoint: str, run_id: str, shard: int) -> list[str]:
    return [sys.executable, "-m", "torchrec_bagpipe.launch.ps_role",
            "--rendezvous", endpoint, "--run-id", run_id,
            "--rendezvous-timeout", str(args.startup_timeout),
            "--replica-id", str(shard), "--num-replicas", str(args.ps_servers),
            "--store-host-replica", "-1", "--nnodes", "1", "--host", args.ps_host,
            "--startup-timeout", str(args.startup_timeout),
            "--grace-period", str(args.grace_period), f"--server-args={args.ps_server_args}",
            *(["--checkpoint-dir", os.path.abspath(args.checkpoint_dir)]
              if args.checkpoint_dir else []),
            *(["--resume", os.path.abspath(args.resume)] if args.resume else [])]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if args.ps_servers:
        env.setdefault("BAGPIPE_JOB_TOKEN", secrets.token_hex(16))  # one secret per job
    if args.checkpoint_dir or args.resume:
        env["BAGPIPE_CHECKPOINT_DIR"] = os.path.abspath(args.checkpoint_dir or args.resume)
        env["BAGPIPE_CHECKPOINT_EVERY"] = str(args.checkpoint_every)
    if args.resume:
        env["BAGPIPE_RESUME"] = os.path.abspath(args.resume)
    run_id = "launch-" + secrets.token_hex(6)
    store = JobStore(f"127.0.0.1:{args.rdzv_port}", run_id, host=True,
                     timeout=args.startup_timeout)
    endpoint = store.endpoint
    if args.ps_type not in (None, "local"):
        print(f"[launch] single node: using the local PS backend instead of {args.ps_type}",
              flush=True)
    servers: list[Child] = []
    restore = trap_signals()
    status = 1
    timer: threading.Timer | None = None
    try:
        servers = [Child(_ps_command(args, endpoint, run_id, s), env)
                   for s in range(args.ps_servers)]
        if args.timeout is not None:
            timer = threading.Timer(args.timeout, _interrupt_main)
            timer.daemon = True
            timer.start()
        started = time.monotonic()

        def ps_failed() -> str | None:
            for s, server in enumerate(servers):
                if server.poll() is not None:
                    return f"PS shard {s} exited with status {server.poll()}"
            return None

        status = run_trainer_node(TrainerNode(
            endpoint=endpoint, run_id=run_id, command=list(args.command),
            # One node: the local backend (the servers here speak TCP).
            nproc_per_node=args.nproc_per_node, ps_servers=args.ps_servers,
            ps_type=None, log_dir=args.log_dir, redirects=args.redirects,
            rendezvous_timeout=args.startup_timeout, grace_period=args.grace_period, env=env,
            abort=ps_failed,
        ), store)
        if args.timeout is not None and status == 130 and \
                time.monotonic() - started >= args.timeout:
            print(f"[launch] --timeout {args.timeout}s reached; stopped everything", flush=True)
            status = 124
        # The PS shards drain once the trainers are done; a shard that failed fails the job.
        for s, server in enumerate(servers):
            rc = server.wait(args.grace_period * 3)
            if rc not in (0, None) and status == 0:
                print(f"[launch] PS shard {s} exited with status {rc}", flush=True)
                status = 1
    except Interrupted:
        print("[launch] interrupted; stopping everything", flush=True)
        status = 130
    except (RuntimeError, TimeoutError, ValueError) as e:
        print(f"[launch] {e}; stopping everything", flush=True)
        status = 1
    finally:
        if timer is not None:
            timer.cancel()
        for server in servers:
            server.stop(args.grace_period)
        restore()
    if status != 0:
        print(f"[launch] exit status {status}", flush=True)
    return status


def _interrupt_main() -> None:
    import _thread

    _thread.interrupt_main()  # raises Interrupted through the SIGINT handler
