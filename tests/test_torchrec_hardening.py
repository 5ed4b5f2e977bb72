"""The TorchRec layer under mistakes (multi-process, gloo): ranks that disagree on their
tables fail together naming the field and the ranks; malformed KJTs (fuzzed with
Hypothesis) are refused before any PS step is consumed; the opt-in non-finite gradient check
fails a step on every rank before it is committed; failed periodic PS checkpoints reach the
trainers."""

from __future__ import annotations

import contextlib
import itertools
import logging
import secrets
from pathlib import Path
from typing import Any

import _scenarios as S
import pytest
import torch
from _dist import run_world

pytestmark = pytest.mark.slow

WORLD = 2


def _ebc(dim: int = 4, rows: int = 40, init_max: float | None = None,
         mean: bool = False) -> Any:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    extra = {} if init_max is None else {"weight_init_max": init_max,
                                         "weight_init_min": -init_max}
    return EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name="t0", embedding_dim=dim, num_embeddings=rows,
                           feature_names=["f0"],
                           pooling=PoolingType.MEAN if mean else PoolingType.SUM, **extra),
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=30, feature_names=["f1"]),
    ])


def _shard(ebc: Any, world: int, config: dict[str, Any] | None = None, lr: float = 0.5) -> Any:
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from torchrec_bagpipe.config import BagPipeConfig
    from torchrec_bagpipe.distributed import BagPipeEmbeddingBagCollectionSharder, bagpipe_plan

    sharder = BagPipeEmbeddingBagCollectionSharder(BagPipeConfig(**(config or {})),
                                                   fused_params={"learning_rate": lr})
    return DistributedModelParallel(ebc, device=torch.device("cpu"),
                                    plan=bagpipe_plan(ebc, world), sharders=[sharder])


# ---- open-time agreement ------------------------------------------------------------------------
# (what rank 1 does differently, the field the error must name)
MISMATCHES: list[tuple[str, dict[str, Any], str]] = [
    ("rows", {"rows": 41}, "tables[0].num_embeddings"),
    ("dim", {"dim": 8}, "tables[0].dim"),
    ("lr", {"lr": 0.25}, "tables[0].lr"),
    ("init", {"init_max": 0.05}, "tables[0].init_max"),
    ("pooling", {"mean": True}, "tables[0].pooling"),
    ("lookahead", {"config": {"lookahead": 4}}, "config.lookahead"),
    ("partitioner", {"config": {"partitioner": "hash"}}, "config.partitioner"),
    ("gradient division", {"config": {"gradient_division": False}}, "config.gradient_division"),
    ("aggregation", {"config": {"bagpipe_aggregation": "collective"}},
     "config.bagpipe_aggregation"),
    ("shard count", {"config": {"ps_shards": 1}}, "ps_shards"),
]


def _mismatches(rank: int, world: int) -> list[str]:
    from torchrec_bagpipe.distributed import SpecMismatchError, close_job

    problems: list[str] = []
    for label, change, field in MISMATCHES:
        mine = change if rank == 1 else {}
        config = {"ps_shards": 2, **mine.get("config", {})}
        try:
            _shard(_ebc(dim=mine.get("dim", 4), rows=mine.get("rows", 40),
                        init_max=mine.get("init_max"), mean=mine.get("mean", False)),
                   world, config, lr=mine.get("lr", 0.5))
            problems.append(f"{label}: no error")
        except SpecMismatchError as e:
            text = str(e)
            if field not in text or "rank 0" not in text or "rank 1" not in text:
                problems.append(f"{label}: the error does not name {field} and the ranks: {e}")
        except Exception as e:
            problems.append(f"{label}: {type(e).__name__}: {e}")
        close_job()
    # A rank whose own set-up fails: it raises its error, the others name it.
    try:
        _shard(_ebc(), world, {"ps_shards": 2}, lr=-1.0 if rank == 1 else 0.5)
        problems.append("setup error: no error")
    except SpecMismatchError as e:
        if rank != 0 or "rank 1 could not set up" not in str(e):
            problems.append(f"setup error: rank {rank}: {e}")
    except ValueError as e:
        if rank != 1 or "learning rate must be > 0" not in str(e):
            problems.append(f"setup error: rank {rank}: {e}")
    close_job()
    # A process's own resources may differ between ranks.
    try:
        dmp = _shard(_ebc(), world, {"ps_shards": 2, "store_threads": 1 + rank})
        from torchrec_bagpipe.distributed import close_model

        close_model(dmp)
    except Exception as e:
        problems.append(f"store_threads per rank: {type(e).__name__}: {e}")
    close_job()
    # The job token is compared by digest: it never appears in the message.
    token = f"secret-{rank}-{secrets.token_hex(4)}"
    try:
        _shard(_ebc(), world, {"ps_shards": 2, "job_token": token})
        problems.append("token: no error")
    except SpecMismatchError as e:
        if "job_token" not in str(e) or "secret-" in str(e):
            problems.append(f"token: {e}")
    close_job()
    return problems


