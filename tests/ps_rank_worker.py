"""One trainer rank in its own process (used by tests/test_ps_processes.py).

Commits the job's batches for steps [start, end) over TCP and prints one JSON line per event
(open, progress every 10 steps, done, or error) to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from ps_job import CLIENT, DIM, INIT, LR, TABLE, batch

from torchrec_bagpipe.ps import PSClient


def emit(**event: object) -> None:
    print(json.dumps({"t": time.time(), **event}), flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--addresses", required=True)
    p.add_argument("--token", default="")
    p.add_argument("--start", default="auto", help="first step, or 'auto': committed step + 1")
    p.add_argument("--end", type=int, required=True)
    p.add_argument("--timeout", type=float, default=20.0)
    args = p.parse_args()
    try:
        # 'auto' replays from the shards' committed steps, which it reads itself (they may
        # differ after a restored shard: committed steps are acknowledged again, not
        # applied), so the session attaches without a start-step check.
        client = PSClient(args.addresses.split(","), table=TABLE, dim=DIM, lr=LR, rank=args.rank,
                          world_size=args.world, job_token=args.token, timeout=args.timeout,
                          expected_step=None if args.start == "auto" else int(args.start) - 1,
                          **INIT, **CLIENT)
        start = client.committed_step() + 1 if args.start == "auto" else int(args.start)
        emit(event="open", committed=client.shard_committed_steps(), start=start)
        for t in range(start, args.end):
            keys, grads = batch(t, args.rank)
            client.commit(t, torch.from_numpy(keys), torch.from_numpy(grads))
            if t % 10 == 0:
                emit(event="step", step=t)
        client.close()
        emit(event="done", stats=client.stats())
        return 0
    except Exception as e:
        emit(event="error", type=type(e).__name__, message=str(e))
        return 3


if __name__ == "__main__":
    sys.exit(main())
