"""The PS's starting step, labelled checkpoint sets, and whole-job checkpoint / resume.

* A client opening a table the PS already advanced is refused by the shards unless it
  declared that step (`expected_step`: a fresh job -1, a resumed one its checkpoint's step),
  naming the table and the steps; tests/test_ps_start_step.py has the protocol's side.
* `PSClient.checkpoint(label=...)` writes a set into the shard's checkpoint subdirectory
  `label`, which a shard restores from (`--restore-from`).
* Two consecutive runs of the DLRM example against the same two TCP shards: the second is
  refused (it would have lost every sparse update), naming the table and the steps.
* kill -9 of every process at a random moment, then `--resume`: the final whole-job
  checkpoint is bitwise the uninterrupted run's (PS rows and optimizer state, dense model
  and optimizer, the random streams), with hosted shards and with PS server processes;
  losing one shard server mid-run is recovered exactly by the same resume.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from torchrec_bagpipe.distributed.checkpoint_manifest import (
    ps_set_dir,
    read_manifest,
    trainer_file,
)
from torchrec_bagpipe.ps import PSClient, PSShard, ShardSpec, StartStepError

REPO = str(Path(__file__).resolve().parents[1])


# ---- the starting step ------------------------------------------------------------------------
def _client(shards: list[PSShard], **kw: Any) -> PSClient:
    return PSClient(shards, table="t", dim=4, lr=0.1, key_bound=64, **kw)


def _train(client: PSClient, steps: range) -> None:
    for s in steps:
        keys = torch.arange(0, 8, dtype=torch.int64)
        client.commit(s, keys, torch.full((8, 4), 0.5))


def test_a_fresh_job_meeting_an_advanced_table_is_refused_naming_table_and_steps():
    shards = [PSShard(shard_id=0, num_shards=2), PSShard(shard_id=1, num_shards=2)]
    with _client(shards) as c:
        assert c.opened_steps == [-1, -1] and c.expected_step == -1
        _train(c, range(3))
    with pytest.raises(StartStepError, match=r"table 't'.*committed steps up to 2.*"
                                             r"steps 0\.\.2 would be acknowledged without"):
        _client(shards)
    with pytest.raises(StartStepError, match=r"resumes after step 1.*committed step is 2"):
        _client(shards, expected_step=1)
    with _client(shards, expected_step=2) as c:
        assert c.opened_steps == [2, 2]


def test_shards_at_different_steps_are_refused(tmp_path):
    a = PSShard(shard_id=0, num_shards=2, checkpoint_dir=tmp_path / "a")
    b = PSShard(shard_id=1, num_shards=2, checkpoint_dir=tmp_path / "b")
    with _client([a, b]) as c:
        _train(c, range(2))
        assert c.checkpoint(label="set-1") == [1, 1]
        _train(c, range(2, 4))
    a2 = PSShard(shard_id=0, num_shards=2, restore=tmp_path / "a" / "set-1")
    with pytest.raises(StartStepError, match=r"shard 0 .*resumes after step 3.*committed step "
                                             r"is 1"):
        _client([a2, b], expected_step=3)


def test_labelled_checkpoint_sets_restore_exactly(tmp_path):
    s = PSShard(shard_id=0, num_shards=1, checkpoint_dir=tmp_path)
    keys = torch.arange(0, 64, dtype=torch.int64)
    with _client([s], optimizer="adagrad") as c:
        _train(c, range(2))
        assert c.checkpoint(label="step-2-aa") == [1]
        want = c.lookup(keys, with_state=True)
        _train(c, range(2, 5))
        with pytest.raises(ValueError, match="label"):
            c.checkpoint(label="../x")
    assert (tmp_path / "step-2-aa" / "table-t").is_dir()
    r = PSShard(shard_id=0, num_shards=1, restore=tmp_path / "step-2-aa")
    assert r.committed_step("t") == 1
    with _client([r], optimizer="adagrad", expected_step=1) as c:
        assert torch.equal(c.lookup(keys, with_state=True), want)


# ---- the DLRM example through the launcher ----------------------------------------------------
SMALL = ["--batch_size", "16", "--num_embeddings", "50", "--embedding_dim", "4",
         "--dense_arch_layer_sizes", "8,4", "--over_arch_layer_sizes", "8,1",
         "--learning_rate", "0.1", "--limit_val_batches", "1", "--limit_test_batches", "1",
         "--placement-min-rows", "0", "--no_progress", "--seed", "5"]
STEPS = 12
EVERY = 3
ENV = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}


def _launch_cmd(*launch: str, example: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "torchrec_bagpipe.launch", "--nproc-per-node", "2",
            "--ps-server-args=--quiet", *launch,
            os.path.join(REPO, "examples", "dlrm", "dlrm_main.py"), *SMALL,
            "--limit_train_batches", str(STEPS), *example]


def _run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _kill_everything(proc: subprocess.Popen[str]) -> None:
    """kill -9 of the launcher and every process under it (frozen first, so that none
    starts another meanwhile)."""
    seen: set[int] = set()
    while True:
        new = [p for p in _descendants(proc.pid) if p not in seen]
        if not new:
            break
        for p in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGSTOP)
        seen.update(new)
    for p in seen:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    proc.wait(30)


def _final_state(directory: Path) -> dict[str, torch.Tensor]:
    """The final whole-job checkpoint of `directory` as tensors: every PS table's rows with
    their optimizer state, read back through restored shards, and each trainer's state."""
    m = read_manifest(directory)
    assert m is not None and m.step == STEPS
    out: dict[str, torch.Tensor] = {}
    for i in range(m.ps_shards):
        shard = PSShard(ShardSpec(i, m.ps_shards), restore=ps_set_dir(directory, i, m.label))
        for table in sorted(shard.tables()):
            assert shard.committed_step(table) == m.tables[table]
            keys = torch.arange(i, 26 * 50, m.ps_shards, dtype=torch.int64)
            out[f"ps{i}/{table}"] = shard.lookup(table, keys, with_state=True)
        shard.close()
    for rank in range(m.world_size):
        state = torch.load(trainer_file(directory, m.label, rank), weights_only=False)
        # The random streams too: a resumed run continues the one it saved (issue 23).
        rng = state["rng"]
        flat: list[tuple[str, Any]] = [("model", state["model"]), ("opt", state["optimizers"]),
                                       ("lrs", state["lrs"]), ("rng.cpu", rng["cpu"]),
                                       ("rng.python", torch.tensor(rng["python"][1])),
                                       ("rng.numpy", torch.from_numpy(rng["numpy"][1]))]
        while flat:
            key, v = flat.pop()
            if isinstance(v, dict):
                flat.extend((f"{key}.{k}", x) for k, x in v.items())
            elif isinstance(v, (list, tuple)):
                flat.extend((f"{key}[{j}]", x) for j, x in enumerate(v))
            elif isinstance(v, torch.Tensor):
                out[f"trainer{rank}/{key}"] = v
            else:
                out[f"trainer{rank}/{key}"] = torch.tensor(float(v))
    return out