def test_ranks_that_disagree_fail_together_naming_the_field_and_the_ranks() -> None:
    results = run_world(_mismatches, WORLD, timeout=600)
    problems = [f"rank {r}: {p}" for r, ps in enumerate(results) for p in ps]
    assert not problems, "\n".join(problems)


# ---- KJT validation (fuzzed) --------------------------------------------------------------------
def _reference_verdict(lengths: list[int], offsets: list[int] | None, use_lengths: bool,
                       values: list[int], dtype: torch.dtype, rows: list[int]) -> str | None:
    """Why the KJT must be refused, computed independently of the module (None: fine)."""
    if dtype not in (torch.int32, torch.int64):
        return "ids must be int32 or int64"
    if use_lengths:
        if any(n < 0 for n in lengths):
            return "is negative"
        if sum(lengths) != len(values):
            return "add up to"
    if offsets is not None:
        if offsets[0] != 0 or offsets[-1] != len(values):
            return "offsets must run from 0"
        if any(b < a for a, b in itertools.pairwise(offsets)):
            return "offsets decrease"
        if use_lengths and [b - a for a, b in itertools.pairwise(offsets)] != lengths:
            return "disagree"
    bags = lengths if use_lengths else [b - a for a, b in itertools.pairwise(offsets)]
    pos = 0
    stride = len(bags) // 2
    for i, n in enumerate(bags):
        limit = rows[i // stride]
        for v in values[pos:pos + n]:
            if not 0 <= v < limit:
                return "outside"
        pos += n
    return None


def _fuzz(rank: int, world: int) -> dict[str, int]:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_bagpipe.distributed import bagpipe_metrics, close_model

    torch.manual_seed(0)
    ebc = _ebc()
    reference = _ebc()
    dmp = _shard(ebc, world)
    sharded = dmp.module
    reference.load_state_dict(S.whole_state(sharded))
    rows = [40, 30]
    seen = {"refused": 0, "accepted": 0}

    @settings(max_examples=200, derandomize=True, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def check(data: Any) -> None:
        stride = data.draw(st.integers(1, 4), "stride")
        lengths = data.draw(st.lists(st.integers(-2, 3), min_size=2 * stride,
                                     max_size=2 * stride), "lengths")
        n = max(0, sum(max(x, 0) for x in lengths) + data.draw(st.sampled_from([0, 0, 0, -1, 1])))
        values = data.draw(st.lists(st.integers(-1, 41), min_size=n, max_size=n), "values")
        dtype = data.draw(st.sampled_from([torch.int64, torch.int32, torch.int64,
                                           torch.float32]), "dtype")
        form = data.draw(st.sampled_from(["lengths", "offsets", "both"]), "form")
        offsets = None
        if form != "lengths":
            offsets = [0]
            for x in lengths:
                offsets.append(offsets[-1] + x)
            if data.draw(st.booleans(), "perturb offsets"):
                i = data.draw(st.integers(0, len(offsets) - 1))
                offsets[i] += data.draw(st.sampled_from([-1, 1]))
        use_lengths = form != "offsets"
        kjt = KeyedJaggedTensor(
            keys=["f0", "f1"], values=torch.tensor(values, dtype=dtype),
            lengths=torch.tensor(lengths, dtype=torch.int32) if use_lengths else None,
            offsets=torch.tensor(offsets, dtype=torch.int64) if offsets is not None else None,
            stride=stride,
        )
        why = _reference_verdict(lengths, offsets, use_lengths, values, dtype, rows)
        training = data.draw(st.booleans(), "training")
        sharded.train(training)
        if why is not None:
            with pytest.raises((ValueError, TypeError), match=why):
                sharded(kjt).wait()
            seen["refused"] += 1
            return
        if training:
            return  # a well-formed training batch would consume a step: eval checks it
        got = sharded(kjt).wait().values()
        want = reference(kjt).values()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        seen["accepted"] += 1

    check()
    # No refused batch consumed a step: the first training step is step 0.
    metrics = bagpipe_metrics(dmp)
    assert all(m["steps"] == 0 for m in metrics.values()), metrics
    sharded.train()
    kjt = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.tensor([1, 2, 3]),
                            lengths=torch.tensor([1, 1, 0, 1]))
    sharded(kjt).wait().values().sum().backward()
    sharded.flush()
    metrics = bagpipe_metrics(dmp)
    assert all(m["committed_step"] == 0 for m in metrics.values()), metrics
    close_model(dmp)
    return seen


def test_malformed_kjts_are_refused_before_any_step_is_consumed() -> None:
    seen = run_world(_fuzz, 1, timeout=600)[0]
    print(seen)
    assert seen["refused"] > 50 and seen["accepted"] > 10, seen


# ---- the non-finite gradient check ---------------------------------------------------------------
def _non_finite(rank: int, world: int) -> dict[str, Any]:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_bagpipe.distributed import NonFiniteGradientError, bagpipe_metrics, close_model

    torch.manual_seed(0)
    dmp = _shard(_ebc(), world, {"check_finite_grads": True})
    sharded = dmp.module
    kjt = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.tensor([1, 2, 3, 4]),
                            lengths=torch.tensor([1, 1, 1, 1]))
    error = None
    for step in range(5):
        loss = sharded(kjt).wait().values().sum()
        if step == 3 and rank == 1:
            loss = loss * float("nan")
        try:
            loss.backward()
        except NonFiniteGradientError as e:
            error = str(e)
            break
    committed = {k: m["committed_step"] for k, m in bagpipe_metrics(dmp).items()}
    sharded.flush()  # the pending step is finished with a zero gradient on every rank
    after = {k: m["committed_step"] for k, m in bagpipe_metrics(dmp).items()}
    # The tables' live sharded tensors: each rank checks its local shards' rows.
    weights = [s.tensor.clone() for v in sharded.state_dict().values()
               for s in (v.local_shards() if hasattr(v, "local_shards") else [])]
    weights += [v.clone() for v in sharded.state_dict().values()
                if not hasattr(v, "local_shards")]
    close_model(dmp)
    return {"error": error, "committed": committed, "after": after,
            "finite": all(bool(torch.isfinite(w).all()) for w in weights)}


