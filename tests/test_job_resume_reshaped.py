"""A whole-job checkpoint taken with W trainers and K PS shards resumes with W' and K'
(issue 23 item 3): 2 -> 1 and 1 -> 2 trainers (hosted shards: K follows), and 2 -> 1 shards
under 2 trainers. The resumed job trains the rest of the same global batches; its tables
(weights and lazy-Adam state, bias-correction steps included) and dense model equal the
single-process reference trained on every global batch from the start. The resumed model
is built from another seed, so everything it ends with came through the checkpoint.

A set whose trainers hold rank-local shards of stock-sharded tables cannot be re-split: a
reshaped resume of it is refused naming them, before training.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import _scenarios as S
import pytest
from _dist import run_world

from torchrec_bagpipe.distributed.checkpoint_manifest import read_manifest

CASE = dict(kind="dlrm", steps=6, batch=4, seed=41, optimizer="adam")
# The mixed model's stock fused tables train with Adagrad (fbgemm has no Adam on CPU).
OPTIMIZER = {"dlrm": "adam", "mixed_ebc": "adam_stock_adagrad"}
DONE = 3  # steps before the checkpoint
SAMPLE_WORLD = 2  # the global batch is 2 x CASE["batch"] samples whatever the trainer count


def _train(dmp: Any, opt: Any, batches: list[Any]) -> None:
    for b in batches:
        opt.zero_grad()
        loss, _ = dmp(b)
        loss.backward()
        opt.step()


def _batches(case: S.Case, rank: int, world: int) -> list[Any]:
    """This rank's share of every global batch: the whole batch at world 1, its local half
    at world 2 (make_samples' per-rank halves, as the reference concatenates them)."""
    samples = S.make_samples(case.kind, case.steps, SAMPLE_WORLD, case.batch, case.seed)
    return S.batches_for(case.kind, samples, rank if world == SAMPLE_WORLD else None,
                         case.seed, case.shuffle_keys)


def _save(rank: int, world: int, kind: str, tmp: str, shards: int) -> list[str]:
    from torchrec_bagpipe.distributed import close_model, save_job_checkpoint

    case = S.Case(**{**CASE, "kind": kind, "optimizer": OPTIMIZER[kind]},  # type: ignore[arg-type]
                  config={"checkpoint_dir": tmp, "ps_shards": shards})
    dmp, opt = S.make_dmp(case, S.build_model(case.kind, case.seed), world)
    _train(dmp, opt, _batches(case, rank, world)[:DONE])
    m = save_job_checkpoint(dmp, step=DONE, optimizer=opt, extra={"rank": rank})
    close_model(dmp)
    return [] if (m.world_size, m.ps_shards) == (world, shards) else [f"manifest {m}"]


def _resume(rank: int, world: int, kind: str, tmp: str, shards: int) -> list[str]:
    from torchrec_bagpipe.distributed import close_model, load_job_checkpoint

    case = S.Case(**{**CASE, "kind": kind, "optimizer": OPTIMIZER[kind]},  # type: ignore[arg-type]
                  config={"resume": tmp, "ps_shards": shards})
    dmp, opt = S.make_dmp(case, S.build_model(case.kind, case.seed + 99), world)
    problems: list[str] = []
    try:
        step, extra = load_job_checkpoint(dmp, optimizer=opt)
    except ValueError as e:
        close_model(dmp)
        return [f"refused: {e}"]
    if step != DONE:
        problems.append(f"resumed at step {step}")
    # Rank r' takes trainer (r' mod W)'s state (the random streams, `extra`).
    saved_world = 2 if world == 1 else int(os.environ["SAVED_WORLD"])
    if extra != {"rank": rank % saved_world}:
        problems.append(f"rank {rank} got extra {extra}")
    _train(dmp, opt, _batches(case, rank, world)[DONE:])
    state = S.full_state(dmp, rank)
    state.update(S.fused_state(opt))
    close_model(dmp)
    if rank == 0:
        want = S.train_reference(case, SAMPLE_WORLD)
        problems += S.compare(state, want, f"resumed {kind} on {world} trainers / {shards} "
                                           "shards", rtol=1e-4, atol=1e-5)
    return problems


@pytest.mark.parametrize(("before", "after"), [((2, 2), (1, 1)), ((1, 1), (2, 2)),
                                               ((2, 2), (2, 1))],
                         ids=["w2k2-to-w1k1", "w1k1-to-w2k2", "w2k2-to-w2k1"])
def test_a_reshaped_resume_equals_the_reference(tmp_path, before, after):
    ck = str(tmp_path / "ck")
    env = {"SAVED_WORLD": str(before[0])}
    problems = [p for r in run_world(_save, before[0], args=("dlrm", ck, before[1]),
                                     timeout=600, env=env) for p in r]
    assert not problems, problems
    problems = [p for r in run_world(_resume, after[0], args=("dlrm", ck, after[1]),
                                     timeout=600, env=env) for p in r]
    assert not problems, "\n".join(problems)


def test_rank_local_stock_shards_refuse_a_reshaped_resume(tmp_path):
    ck = str(tmp_path / "ck")
    problems = [p for r in run_world(_save, 2, args=("mixed_ebc", ck, 2), timeout=600)
                for p in r]
    assert not problems, problems
    (result,) = run_world(_resume, 1, args=("mixed_ebc", ck, 1), timeout=600)
    assert len(result) == 1 and result[0].startswith("refused: "), result
    assert "world size 2, this job has 1" in result[0]
    assert "rank-local shards of stock-sharded tables" in result[0] and "DCP" in result[0]


# ---- the DLRM example through the launcher: 2 trainers + 2 PS servers -> 1 + 1 -----------------
REPO = str(Path(__file__).resolve().parents[1])
SMALL = ["--num_embeddings", "50", "--embedding_dim", "4", "--dense_arch_layer_sizes", "8,4",
         "--over_arch_layer_sizes", "8,1", "--learning_rate", "0.1", "--limit_val_batches",
         "1", "--limit_test_batches", "1", "--placement-min-rows", "0", "--no_progress",
         "--seed", "5"]
ENV = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}


def _launch(d: Path, trainers: int, batch: int, steps: int, *extra: str
            ) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torchrec_bagpipe.launch", "--nproc-per-node", str(trainers),
           "--ps-servers", str(trainers), "--ps-server-args=--quiet", "--checkpoint-dir", str(d),
           "--checkpoint-every", "3", *extra,
           os.path.join(REPO, "examples", "dlrm", "dlrm_main.py"), *SMALL,
           "--batch_size", str(batch), "--limit_train_batches", str(steps)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)


@pytest.mark.slow
def test_the_example_resumes_on_fewer_trainers_and_servers(tmp_path):
    d = tmp_path / "ck"
    out = _launch(d, 2, 16, 6)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    m = read_manifest(d)
    assert m is not None and (m.step, m.world_size, m.ps_shards) == (6, 2, 2)
    # The same per-rank batch on one trainer would halve the global batch: refused.
    out = _launch(d, 1, 16, 12, "--resume", str(d))
    assert out.returncode != 0
    assert "global batch of 32 samples" in out.stderr and "--batch_size 32" in out.stderr, \
        out.stderr[-4000:]
    out = _launch(d, 1, 32, 12, "--resume", str(d))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    m = read_manifest(d)
    assert m is not None and (m.step, m.world_size, m.ps_shards) == (12, 1, 1)
    assert all(step >= 6 for step in m.tables.values()), m.tables
