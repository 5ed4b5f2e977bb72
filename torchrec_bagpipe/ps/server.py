"""The PS shard server program: ``torchrec-bagpipe-ps`` / ``python -m torchrec_bagpipe.ps.server``.

Serves one PS shard over TCP (or over UCX with ``--transport rdma``: RDMA verbs on a fabric,
shared memory or TCP elsewhere). On start it prints one line to stdout,
``listening HOST:PORT shard I/N`` (with the port the kernel picked when ``--port 0``; and
``draining shard I/N: SIGNAL`` when a signal starts the drain), and logs
one line per session event to stderr. SIGTERM (or SIGINT) drains: the server tells every
connected trainer (they stop with a `ShuttingDownError` naming the shard), refuses new work,
waits for them to close their sessions (up to ``--drain-timeout``), closes the rest,
checkpoints every table when ``--checkpoint-dir`` is set, and exits 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.ps.config_specs import shard_spec
from torchrec_bagpipe.ps.shard_specs import ShardSpec, TcpServerSpec, UcxServerSpec
from torchrec_bagpipe.ps.table_specs import StoreLayout

__all__ = ["CONFIG_FLAGS", "build_parser", "main"]

# The flags' defaults are the specs' (this module imports the shard, and torch, only after
# the flags became specs, so --help and usage errors are fast).
_SHARD = ShardSpec()
_STORE = StoreLayout()
_TCP = TcpServerSpec()
_UCX = UcxServerSpec()

# The flags that are BagPipeConfig fields: same names, same help as a trainer's (the values
# reach the shard through torchrec_bagpipe.ps.config_specs.shard_spec, like a trainer-hosted
# shard's). The other flags are the server's own, each one a spec field of the same name.
CONFIG_FLAGS = {
    "network": ("job_token",),
    "store": ("memory_budget", "spill_dir", "store_threads"),
    "checkpoints": ("ps_checkpoint_incremental", "ps_checkpoint_full_every",
                    "ps_checkpoint_chain_fraction", "ps_checkpoint_background", "partitioner"),
}

EPILOG = """\
Clients authenticate with the job token (--job-token, or the BAGPIPE_JOB_TOKEN environment
variable, which keeps it off the command line); frames of other jobs and of strangers are
refused. Every trainer rank opens a session per fused table; the first open fixes its
learning rate, dimension and world size.