def test_a_non_finite_gradient_fails_the_step_on_every_rank_before_it_is_committed() -> None:
    results = run_world(_non_finite, WORLD, timeout=300)
    for rank, r in enumerate(results):
        assert r["error"] and "rank 1" in r["error"] and "step 3" in r["error"], (rank, r)
        assert set(r["committed"].values()) == {2}, r  # step 3 reached no shard
        assert set(r["after"].values()) == {3}, r
        assert r["finite"], r  # no NaN reached the PS


# ---- failed periodic PS checkpoints --------------------------------------------------------------
def _checkpoints(rank: int, world: int) -> dict[str, Any]:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_bagpipe.distributed import (
        PSCheckpointError,
        bagpipe_metrics,
        close_job,
        close_model,
    )

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("torchrec_bagpipe").addHandler(Keep())
    dmp = _shard(_ebc(), world, {"ps_type": "tcp", "ps_checkpoint_max_failures": 3})
    sharded = dmp.module
    kjt = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.tensor([1, 2, 3, 4]),
                            lengths=torch.tensor([1, 1, 1, 1]))
    error = None
    failures_seen: list[float] = []
    for _ in range(8):
        try:
            sharded(kjt).wait().values().sum().backward()
        except PSCheckpointError as e:
            error = f"PSCheckpointError: {e}"
            break
        except Exception as e:  # a peer stopped first (its checkpoint notice came sooner)
            error = f"{type(e).__name__}: {e}"
            break
        failures_seen.append(
            max(m["ps_checkpoint_failures"] for m in bagpipe_metrics(dmp).values()))
    with contextlib.suppress(Exception):
        close_model(dmp)
    with contextlib.suppress(Exception):
        close_job()
    return {"error": error, "warnings": records, "failures": failures_seen}


@pytest.mark.parametrize("background", [False, True], ids=["blocking", "background"])
def test_failed_periodic_checkpoints_warn_then_fail_the_trainers(tmp_path: Path,
                                                                 background: bool) -> None:
    from torchrec_bagpipe.ps import spawn_server

    blocker = tmp_path / "file"
    blocker.write_text("a file where the checkpoint directory should be")
    token = secrets.token_hex(8)
    args = ["--quiet", "--checkpoint-dir", str(blocker / "ckpt"), "--checkpoint-every", "1"]
    if background:
        args.append("--ps-checkpoint-background")
    servers = [spawn_server(s, 2, job_token=token, args=args) for s in range(2)]
    try:
        env = {"BAGPIPE_PS_ADDRESSES": ",".join(s.address for s in servers),
               "BAGPIPE_JOB_TOKEN": token}
        results = run_world(_checkpoints, WORLD, env=env, timeout=300)
    finally:
        for s in servers:
            s.kill()
    # Each rank raises once it has heard of the third failure in a row; the notices arrive
    # asynchronously, so a rank may instead stop because its peer stopped first.
    assert any("PSCheckpointError: " in (r["error"] or "") and
               "3 periodic PS checkpoints failed in a row" in r["error"] for r in results), results
    for rank, r in enumerate(results):
        assert r["error"], (rank, r)  # no rank trained on
        assert any("periodic checkpoint of step" in w and "failed" in w
                   for w in r["warnings"]), r["warnings"]
        assert r["failures"] and r["failures"][-1] >= 1, r  # the metric counts them
