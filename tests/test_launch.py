"""`torchrec-bagpipe-launch`: trainers under torchrun, prefixed logs, clean stops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch.distributed as dist
    dist.init_process_group("gloo")
    r = dist.get_rank()
    print(f"hello rank={r} ps_type={os.environ.get('BAGPIPE_PS_TYPE')} argv={sys.argv[1:]}",
          flush=True)
    if "--fail" in sys.argv and r == 1:
        raise SystemExit(3)
    if "--hang" in sys.argv:
        open(os.environ["HANG_MARK"] + f".{r}", "w").close()
        time.sleep(600)
    dist.barrier()
    dist.destroy_process_group()
    """
)


def _launch(tmp_path, *extra: str, env: dict[str, str] | None = None,
            **kw) -> subprocess.Popen:
    script = tmp_path / "tiny.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torchrec_bagpipe.launch", "--nproc-per-node", "2",
           "--grace-period", "5", str(script), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": REPO, **(env or {})},
                            start_new_session=True, **kw)


def _alive_children(marker: str) -> int:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, timeout=10)
    return sum(1 for line in out.stdout.splitlines() if marker in line and "ps -eo" not in line)


def test_runs_trainers_with_prefixed_logs_and_the_local_backend(tmp_path):
    p = _launch(tmp_path, "--ps-type", "rdma")
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out
    for r in (0, 1):
        assert f"[trainer {r}] hello rank={r} ps_type=local argv=['--ps-type', 'local']" in out


def test_a_failing_trainer_stops_everything_with_its_status(tmp_path):
    p = _launch(tmp_path, "--fail")
    out, _ = p.communicate(timeout=120)
    assert p.returncode != 0
    assert "[launch] exit status" in out


def test_ctrl_c_stops_every_process(tmp_path):
    mark = str(tmp_path / "hang")
    p = _launch(tmp_path, "--hang", env={"HANG_MARK": mark})
    deadline = time.monotonic() + 90
    while not all(os.path.exists(f"{mark}.{r}") for r in (0, 1)):
        assert time.monotonic() < deadline, "trainers did not start"
        assert p.poll() is None
        time.sleep(0.2)
    os.killpg(p.pid, signal.SIGINT)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 130, out
    assert "interrupted" in out
    time.sleep(0.5)
    assert _alive_children(str(tmp_path / "tiny.py")) == 0


def test_dlrm_example_through_ps_server_processes(tmp_path):
    """One command: 2 PS servers + 2 trainers running the DLRM example over TCP."""
    metrics = tmp_path / "metrics.json"
    cmd = [
        sys.executable, "-m", "torchrec_bagpipe.launch", "--nproc-per-node", "2",
        "--ps-servers", "2", "--ps-server-args=--quiet",
        os.path.join(REPO, "examples", "dlrm", "dlrm_main.py"),
        "--limit_train_batches", "12", "--batch_size", "32", "--num_embeddings", "500",
        "--embedding_dim", "8", "--dense_arch_layer_sizes", "16,8",
        "--over_arch_layer_sizes", "16,1", "--learning_rate", "0.05", "--limit_val_batches", "2",
        "--limit_test_batches", "2", "--ps-type", "rdma", "--optimization-prescan",
        "--optimization-cache-capacity", "4", "--placement-min-rows", "0",
        "--metrics_json", str(metrics), "--no_progress",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "[ps 0] listening 127.0.0.1:" in out.stdout
    assert "[trainer node 0] PS shards: 127.0.0.1:" in out.stdout
    assert "[trainer 0] BagPipe metrics" in out.stdout
    import json

    results = json.loads(metrics.read_text())
    assert results["steps"] == 12
    summary = results["bagpipe"]
    # Every access is a hit, a prefetch-served row or a demand fetch (runtime accounting).
    c = summary["counters"]
    assert c["hits"] + c["prefetch_served"] + c["demand_fetched"] == c["accesses"] > 0


def test_a_ps_shard_sigterm_stops_the_job_cleanly(tmp_path):
    """SIGTERM to a PS server mid-training: its clients are told at once (ShuttingDownError
    naming the shard, when they reach it before the launcher stops them), the launcher stops
    the trainers and exits non-zero, explaining why, without waiting for the server's drain
    (set to 600 s here: the 120 s wait below would fail first)."""
    import re
    import threading

    cmd = [
        sys.executable, "-m", "torchrec_bagpipe.launch", "--nproc-per-node", "2",
        "--ps-servers", "2", "--ps-server-args=--quiet --drain-timeout 600",
        "--grace-period", "10",
        os.path.join(REPO, "examples", "dlrm", "dlrm_main.py"),
        "--limit_train_batches", "100000", "--batch_size", "32", "--num_embeddings", "500",
        "--embedding_dim", "8", "--dense_arch_layer_sizes", "16,8",
        "--over_arch_layer_sizes", "16,1", "--learning_rate", "0.05", "--no_progress",
        "--metrics_json", str(tmp_path / "metrics.json"),  # also marks this job's processes
    ]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, "PYTHONPATH": REPO}, start_new_session=True)
    lines: list[str] = []
    pump = threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True)
    pump.start()
    try:
        deadline = time.monotonic() + 180
        while not any("PS shards:" in line for line in lines):
            assert p.poll() is None, "".join(lines[-50:])
            assert time.monotonic() < deadline, "the job did not start"
            time.sleep(0.2)
        time.sleep(8)  # the trainers are training by now
        assert p.poll() is None, "".join(lines[-50:])
        out = subprocess.run(["ps", "-ww", "-eo", "pid,ppid,args"], capture_output=True,
                             text=True, timeout=10).stdout
        parent = {int(f[0]): int(f[1]) for f in (ln.split(None, 2) for ln in out.splitlines()[1:])}

        def ours(pid: int) -> bool:  # a descendant of this launcher (not another job's)
            while pid > 1:
                pid = parent.get(pid, 0)
                if pid == p.pid:
                    return True
            return False

        pids = [int(line.split()[0]) for line in out.splitlines()
                if re.search(r"torchrec_bagpipe\.ps\.server --shard-id 1 ", line)
                and ours(int(line.split()[0]))]
        assert len(pids) == 1, out
        t0 = time.monotonic()
        os.kill(pids[0], signal.SIGTERM)
        p.wait(timeout=120)
        elapsed = time.monotonic() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)
    pump.join(timeout=10)
    text = "".join(lines)
    assert p.returncode != 0, text[-4000:]
    assert "PS shard 1 is draining (its server: SIGTERM)" in text, text[-4000:]
    # A trainer that reached the draining shard first names it (which one comes first, the
    # trainer's request or the launcher's stop, is a race).
    assert "ShuttingDownError" not in text or "is shutting down: SIGTERM" in text, text[-4000:]
    assert "[launch] exit status" in text
    print(f"job stopped {elapsed:.1f} s after the SIGTERM")
    print("".join(ln for ln in lines if any(w in ln for w in ("drain", "launch]", "stopping"))))
    time.sleep(0.5)
    assert _alive_children(str(tmp_path)) == 0