Checkpoints: with --checkpoint-dir each table is saved to DIR/table-NAME (crash-safe, with its
committed step in the checkpoint's meta) every --checkpoint-every committed steps and when
the server drains; a trainer's checkpoint request with a label (a whole-job checkpoint)
saves into DIR/LABEL/table-NAME. A restarted server restores them (--restore, the default
when DIR holds checkpoints; --restore-from DIR/LABEL for a labelled set). A set written by
another number of shards restores with --restore-resharded D0,D1,... (every old shard's
directory of the set): the server keeps the rows --partitioner (the trainers') routes to it,
with their optimizer state. A training job
opening a table whose committed step is past -1 must resume from exactly that step (its
steps are numbered after it); a fresh job is refused, naming the table and the steps.

Examples:
  torchrec-bagpipe-ps --shard-id 0 --num-shards 2 --port 0 --checkpoint-dir /ckpt/ps0
  BAGPIPE_JOB_TOKEN=secret torchrec-bagpipe-ps --host 0.0.0.0 --port 7000 --memory-budget 64G \\
      --spill-dir /nvme/spill --store-threads 8
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchrec-bagpipe-ps",
        description="Serve one torchrec_bagpipe parameter-server shard over TCP or UCX (rdma).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("shard")
    g.add_argument("--shard-id", type=int, default=_SHARD.shard_id,
                   help=f"this shard's index (default {_SHARD.shard_id})")
    g.add_argument("--num-shards", type=int, default=_SHARD.num_shards,
                   help=f"how many shards the job has (default {_SHARD.num_shards})")
    g = p.add_argument_group("network")
    g.add_argument("--host", default=_TCP.host,
                   help=f"address to bind (default {_TCP.host}; 0.0.0.0 for every interface)")
    g.add_argument("--port", type=int, default=_TCP.port,
                   help="TCP port; 0 picks a free one and prints it (default 0)")
    g.add_argument("--transport", choices=("tcp", "rdma"), default="tcp",
                   help="tcp: frames over TCP on --port; rdma: UCX (RDMA verbs on a fabric, "
                        "shared memory or TCP elsewhere, per UCX_TLS / --ucx-tls), bootstrapped "
                        "on the TCP control port --port; clients then use ucx://HOST:PORT "
                        "(default tcp)")
    g.add_argument("--ucx-tls", default=None,
                   help="rdma: UCX transports, overriding $UCX_TLS (e.g. rc,sm,self or tcp)")
    g.add_argument("--ucx-devices", default=None,
                   help="rdma: UCX devices, overriding $UCX_NET_DEVICES (e.g. mlx5_0:1)")
    BagPipeConfig.add_arguments(g, CONFIG_FLAGS["network"], group=None)
    g.add_argument("--allow-no-token", action="store_true",
                   help="serve without a job token on an address other than loopback (refused "
                        "otherwise: anyone who reaches the port could read and write every "
                        "table)")
    g.add_argument("--handshake-timeout", type=float, default=_TCP.handshake_timeout,
                   help="seconds from accept by which a connection must have authenticated "
                        f"(an absolute deadline; default {_TCP.handshake_timeout:g})")
    g.add_argument("--idle-timeout", type=float, default=_TCP.idle_timeout,
                   help="tcp: seconds an authenticated connection may send nothing before it "
                        "is closed (clients send keep-alives every 30 s; 0: no limit; "
                        f"default {_TCP.idle_timeout:g})")
    g.add_argument("--max-connections", type=int, default=_TCP.max_connections,
                   help="concurrent connections; when every one is authenticated, more are "
                        f"refused (default {_TCP.max_connections})")
    g.add_argument("--max-unauthenticated", type=int, default=_TCP.max_unauthenticated,
                   help="connections that have not authenticated yet; a new one sheds the "
                        f"oldest (default {_TCP.max_unauthenticated})")
    g.add_argument("--max-unauthenticated-per-host", type=int,
                   default=_TCP.max_unauthenticated_per_host,
                   help=f"of those, from one address (default "
                        f"{_TCP.max_unauthenticated_per_host})")
    g.add_argument("--io-threads", type=int, default=None,
                   help=f"threads serving the connections (default {_TCP.io_threads} for tcp, "
                        f"{_UCX.io_threads} bootstrap threads for rdma)")
    g.add_argument("--progress-threads", type=int, default=_UCX.progress_threads,
                   help="rdma: threads driving every established UCX connection (default "
                        f"{_UCX.progress_threads})")
    g.add_argument("--max-frame-bytes", type=int, default=_SHARD.max_frame_bytes,
                   help=f"largest frame accepted (default {_SHARD.max_frame_bytes})")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to wait for trainers to close (default 30)")
    g = p.add_argument_group("store (every table of this shard)")
    g.add_argument("--dim", type=int, default=None,
                   help="accept only tables of this row width (default: any)")
    BagPipeConfig.add_arguments(g, CONFIG_FLAGS["store"], group=None)
    g.add_argument("--store-shards", type=int, default=_STORE.num_shards,
                   help="internal hash shards of each store, a power of two (default "
                        f"{_STORE.num_shards})")
    g.add_argument("--page-rows", type=int, default=None,
                   help="rows per arena page, a power of two (default: about 2 MiB pages)")
    g = p.add_argument_group("checkpoints")
    g.add_argument("--checkpoint-dir", default=None, help="where table checkpoints go")
    g.add_argument("--checkpoint-every", type=int, default=_SHARD.checkpoint_every,
                   help="checkpoint each table every N committed steps (default 0: only on "
                        "drain and on a client's request)")
    BagPipeConfig.add_arguments(g, CONFIG_FLAGS["checkpoints"], group=None)
    g.add_argument("--restore", action=argparse.BooleanOptionalAction, default=None,
                   help="load the checkpoints in --checkpoint-dir at start (default: when "
                        "there are any)")
    g.add_argument("--restore-from", default=None, metavar="DIR",
                   help="load the table checkpoints in DIR at start instead (e.g. one set of "
                        "a whole-job checkpoint, CHECKPOINT_DIR/step-N, which a trainer's "
                        "checkpoint request with a label wrote)")
    g.add_argument("--restore-resharded", default=None, metavar="D0,D1,...",
                   help="load a checkpoint set written by another number of shards: every old "
                        "shard's directory of the set, comma-separated; this server keeps the "
                        "rows --partitioner routes to it")
    g = p.add_argument_group("logging")
    g.add_argument("--quiet", action="store_true", help="no per-session log lines")
    return p


def _log(prefix: str, text: str) -> None:
    ts = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"{ts} [{prefix}] {text}", file=sys.stderr, flush=True)


def _has_checkpoints(directory: str | None) -> bool:
    if not directory or not os.path.isdir(directory):
        return False
    return any(e.startswith("table-") for e in os.listdir(directory))


def _specs(args: argparse.Namespace, config: BagPipeConfig, token: str
           ) -> tuple[ShardSpec, TcpServerSpec | UcxServerSpec]:
    """The shard's and its server's specs from the flags (each flag is the spec field of the
    same name; errors name the field)."""
    shard = shard_spec(
        config, args.shard_id, args.num_shards,
        store=StoreLayout(num_shards=args.store_shards, page_rows=args.page_rows),
        dim=args.dim, checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every, max_frame_bytes=args.max_frame_bytes,
    )
    limits = {
        "host": args.host,
        "port": args.port,
        "job_token": token,
        "allow_no_token": bool(args.allow_no_token),
        "handshake_timeout": args.handshake_timeout,
        "max_connections": args.max_connections,
        "max_unauthenticated": args.max_unauthenticated,
        "max_unauthenticated_per_host": args.max_unauthenticated_per_host,
    }
    if args.io_threads is not None:
        limits["io_threads"] = args.io_threads
    # Both are built, so a bad value of either transport's flags is refused.
    ucx = UcxServerSpec(ucx_tls=args.ucx_tls, ucx_devices=args.ucx_devices,
                        progress_threads=args.progress_threads, **limits)
    tcp = TcpServerSpec(idle_timeout=args.idle_timeout, **limits)
    return shard, ucx if args.transport == "rdma" else tcp


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def usage(problem: object) -> int:
        print(f"torchrec-bagpipe-ps: {problem}", file=sys.stderr)
        return 2

    try:
        config = BagPipeConfig.from_args(args)
        token = config.job_token
        if token is None:
            token = os.environ.get("BAGPIPE_JOB_TOKEN", "")
        shard_settings, server_settings = _specs(args, config, token)
    except (ValueError, TypeError) as e:
        return usage(e)
    prefix = f"bagpipe-ps shard {args.shard_id}/{args.num_shards}"
    restore: bool | str | list[str] = (args.restore if args.restore is not None
                           else _has_checkpoints(args.checkpoint_dir))
    if args.restore_from is not None and args.restore_resharded is not None:
        return usage("--restore-from and --restore-resharded exclude each other")
    if args.restore_from is not None:
        if args.restore:
            return usage("--restore and --restore-from exclude each other")
        if not _has_checkpoints(args.restore_from):
            return usage(f"--restore-from {args.restore_from}: no table checkpoints there")
        restore = args.restore_from
    if args.restore_resharded is not None:
        if args.restore:
            return usage("--restore and --restore-resharded exclude each other")
        parts = [d for d in args.restore_resharded.split(",") if d]
        missing = [d for d in parts if not _has_checkpoints(d)]
        if not parts or missing:
            return usage(f"--restore-resharded: no table checkpoints in {missing or parts}")
        restore = parts
    if restore is True and not args.checkpoint_dir:
        return usage("--restore needs --checkpoint-dir")
    from torchrec_bagpipe.ps.shard import PSShard

    try:
        shard = PSShard(shard_settings, verbose=not args.quiet,
                        restore=restore if isinstance(restore, (str, list)) else bool(restore),
                        partitioner=config.partitioner)
        if isinstance(server_settings, UcxServerSpec):
            server = shard.serve_ucx(server_settings)
        else:
            server = shard.serve(server_settings)
    except (ValueError, TypeError, OSError, RuntimeError) as e:
        return usage(e)

    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if not args.quiet:
        for table, step in sorted(shard.restored.items()):
            _log(prefix, f"serving restored table '{table}' at committed step {step}")
        _log(prefix, f"listening on {server.address}" + (" (job token set)" if token else ""))
    print(f"listening {server.host}:{server.port} shard {args.shard_id}/{args.num_shards}",
          flush=True)
    while not stop.wait(0.5):
        pass
    if not args.quiet:
        _log(prefix, f"{received[0]}: draining (up to {args.drain_timeout:g} s)")
    # Documented like the listening line: the launcher's PS role tells the trainers.
    print(f"draining shard {args.shard_id}/{args.num_shards}: {received[0]}", flush=True)
    # Connected trainers are told at once (they stop with a ShuttingDownError naming this
    # shard) instead of carrying on until the drain cuts them off.
    shard.begin_shutdown(f"{received[0]}: draining")
    server.stop(args.drain_timeout)
    code = 0
    if args.checkpoint_dir and shard.tables():
        try:
            steps = shard.checkpoint()
            if not args.quiet:
                saved = ", ".join(f"'{t}' at step {s}" for t, s in sorted(steps.items()))
                _log(prefix, f"checkpointed {saved}")
        except (OSError, ValueError) as e:
            _log(prefix, f"checkpoint on drain failed: {e}")
            code = 1
    shard.close()
    if not args.quiet:
        _log(prefix, "stopped")
    return code


if __name__ == "__main__":
    sys.exit(main())