def _assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs: max |d| " \
            f"{(got[k].float() - want[k].float()).abs().max()}"


def _interrupted_run(directory: Path, launch: tuple[str, ...], seed: int,
                     example: tuple[str, ...] = ()) -> int:
    """Runs, kills every process with SIGKILL at a random moment, resumes until done;
    returns how many kills happened."""
    rng = random.Random(seed)
    for kills in range(2):
        resume = ("--resume", str(directory)) if read_manifest(directory) else ()
        cmd = _launch_cmd(*launch, "--checkpoint-dir", str(directory),
                          "--checkpoint-every", str(EVERY), *resume, example=example)
        if kills >= 1:
            out = _run(cmd)
            assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
            return kills
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                text=True, env=ENV)
        # A random moment shortly after the first checkpoint.
        deadline = time.monotonic() + 240
        while read_manifest(directory) is None and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 0.6))
        if proc.poll() is not None:
            assert proc.returncode == 0
            return kills
        _kill_everything(proc)
    raise AssertionError("the resumed run did not finish")


@pytest.mark.slow
@pytest.mark.parametrize("servers,example", [(0, ()), (2, ()),
                                             (0, ("--bagpipe-aggregation", "writeback"))],
                         ids=["hosted", "tcp-servers", "hosted-writeback"])
