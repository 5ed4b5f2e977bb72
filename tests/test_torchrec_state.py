"""Live, sharded state dicts and DCP (issue 12), on gloo ranks against plain references.

* The in-place convention: a sharded model loaded only by `copy_` into the tensors of its
  `state_dict()` (TorchRec's and DCP's way) from an unsharded model's state dict trains
  exactly as that model does on the global batch (sum and mean pooling, weighted and not,
  BagPipe and stock tables in one EBC).
* DCP: `torch.distributed.checkpoint.save` / `load` of the model and its optimizer at world
  2, loaded at world 1 and saved again, loaded back at world 2 into a model that trained
  meanwhile (its caches hold other rows): weights and optimizer state bit-equal each time,
  and training continues bit-equal with the uninterrupted run.
* Bounded memory: with a table many chunks long, no state-dict path (state dicts, DCP save
  and load, optimizer state, `load_state_dict`) holds more than one chunk of rows of it.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import _scenarios as S
import pytest
import torch
from _dist import run_world

pytestmark = pytest.mark.slow


def _train(dmp: Any, opt: Any, batches: list[Any]) -> None:
    for b in batches:
        opt.zero_grad()
        loss, _ = dmp(b)
        loss.backward()
        opt.step()


def _copy_into(sd: dict[str, Any], source: dict[str, torch.Tensor]) -> None:
    """TorchRec's in-place loading: every state-dict tensor (a sharded tensor's local shards)
    takes its block of the unsharded value by `copy_`."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    for key, target in sd.items():
        value = source[key]
        if isinstance(target, ShardedTensor):
            for shard in target.local_shards():
                rows = tuple(slice(o, o + n) for o, n in zip(shard.metadata.shard_offsets,
                                                              shard.metadata.shard_sizes))
                shard.tensor.copy_(value[rows])
        else:
            target.copy_(value)


# ---- the in-place convention --------------------------------------------------------------------
def _in_place(rank: int, world: int) -> list[str]:
    from torchrec_bagpipe.distributed import close_model

    problems: list[str] = []
    cases = [S.Case(kind="dlrm", steps=2, seed=11),  # sum and mean pooling
             S.Case(kind="weighted", steps=2, seed=12),
             S.Case(kind="mixed_ebc", steps=2, seed=13, planner="hand",  # + stock tables
                    optimizer="adagrad")]
    for case in cases:
        unsharded = S.build_model(case.kind, case.seed)
        # A model with other weights everywhere, sharded, then loaded in place only.
        dmp, opt = S.make_dmp(case, S.build_model(case.kind, case.seed + 100), world)
        sd = dmp.state_dict()
        _copy_into(sd, unsharded.state_dict())
        samples = S.make_samples(case.kind, case.steps, world, case.batch, case.seed)
        _train(dmp, opt, S.batches_for(case.kind, samples, rank, case.seed, case.shuffle_keys))
        state = S.full_state(dmp, rank)
        state.update(S.fused_state(opt))
        close_model(dmp)
        if rank == 0:
            want = S.train_reference(case, world)
            if case.optimizer == "sgd":
                want = {k: v for k, v in want.items() if not k.startswith("opt:")}
            problems += S.compare(state, want, f"in-place load, {case.label()}")
    return problems


def test_state_dict_tensors_are_live_and_load_a_model_in_place():
    results = run_world(_in_place, 2, timeout=600)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)


# ---- DCP, resharded 2 -> 1 -> 2 ----------------------------------------------------------------
_CASE = dict(kind="mixed_ebc", steps=4, seed=21, optimizer="adam_stock_adagrad")


def _snapshot(dmp: Any, opt: Any, rank: int) -> dict[str, torch.Tensor]:
    state = S.full_state(dmp, rank)
    state.update(S.fused_state(opt))
    return state


def _dcp_world(rank: int, world: int, phase: str, tmp: str) -> list[str]:
    import torch.distributed.checkpoint as dcp

    from torchrec_bagpipe.distributed import close_model

    case = S.Case(**_CASE)  # type: ignore[arg-type]
    samples = S.make_samples(case.kind, 7, 2, case.batch, case.seed)
    # The runs at world 2 train on the same local batches; the world-1 run never trains.
    batches = S.batches_for(case.kind, samples, rank, case.seed, case.shuffle_keys)
    problems: list[str] = []
    if phase == "save":
        dmp, opt = S.make_dmp(case, S.build_model(case.kind, case.seed), world)
        _train(dmp, opt, batches[:4])
        dcp.save({"model": dmp.state_dict(), "optim": opt.state_dict()},
                 checkpoint_id=os.path.join(tmp, "w2"))
        first = _snapshot(dmp, opt, rank)
        _train(dmp, opt, batches[4:])
        after = _snapshot(dmp, opt, rank)
        if rank == 0:
            torch.save({"first": first, "after": after}, os.path.join(tmp, "want.pt"))
    elif phase == "reshard":
        want = torch.load(os.path.join(tmp, "want.pt"))
        dmp, opt = S.make_dmp(case, S.build_model(case.kind, case.seed + 50), world)
        sd = {"model": dmp.state_dict(), "optim": opt.state_dict()}
        dcp.load(sd, checkpoint_id=os.path.join(tmp, "w2"))
        opt.load_state_dict(sd["optim"])  # TorchRec's way: param groups, steps
        problems += S.compare(_snapshot(dmp, opt, rank), want["first"], "DCP 2 -> 1",
                              rtol=0, atol=0)
        dcp.save({"model": dmp.state_dict(), "optim": opt.state_dict()},
                 checkpoint_id=os.path.join(tmp, "w1"))
    else:  # "back": world 2 again, into a model that trained on other batches meanwhile
        want = torch.load(os.path.join(tmp, "want.pt"))
        dmp, opt = S.make_dmp(case, S.build_model(case.kind, case.seed + 60), world)
        _train(dmp, opt, batches[5:] + batches[:2])
        sd = {"model": dmp.state_dict(), "optim": opt.state_dict()}
        dcp.load(sd, checkpoint_id=os.path.join(tmp, "w1"))  # in place only
        snap = _snapshot(dmp, opt, rank)
        if rank == 0:
            problems += S.compare(snap, want["first"], "DCP 1 -> 2", rtol=0, atol=0)
        _train(dmp, opt, batches[4:])
        snap = _snapshot(dmp, opt, rank)
        if rank == 0:
            problems += S.compare(snap, want["after"], "training after DCP 1 -> 2",
                                  rtol=0, atol=0)
    close_model(dmp)
    return problems


