"""Multi-process PS runs: trainer ranks and shard servers as separate processes on loopback.

* 2 ranks x 2 `torchrec-bagpipe-ps` servers for a few hundred steps equal the reference.
* Killing a shard mid-run makes every rank raise within its timeout; restarting the shard
  from its checkpoint and replaying from the committed step ends equal to the reference.

Both run over tcp and over rdma (UCX over shared memory, then over TCP).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from ps_job import CLIENT, DIM, INIT, KEYS, LR, TABLE, batch
from ps_reference import ReferencePS
from ps_transports import address, params, server_args

from torchrec_bagpipe.ps import PSClient, spawn_server

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
TOKEN = "processes-test"


class Rank:
    """A rank worker process whose JSON events are collected on a thread."""

    def __init__(self, rank: int, world: int, addresses: list[str], end: int,
                 start: str = "auto", timeout: float = 20.0) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), env.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen(
            [sys.executable, str(TESTS / "ps_rank_worker.py"), "--rank", str(rank),
             "--world", str(world), "--addresses", ",".join(addresses), "--token", TOKEN,
             "--start", start, "--end", str(end), "--timeout", str(timeout)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        self.events: list[dict] = []
        self.stderr = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.append(json.loads(line))

    def last_step(self) -> int:
        steps = [e["step"] for e in list(self.events) if e["event"] == "step"]
        return max(steps, default=-1)

    def finish(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(10)
        assert self.proc.stderr is not None
        self.stderr = self.proc.stderr.read()
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def reference(steps: int, world: int) -> np.ndarray:
    ref = ReferencePS(DIM, LR, world, **INIT)
    for t in range(steps):
        ref.apply_step([batch(t, r) for r in range(world)])
    return ref.lookup(list(range(KEYS)))


def read_table(addresses: list[str]) -> tuple[np.ndarray, list[int]]:
    """Rows of every key through a fresh one-rank session (the job's sessions have ended)."""
    with PSClient(addresses, table=TABLE, dim=DIM, lr=LR, world_size=1, job_token=TOKEN,
                  session_id=1, timeout=20.0, expected_step=None, **INIT, **CLIENT) as c:
        return c.lookup(torch.arange(KEYS)).numpy(), c.shard_committed_steps()


def assert_same_bits(got: np.ndarray, want: np.ndarray) -> None:
    diff = np.nonzero((got.view(np.uint32) != want.view(np.uint32)).any(axis=1))[0]
    assert diff.size == 0, f"{diff.size} rows differ from the reference, e.g. key {diff[:5]}"


@pytest.fixture
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The transport of this run; rdma-* set UCX_TLS, which server and rank processes inherit."""
    if request.param.startswith("rdma-"):
        monkeypatch.setenv("UCX_TLS", request.param.split("-", 1)[1])
    return str(request.param)


@pytest.mark.parametrize("transport", params("tcp"), indirect=True)
def test_two_ranks_two_server_processes_equal_reference(tmp_path: Path, transport: str) -> None:
    steps = 300
    logs = [open(tmp_path / f"shard{i}.log", "w") for i in range(2)]  # noqa: SIM115
    servers = [spawn_server(i, 2, job_token=TOKEN, stderr=logs[i], args=server_args(transport))
               for i in range(2)]
    try:
        addresses = [address(s, transport) for s in servers]
        ranks = [Rank(r, 2, addresses, steps) for r in range(2)]
        for r in ranks:
            assert r.finish(240) == 0, (r.events[-3:], r.stderr[-2000:])
        done = ranks[0].events[-1]
        assert done["event"] == "done"
        assert done["stats"]["commits"] == steps
        assert done["stats"]["packets"] >= steps * 2  # a marker per shard per step at least
        got, committed = read_table(addresses)
        assert committed == [steps - 1, steps - 1]
        assert_same_bits(got, reference(steps, 2))
        for s in servers:
            assert s.terminate(60) == 0  # SIGTERM drains and exits 0
    finally:
        for s in servers:
            s.kill()
        for f in logs:
            f.close()
    log = (tmp_path / "shard0.log").read_text()
    assert "rank 1/2 opened" in log and "rank 1 closed" in log and "SIGTERM: draining" in log


@pytest.mark.parametrize("transport", params("tcp"), indirect=True)
def test_killed_shard_fails_every_rank_then_restart_and_replay(tmp_path: Path,
                                                              transport: str) -> None:
    steps, timeout = 200, 20.0
    ckpt = [tmp_path / f"ckpt{i}" for i in range(2)]
    logs = [open(tmp_path / f"shard{i}.log", "w") for i in range(3)]  # noqa: SIM115

    def server(i: int, log: int) -> object:
        return spawn_server(i, 2, job_token=TOKEN, stderr=logs[log],
                            args=["--checkpoint-dir", str(ckpt[i]), "--checkpoint-every", "25",
                                  *server_args(transport)])

    servers = [server(0, 0), server(1, 1)]
    restarted = None
    try:
        addresses = [address(s, transport) for s in servers]
        ranks = [Rank(r, 2, addresses, steps, timeout=timeout) for r in range(2)]
        deadline = time.monotonic() + 120
        while min(r.last_step() for r in ranks) < 60:
            assert time.monotonic() < deadline, [r.events[-2:] for r in ranks]
            assert all(r.proc.poll() is None for r in ranks), [r.events[-2:] for r in ranks]
            time.sleep(0.01)
        servers[1].kill()  # SIGKILL shard 1 in the middle of the run
        killed_at = time.time()
        for r in ranks:
            assert r.finish(timeout + 30) == 3, r.events[-3:]
            err = r.events[-1]
            assert err["event"] == "error", err
            assert err["type"] in ("TransportError", "SessionError"), err
            assert err["t"] - killed_at < timeout, err  # raised within its timeout
        last = [r.events[-1] for r in ranks]
        assert any("PS shard 1" in e["message"] for e in last), last

        # Restart shard 1 from its checkpoint; the ranks replay from the committed step.
        restarted = server(1, 2)
        addresses = [address(servers[0], transport), address(restarted, transport)]
        time.sleep(0.5)  # let shard 0 notice the dead ranks' connections are gone
        replay = [Rank(r, 2, addresses, steps, timeout=timeout) for r in range(2)]
        for r in replay:
            assert r.finish(240) == 0, (r.events[-3:], r.stderr[-2000:])
        opened = replay[0].events[0]
        shard0_step, shard1_step = opened["committed"]
        assert shard1_step >= 24 and (shard1_step + 1) % 25 == 0  # a periodic checkpoint
        assert opened["start"] == min(shard0_step, shard1_step) + 1
        got, committed = read_table(addresses)
        assert committed == [steps - 1, steps - 1]
        assert_same_bits(got, reference(steps, 2))
        assert restarted.terminate(60) == 0
        assert servers[0].terminate(60) == 0
    finally:
        for s in [*servers, restarted]:
            if s is not None:
                s.kill()
        for f in logs:
            f.close()
    assert "restored from" in (tmp_path / "shard2.log").read_text()