def test_kill_9_everything_and_resume_is_bitwise_the_uninterrupted_run(tmp_path, servers,
                                                                      example):
    """(writeback: the caches own their rows between checkpoints; each checkpoint writes
    them back first, and the resumed run starts from empty caches.)"""
    launch = ("--ps-servers", str(servers)) if servers else ()
    ref = tmp_path / "ref"
    out = _run(_launch_cmd(*launch, "--checkpoint-dir", str(ref),
                           "--checkpoint-every", str(EVERY), example=example))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    want = _final_state(ref)
    for seed in (1, 2):
        d = tmp_path / f"killed-{seed}"
        kills = _interrupted_run(d, launch, seed, example)
        assert kills == 1  # killed once mid-run, then resumed from its last set
        _assert_bitwise(_final_state(d), want)


@pytest.mark.slow
def test_writeback_over_tcp_servers_trains_the_bits_of_ps_owned_rows(tmp_path):
    """The launcher with two TCP PS server processes and a one-unit cache (evictions, so
    write-backs, every step): `writeback` ends with the PS tables, their optimizer state and
    every trainer's state bitwise those of `ps` aggregation (a write-back reaches each shard
    ahead of the commit a later fetch waits for, over the wire too)."""
    states = {}
    for agg in ("ps", "writeback"):
        d = tmp_path / agg
        out = _run(_launch_cmd("--ps-servers", "2", "--checkpoint-dir", str(d),
                               "--checkpoint-every", str(EVERY),
                               example=("--bagpipe-aggregation", agg,
                                        "--optimization-cache-capacity", "1")))
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
        states[agg] = _final_state(d)
    _assert_bitwise(states["writeback"], states["ps"])


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.slow
def test_losing_one_shard_is_recovered_exactly_by_resuming(tmp_path):
    launch = ("--ps-servers", "2")
    ref = tmp_path / "ref"
    out = _run(_launch_cmd(*launch, "--checkpoint-dir", str(ref),
                           "--checkpoint-every", str(EVERY)))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    d = tmp_path / "lost"
    cmd = _launch_cmd(*launch, "--checkpoint-dir", str(d), "--checkpoint-every", str(EVERY))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            text=True, env=ENV)
    deadline = time.monotonic() + 240
    while read_manifest(d) is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before its first checkpoint"
    server = [p for p in _descendants(proc.pid)
              if "torchrec_bagpipe.ps.server" in _cmdline(p) and "--shard-id 1" in _cmdline(p)]
    assert server, [_cmdline(p) for p in _descendants(proc.pid)]
    os.kill(server[0], signal.SIGKILL)
    assert proc.wait(120) != 0  # the job stops: its shard is gone
    out = _run(_launch_cmd(*launch, "--checkpoint-dir", str(d), "--checkpoint-every",
                           str(EVERY), "--resume", str(d)))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    _assert_bitwise(_final_state(d), _final_state(ref))


@pytest.mark.slow
def test_a_second_run_against_the_same_shards_is_refused(tmp_path):
    from torchrec_bagpipe.ps import spawn_server

    token = "resume-test-token"
    servers = [spawn_server(i, 2, host="127.0.0.1", port=0, job_token=token, args=("--quiet",))
               for i in range(2)]
    try:
        env = {**ENV, "BAGPIPE_JOB_TOKEN": token}
        cmd = _launch_cmd(example=("--ps-addresses", *(s.address for s in servers)))
        first = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert second.returncode != 0
        text = second.stdout + second.stderr
        assert "StartStepError" in text and "committed steps up to" in text, text[-4000:]
        assert f"steps 0..{STEPS - 1} would be acknowledged without" in text, text[-4000:]
    finally:
        for s in servers:
            s.terminate()