def test_dcp_round_trips_across_world_sizes():
    with tempfile.TemporaryDirectory() as tmp:
        problems: list[str] = []
        for phase, world in (("save", 2), ("reshard", 1), ("back", 2)):
            results = run_world(_dcp_world, world, args=(phase, tmp), timeout=600)
            problems += [f"{phase}: {p}" for r in results for p in r]
    assert not problems, "\n".join(problems)


class _Wrap(torch.nn.Module):
    def __init__(self, ebc: torch.nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, kjt: Any) -> Any:
        return self.ebc(kjt)


# ---- bounded memory -----------------------------------------------------------------------------
CHUNK = 32
BIG_ROWS = 4000  # 125 chunks


def _bounded(rank: int, world: int, tmp: str) -> list[str]:
    import torch.distributed.checkpoint as dcp
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_bagpipe import BagPipeConfig
    from torchrec_bagpipe.distributed import bagpipe_plan, bagpipe_sharders, close_model, table_io
    from torchrec_bagpipe.distributed.ps_views import view_stats

    table_io.TABLE_CHUNK_ROWS = CHUNK
    problems: list[str] = []
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name="big", embedding_dim=8, num_embeddings=BIG_ROWS, feature_names=["f"])],
        device=torch.device("meta"))
    model = _Wrap(ebc)
    sharders = bagpipe_sharders(BagPipeConfig(placement_min_rows=0), fused_params={
        "optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.1})
    dmp = DistributedModelParallel(model, device=torch.device("cpu"),
                                   plan=bagpipe_plan(model, world), sharders=sharders)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f"], values=torch.tensor([3, BIG_ROWS - 1, 1777 + rank]),
        lengths=torch.tensor([2, 1]))
    dmp(kjt)["f"].sum().backward()

    stats = view_stats()
    stats.reset()
    sd = {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}
    weight = sd["model"]["ebc.embedding_bags.big.weight"]
    assert isinstance(weight, ShardedTensor) and tuple(weight.size()) == (BIG_ROWS, 8)
    shards = weight.local_shards()
    if max(s.tensor.shape[0] for s in shards) > CHUNK or \
            sum(s.tensor.shape[0] for s in shards) != BIG_ROWS // world:
        problems.append(f"rank {rank}: local shards {[tuple(s.tensor.shape) for s in shards]}")
    if stats.peak_rows:
        problems.append(f"taking the state dicts read {stats.peak_rows} rows")
    path = os.path.join(tmp, "big")
    dcp.save(sd, checkpoint_id=path)
    # The values DCP wrote, against what the views read (each chunk on its own).
    saved = {int(s.metadata.shard_offsets[0]): s.tensor.clone() for s in shards}
    for s in shards:
        s.tensor.mul_(0.0)  # overwrite the table in place ...
    dcp.load(sd, checkpoint_id=path)  # ... and load it back in place
    dmp.load_state_dict(sd["model"])  # the same live tensors: nothing to write
    dmp.fused_optimizer.load_state_dict(sd["optim"])
    for s in shards:
        if not torch.equal(s.tensor.clone(), saved[int(s.metadata.shard_offsets[0])]):
            problems.append(f"rank {rank}: rows {s.metadata.shard_offsets} not restored")
    momentum = dmp.fused_optimizer.state_dict()["state"]["ebc.embedding_bags.big.weight"][
        "big.momentum1"]
    touched = float(sum(s.tensor.clone().abs().sum() for s in momentum.local_shards()))
    if touched <= 0.0 and rank == 0:
        problems.append("the optimizer state lost its trained rows")
    if stats.peak_rows > CHUNK:
        problems.append(f"rank {rank}: a state-dict path held {stats.peak_rows} rows at once "
                        f"(chunk {CHUNK}, table {BIG_ROWS})")
    if stats.peak_rows == 0:
        problems.append("the accounting saw no reads")
    dmp(kjt)["f"].sum().backward()  # trains on (settles the ranks first)
    close_model(dmp)
    return problems


def test_state_dict_paths_hold_one_chunk_of_a_large_table():
    with tempfile.TemporaryDirectory() as tmp:
        results = run_world(_bounded, 2, args=(tmp,), timeout=600)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)
