"""The torchx component and its pieces: the job's rendezvous store, the role programs, and
a 2-trainer + 1-PS DLRM job end to end on torchx's local scheduler."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torchx.specs as specs

from torchrec_bagpipe.launch.component import bagpipe
from torchrec_bagpipe.launch.ps_role import (
    advertised_host,
    build_parser,
    checkpoint_server_args,
    rendezvous_endpoint,
)
from torchrec_bagpipe.launch.rendezvous import JobStore, TrainerWatch, parse_endpoint
from torchrec_bagpipe.launch.trainer_role import TrainerNode, rewrite_ps_type, torchrun_command

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- the component ---------------------------------------------------------------------------
def test_component_has_a_ps_role_first_and_a_trainer_role():
    app = bagpipe("--lr", "1", script="train.py", j="3x4", ps=2, ps_args="--memory-budget 8G",
                  rdzv_port=29600)
    ps, trainer = app.roles
    assert (ps.name, ps.num_replicas, trainer.name, trainer.num_replicas) == (
        "ps", 2, "trainer", 3)
    assert ps.args[:2] == ["-m", "torchrec_bagpipe.launch.ps_role"]
    assert trainer.args[:2] == ["-m", "torchrec_bagpipe.launch.trainer_role"]
    for role in (ps, trainer):
        a = role.args
        # Both roles meet at the first role's replica 0, through torchx's macros.
        assert a[a.index("--rendezvous-host-env") + 1] == specs.macros.rank0_env
        assert a[a.index("--rendezvous-port") + 1] == "29600"
        assert a[a.index("--run-id") + 1] == specs.macros.app_id
    assert ps.args[ps.args.index("--replica-id") + 1] == specs.macros.replica_id
    assert "--server-args=--memory-budget 8G" in ps.args
    t = trainer.args
    assert t[t.index("--node-rank") + 1] == specs.macros.replica_id
    assert (t[t.index("--nnodes") + 1], t[t.index("--nproc-per-node") + 1],
            t[t.index("--ps-servers") + 1]) == ("3", "4", "2")
    assert t[t.index("--") + 1:] == ["train.py", "--lr", "1"]
    assert ps.port_map == {"c10d": 29600}
    solo = bagpipe(m="my.train", j="2x1", ps=0)
    assert [r.name for r in solo.roles] == ["trainer"]
    assert "--store-host-node" in solo.roles[0].args
    assert solo.roles[0].args[-2:] == ["-m", "my.train"]
    for kwargs, message in (({}, "exactly one"), ({"script": "t.py", "ps": -1}, "--ps"),
                            ({"script": "t.py", "ps_type": "udp"}, "tcp or rdma"),
                            ({"script": "t.py", "j": "1:2x1"}, "fixed number")):
        with pytest.raises(ValueError, match=message):
            bagpipe(**kwargs)


def test_component_checkpoints_and_resumes_the_whole_job(tmp_path):
    from torchrec_bagpipe.distributed.checkpoint_manifest import Manifest, write_manifest

    d = str(tmp_path / "ckpt")
    app = bagpipe(script="train.py", j="2x1", ps=2, checkpoint_dir=d, checkpoint_every=5,
                  resume=d, env={"A": "1"})
    ps, trainer = app.roles
    for role in (ps, trainer):
        assert role.env == {"A": "1", "BAGPIPE_CHECKPOINT_DIR": d,
                            "BAGPIPE_CHECKPOINT_EVERY": "5", "BAGPIPE_RESUME": d}
    a = ps.args
    assert (a[a.index("--checkpoint-dir") + 1], a[a.index("--resume") + 1]) == (d, d)
    assert "--resume" not in bagpipe(script="t.py", ps=1, checkpoint_dir=d).roles[0].args
    with pytest.raises(ValueError, match="needs --checkpoint_dir"):
        bagpipe(script="t.py", checkpoint_every=3)
    # The PS role turns them into its server's arguments: its own part of the job's
    # directory, and the manifest's set when resuming: its own part at the same shard count,
    # every part re-partitioned by the set's partitioner at another.
    assert checkpoint_server_args(d, None, 1, 2) == [
        "--checkpoint-dir", os.path.join(d, "ps", "shard-1")]
    with pytest.raises(ValueError, match="no MANIFEST"):
        checkpoint_server_args(None, d, 1, 2)
    os.makedirs(d)
    write_manifest(d, Manifest(label="step-8-ab", step=8, ps_shards=2, partitioner="hash"))
    assert checkpoint_server_args(None, d, 1, 2) == [
        "--checkpoint-dir", os.path.join(d, "ps", "shard-1"),
        "--restore-from", os.path.join(d, "ps", "shard-1", "step-8-ab")]
    assert checkpoint_server_args(None, d, 0, 1) == [
        "--checkpoint-dir", os.path.join(d, "ps", "shard-0"),
        "--restore-resharded", ",".join(os.path.join(d, "ps", f"shard-{i}", "step-8-ab")
                                        for i in range(2)),
        "--partitioner", "hash"]


def test_torchx_accepts_the_component_file():
    out = subprocess.run(
        [sys.executable, "-m", "torchx.cli.main", "run", "--dryrun", "-s", "local_cwd",
         "torchrec_bagpipe/launch/component.py:bagpipe", "-j", "2x1", "--ps", "1",
         "--script", "train.py", "--", "--x", "1"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "torchrec_bagpipe.launch.ps_role" in out.stdout + out.stderr


# ---- rendezvous and the role programs ------------------------------------------------------
def test_job_store_carries_token_addresses_and_trainer_states():
    host = JobStore("127.0.0.1:0", "job", host=True, timeout=10)
    client = JobStore(host.endpoint, "job", timeout=10)
    assert client.agree_token("mine", 5) == "mine"
    assert host.agree_token("other", 5) == "mine"  # the first proposal wins
    client.publish_ps(1, "h1:7001")
    with pytest.raises(TimeoutError, match=r"PS shards \[0\]"):
        host.ps_addresses(2, timeout=0.3)
    with pytest.raises(RuntimeError, match="gone"):
        host.ps_addresses(2, timeout=5, abort=lambda: "gone")
    client.ps_exited(0, 3)
    with pytest.raises(RuntimeError, match="shard 0 exited"):
        host.ps_addresses(2, timeout=5)
    client.publish_ps(0, "h0:7000")
    assert host.ps_addresses(2, timeout=1) == ["h0:7000", "h1:7001"]
    assert host.ps_exit_statuses([0, 1]) == {0: 3}
    other_job = JobStore(host.endpoint, "job2", timeout=10)
    assert other_job.agree_token("x", 5) == "x"  # jobs do not share keys
    # Trainer nodes: done keys, heartbeats, a silent node is lost.
    watch = TrainerWatch(host, 2, start_timeout=0.6, beat_timeout=0.3)
    client.beat(0)
    assert not watch.all_done()
    client.trainer_done(0, "0")
    deadline = time.monotonic() + 5
    while not watch.all_done():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert host.trainers_done(2) == {0: "0", 1: "lost"}
    with pytest.raises(ValueError, match="host:port"):
        parse_endpoint("nohost")
    with pytest.raises(ValueError, match="port"):
        JobStore("127.0.0.1:0", "job", timeout=1)


def test_role_programs_find_the_store_and_the_advertised_host(monkeypatch):
    p = build_parser()
    base = ["--run-id", "r", "--replica-id", "0", "--num-replicas", "1", "--nnodes", "1"]
    monkeypatch.setenv("SLURM_JOB_NODELIST_HET_GROUP_0", "node[007-009]")
    args = p.parse_args([*base, "--rendezvous-host-env", "SLURM_JOB_NODELIST_HET_GROUP_0"])
    assert rendezvous_endpoint(args) == "node007:29500"
    monkeypatch.setenv("TORCHX_RANK0_HOST", "ps-0.job")
    args = p.parse_args([*base, "--rendezvous-host-env", "TORCHX_RANK0_HOST",
                         "--rendezvous-port", "1234"])
    assert rendezvous_endpoint(args) == "ps-0.job:1234"
    monkeypatch.delenv("TORCHX_RANK0_HOST")
    assert rendezvous_endpoint(args) == "localhost:1234"  # torchx's default for rank 0
    assert rendezvous_endpoint(p.parse_args([*base, "--rendezvous", "a:1"])) == "a:1"
    assert advertised_host("10.0.0.5", None) == "10.0.0.5"
    assert advertised_host("0.0.0.0", "ps.example") == "ps.example"
    assert advertised_host("0.0.0.0", None) == socket.getfqdn()
    cmd = torchrun_command(TrainerNode(endpoint="h:1", run_id="r", command=["t.py", "--a"],
                                       nnodes=2, nproc_per_node=3, log_dir="/l"))
    i = cmd.index("torch.distributed.run")
    assert cmd[i + 1:] == ["--nnodes", "2", "--nproc-per-node", "3", "--rdzv-backend", "c10d",
                           "--rdzv-endpoint", "h:1", "--rdzv-id", "r", "--rdzv-conf",
                           "is_host=0", "--max-restarts", "0", "--role", "trainer", "--tee",
                           "3", "--log-dir", "/l", "t.py", "--a"]
    assert torchrun_command(TrainerNode(endpoint="h:1", run_id="r", command=["echo", "x"])
                            )[-3:] == ["--no-python", "echo", "x"]
    # The PS role's servers impose their transport, even on one node.
    assert rewrite_ps_type(["t.py", "--ps-type", "local"], True, None, force="rdma") == (
        ["t.py", "--ps-type", "rdma"], "rdma")
    assert rewrite_ps_type(["t.py", "--ps-type=tcp"], True, None) == (
        ["t.py", "--ps-type=local"], "local")


# ---- a job on torchx's local scheduler ------------------------------------------------------
def _torchx(tmp_path, *component_args: str, timeout: float = 420) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchx.cli.main", "run", "-s", "local_cwd",
         "--scheduler_args", f"log_dir={tmp_path / 'torchx'}",
         "torchrec_bagpipe/launch/component.py:bagpipe", "--python", sys.executable,
         "--ps_host", "127.0.0.1", "--rdzv_port", str(_free_port()), *component_args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_two_trainer_nodes_and_one_ps_train_dlrm_on_the_local_scheduler(tmp_path):
    metrics = tmp_path / "metrics.json"
    out = _torchx(
        tmp_path, "-j", "2x1", "--ps", "1", "--script", "examples/dlrm/dlrm_main.py", "--",
        "--limit_train_batches", "12", "--batch_size", "32", "--num_embeddings", "500",
        "--embedding_dim", "8", "--dense_arch_layer_sizes", "16,8",
        "--over_arch_layer_sizes", "16,1", "--learning_rate", "0.05",
        "--limit_val_batches", "2", "--limit_test_batches", "2", "--no_progress",
        "--optimization-cache-capacity", "4", "--placement-min-rows", "0",
        "--metrics_json", str(metrics))
    logs = out.stdout + out.stderr
    assert out.returncode == 0, logs[-6000:]
    assert "Job finished: SUCCEEDED" in logs
    # The PS shard published its address in the rendezvous; both trainer nodes read it.
    assert "[ps 0] serving shard 0/1 at 127.0.0.1:" in logs
    for node in (0, 1):
        assert f"[trainer node {node}] PS shards: 127.0.0.1:" in logs
    assert "SIGTERM: draining" in logs  # the PS drained once the trainers were done
    results = json.loads(metrics.read_text())
    assert results["world_size"] == 2 and results["steps"] == 12
    c = results["bagpipe"]["counters"]
    assert c["hits"] + c["prefetch_served"] + c["demand_fetched"] == c["accesses"] > 0


@pytest.mark.slow
def test_a_failing_trainer_node_ends_the_job(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        import torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            sys.exit(3)
        time.sleep(300)  # rank 0 would wait: its node must be stopped for it
    """))
    started = time.monotonic()
    out = _torchx(tmp_path, "-j", "2x1", "--ps", "1", "--script", str(script), timeout=240)
    logs = out.stdout + out.stderr
    assert out.returncode != 0 and "Job finished: FAILED" in logs, logs[-4000:]
    assert "stopping the trainers" in logs
    assert time.monotonic() - started < 200
