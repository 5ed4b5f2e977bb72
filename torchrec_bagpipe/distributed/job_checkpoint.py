"""Whole-job checkpoints: every PS table and every trainer's state at one committed step.

`save_job_checkpoint(model, directory, step=..., optimizer=..., extra=...)` (a collective)
drains every BagPipe module's commits, checkpoints every PS table on its shards into a new
set (`checkpoint_manifest.py`: ``D/ps/shard-<i>/<label>/``, through the shards' own
checkpoint writer), writes each trainer's state (``D/<label>/trainer-<rank>.pt``:
`torch.save` of the model's state without the BagPipe tables, the optimizer's state
without the PS-held part, every param group's learning rate, the BagPipe groups' step
counts, the random streams (torch CPU and CUDA, `random`, NumPy) and the caller's `extra`,
e.g. the data position and LR scheduler),
then rank 0 publishes the set by renaming ``D/MANIFEST.json`` into place and removes older
sets. A crash (``kill -9`` of every process) at any moment leaves the previous complete set.

Resuming: start the job with `BagPipeConfig.resume` (``--resume D``; the launcher sets
``$BAGPIPE_RESUME``): hosted shards restore the set's tables (the launcher's PS servers get
``--restore-from``), every fused table checks it opens at the set's step and numbers its
steps after it (`fused_table_runtime.py`, invariant 5), no initial weights are written;
then `load_job_checkpoint(model, optimizer=...)` restores the trainer state and returns
(step, extra); the random streams are restored with it, or (``restore_rng=False``) by
`restore_rng_state()` once the data iterator is created and positioned. Training continued
from there is bitwise the run that never stopped, random ops (dropout) included.
Losing a shard is recovered the same way: every process rolls back to the last set.

Resuming on another shape: a set taken with W trainers and K PS shards resumes with W'
trainers and K' shards. Each PS shard of the new job restores the rows the job's
partitioner routes to it from all K parts of the set (`PSShard(restore=[...])`; the
launcher's servers get ``--restore-resharded`` and the set's partitioner), weights and
optimizer state bitwise. Trainer r' loads trainer (r' mod W)'s file: the dense model and
its optimizer state are replicated by DDP, so any trainer's is every trainer's; the random
streams and `extra` come from that trainer too (with W' != W no run continues every rank's
stream: rank r' draws from old rank r' mod W's). Rank-local shards of stock-sharded tables
cannot be re-split this way (ValueError naming them: use DCP for those). The data position
is the caller's: the DLRM example saves its global batch, refuses another one and lets each
new rank skip the batches already trained (examples/dlrm/dlrm_main.py). Training continued
from there equals the single-process reference continued from the same step on the new
job's global batches.

Thread-safety: the rank's training thread, between steps (no step running), every rank in
the same order (barriers on the job's control group).
"""

from __future__ import annotations

import os
import random
import re
import secrets
import shutil
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from torchrec_bagpipe.distributed.checkpoint_manifest import (
    Manifest,
    fsync_dir,
    ps_shard_dir,
    read_manifest,
    trainer_file,
    write_manifest,
)
from torchrec_bagpipe.distributed.fused_optimizer import BagPipeFusedOptimizer
from torchrec_bagpipe.distributed.job import BagPipeJob
from torchrec_bagpipe.distributed.utils import bagpipe_modules, flush_model

__all__ = ["checkpoint_due", "load_job_checkpoint", "restore_rng_state", "resumed_step",
           "save_job_checkpoint"]

_WRAPPERS = ("_dmp_wrapped_module.", "module.")
_LABEL = re.compile(r"^step-\d+-[0-9a-f]+$")


def _job() -> BagPipeJob:
    job = BagPipeJob.current()
    if job is None:
        raise RuntimeError("whole-job checkpoints need a BagPipe-sharded model (no BagPipe job "
                           "is open in this process)")
    return job


def resumed_step() -> int:
    """The training step the process's job resumed after (0: a fresh job)."""
    job = BagPipeJob.current()
    return 0 if job is None or job.resumed is None else job.resumed.step


def checkpoint_due(step: int) -> bool:
    """Whether the job's `checkpoint_every` asks for a checkpoint after training step `step`
    (steps counted from 1)."""
    job = BagPipeJob.current()
    every = 0 if job is None else job.checkpoint_every
    return every > 0 and step > 0 and step % every == 0


# ---- what a trainer saves ----------------------------------------------------------------------
def _plain(key: str) -> str:
    for w in _WRAPPERS:
        key = key.replace(w, "")
    return key


def _bagpipe_keys(model: nn.Module) -> set[str]:
    """The state-dict keys (wrapper prefixes removed) of every BagPipe table: the PS holds
    them."""
    keys = set()
    for fqn, m in bagpipe_modules(model):
        prefix = _plain(fqn + ".") if fqn else ""
        for table in m.bagpipe_tables.views:
            keys.add(f"{prefix}{m._COLLECTION}.{table}.weight")
    return keys


def _local(value: Any) -> Any:
    """A torch.save-able copy: ShardedTensors become their local shards' tensors."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(value, ShardedTensor):
        return {"__local_shards__": [s.tensor.detach().clone() for s in value.local_shards()]}
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_local(v) for v in value)
    return value


def _into(live: Any, saved: Any, where: str) -> Any:
    """`saved` (from `_local`) copied into the live tensors of `live`; returns `live` with
    its non-tensor leaves replaced by the saved ones."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(live, ShardedTensor):
        shards = saved["__local_shards__"]
        mine = live.local_shards()
        if len(shards) != len(mine):
            raise ValueError(f"{where}: {len(shards)} local shards saved, {len(mine)} here")
        for s, t in zip(mine, shards):
            s.tensor.detach().copy_(t)
        return live
    if isinstance(live, torch.Tensor):
        live.detach().copy_(saved)
        return live
    if isinstance(live, Mapping):
        if set(live) != set(saved):
            raise ValueError(f"{where}: saved keys {sorted(saved)} differ from {sorted(live)}")
        return {k: _into(live[k], saved[k], f"{where}.{k}") for k in live}
    if isinstance(live, (list, tuple)):
        return type(live)(_into(a, b, where) for a, b in zip(live, saved))
    return saved


def _optimizers(optimizer: Any) -> Iterator[Any]:
    """The optimizers inside `optimizer` whose state the trainers hold (TorchRec's
    CombinedOptimizer unpacked; BagPipe's fused optimizers left out: the PS holds theirs)."""
    if optimizer is None:
        return
    inner = getattr(optimizer, "optimizers", None)
    if isinstance(inner, list) and all(isinstance(o, tuple) for o in inner):
        for _, o in inner:
            yield from _optimizers(o)
    elif not isinstance(optimizer, BagPipeFusedOptimizer):
        yield optimizer


def _rank_local(saved: Any, where: str) -> list[str]:
    """The places in `saved` (from `_local`) that hold one rank's shards of a tensor."""
    if isinstance(saved, Mapping):
        if "__local_shards__" in saved:
            return [where]
        return [p for k, v in saved.items() for p in _rank_local(v, f"{where}.{k}")]
    if isinstance(saved, (list, tuple)):
        return [p for i, v in enumerate(saved) for p in _rank_local(v, f"{where}[{i}]")]
    return []


def _bagpipe_optimizers(model: nn.Module) -> list[BagPipeFusedOptimizer]:
    return [m.bagpipe_tables.optimizer for _, m in bagpipe_modules(model)]


def _trainer_state(model: nn.Module, optimizer: Any, step: int, extra: Any) -> dict[str, Any]:
    skip = _bagpipe_keys(model)
    dense = {k: v for k, v in model.state_dict().items() if _plain(k) not in skip}
    return {
        "step": step,
        "model": _local(dense),
        "optimizers": [_local(o.state_dict()) for o in _optimizers(optimizer)],
        "lrs": ([_local(g["lr"]) for g in optimizer.param_groups]
                if optimizer is not None else []),
        "bagpipe_steps": [list(o._steps) for o in _bagpipe_optimizers(model)],
        "rng": _rng_states(),
        "extra": extra,
    }


# ---- the random streams ------------------------------------------------------------------------
def _rng_states() -> dict[str, Any]:
    """Every global random stream a training loop may draw from: torch's CPU generator, each
    CUDA device's (if any), Python's `random` and NumPy's legacy global generator."""
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python": random.getstate(),
            "numpy": np.random.get_state()}


def _set_rng_states(rng: Mapping[str, Any]) -> None:
    torch.set_rng_state(rng["cpu"])
    if rng.get("cuda"):
        torch.cuda.set_rng_state_all(rng["cuda"])
    if "python" in rng:  # sets written before the Python and NumPy streams were saved
        random.setstate(rng["python"])
    if "numpy" in rng:
        np.random.set_state(rng["numpy"])


def restore_rng_state() -> None:
    """Restores the random streams of the set the job resumed from, held back by
    ``load_job_checkpoint(..., restore_rng=False)``. Call it once the data iterator is
    created and positioned (creating a DataLoader iterator draws from torch's generator;
    the uninterrupted run drew that before its checkpoint), right before the first training
    step: the run continues the random stream it saved (dropout, random ops, `random`,
    NumPy). Raises RuntimeError if nothing is held back."""
    job = _job()
    rng = job.held_rng
    if rng is None:
        raise RuntimeError("restore_rng_state: no random state is held back (call "
                           "load_job_checkpoint(..., restore_rng=False) on a resumed job first)")
    job.held_rng = None
    _set_rng_states(rng)


# ---- save ------------------------------------------------------------------------------
def save_job_checkpoint(model: nn.Module, directory: str | os.PathLike[str] | None = None, *,
                        step: int, optimizer: Any = None, extra: Any = None) -> Manifest:
    """Checkpoints the whole job after training step `step` (a collective; see the module
    docstring). `directory`: None for the job's (`BagPipeConfig.checkpoint_dir`). Returns
    the published set's manifest. REQUIRES: no step running (between training steps)."""
    job = _job()
    d = os.fspath(directory) if directory is not None else job.checkpoint_dir
    if not d:
        raise ValueError("save_job_checkpoint: no directory (set BagPipeConfig.checkpoint_dir "
                         "or --checkpoint-dir)")
    if job.shard is not None and job.shard.checkpoint_dir != ps_shard_dir(d, job.rank):
        raise ValueError(
            f"save_job_checkpoint: this process's PS shard checkpoints into "
            f"{job.shard.checkpoint_dir}, not under {d}: pass the job's checkpoint directory "
            "(BagPipeConfig.checkpoint_dir) when the model is sharded")
    label = f"step-{int(step)}-{secrets.token_hex(4)}" if job.rank == 0 else None
    label = str(job.control.broadcast_object(label, src=0))
    flush_model(model)
    job.control.barrier()  # every rank drained: the PS holds each table at one step
    tables: dict[str, int] = {}
    if job.rank == 0:
        os.makedirs(os.path.join(d, label), exist_ok=True)
        for _, m in bagpipe_modules(model):
            for rt in m.bagpipe_tables.runtimes:
                tables[rt.name] = rt.checkpoint(label)
    else:
        os.makedirs(os.path.join(d, label), exist_ok=True)
    path = trainer_file(d, label, job.rank)
    tmp = f"{path}.tmp"
    torch.save(_trainer_state(model, optimizer, int(step), extra), tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))
    job.control.barrier()  # every trainer's state is on disk
    tables = dict(job.control.broadcast_object(tables if job.rank == 0 else None, src=0))
    manifest = Manifest(label=label, step=int(step), tables=tables, world_size=job.world_size,
                        ps_shards=len(job.endpoints), partitioner=job.config.partitioner)
    if job.rank == 0:
        write_manifest(d, manifest)
        _remove_older_sets(d, label)
    job.control.barrier()
    return manifest


def _remove_older_sets(directory: str, keep: str) -> None:
    """Removes every set but `keep` (trainer directories and the PS sets this machine sees)."""
    places = [directory]
    ps = os.path.join(directory, "ps")
    if os.path.isdir(ps):
        places += [os.path.join(ps, s) for s in os.listdir(ps) if s.startswith("shard-")]
    for place in places:
        for name in os.listdir(place):
            if name != keep and _LABEL.match(name):
                shutil.rmtree(os.path.join(place, name), ignore_errors=True)


# ---- load ------------------------------------------------------------------------------
def load_job_checkpoint(model: nn.Module, *, optimizer: Any = None,
                        restore_rng: bool = True) -> tuple[int, Any]:
    """Restores this trainer's state from the set the job resumed from (`BagPipeConfig.resume`;
    the PS tables were restored when the job started) and returns (step, extra). Call it after
    sharding the model and building `optimizer` as the checkpointed run did, before training.
    Without a resumed set: (0, None), also for a model without BagPipe tables (size-based
    placement may leave every table stock), unless a resume was asked for.

    The random streams (torch CPU and CUDA, `random`, NumPy) are restored now, or, with
    `restore_rng=False`, held back until `restore_rng_state()`: a loop that creates or
    positions its data iterator after loading (a DataLoader iterator draws from torch's
    generator when it is created) restores them after that, so the resumed run draws
    exactly what the uninterrupted one drew."""
    if BagPipeJob.current() is None and not os.environ.get("BAGPIPE_RESUME"):
        return 0, None
    job = _job()
    if job.resumed is None or job.resume_dir is None:
        return 0, None
    manifest = read_manifest(job.resume_dir)
    if manifest is None or manifest.label != job.resumed.label:
        raise RuntimeError(f"BagPipe resume: the manifest in {job.resume_dir} changed while "
                           "the job was starting")
    reshaped = manifest.world_size != job.world_size
    source = job.rank % manifest.world_size if reshaped else job.rank
    path = trainer_file(job.resume_dir, manifest.label, source)
    state = torch.load(path, map_location="cpu", weights_only=False)
    if reshaped:
        split = sorted(_rank_local(state["model"], "model")
                       + _rank_local(state["optimizers"], "optimizer"))
        if split:
            raise ValueError(
                f"BagPipe resume: the checkpoint in {job.resume_dir} was taken at world size "
                f"{manifest.world_size}, this job has {job.world_size}, and its trainers hold "
                f"rank-local shards of stock-sharded tables ({', '.join(split[:4])}"
                f"{', ...' if len(split) > 4 else ''}), which a whole-job checkpoint cannot "
                "re-split: place those tables on BagPipe, or checkpoint them with DCP "
                "(torch.distributed.checkpoint reshards them)")
    skip = _bagpipe_keys(model)
    live = {k: v for k, v in model.state_dict().items() if _plain(k) not in skip}
    _into(live, state["model"], "model")
    opts = list(_optimizers(optimizer))
    if len(opts) != len(state["optimizers"]):
        raise ValueError(f"BagPipe resume: {len(state['optimizers'])} optimizers saved, "
                         f"{len(opts)} given")
    for i, (o, saved) in enumerate(zip(opts, state["optimizers"])):
        if saved.get("state") and not o.state_dict().get("state") and hasattr(o, "init_state"):
            o.init_state()  # lazily initialised state (Adam): in place, then overwritten
        o.load_state_dict(_into(o.state_dict(), saved, f"optimizer[{i}]"))
    if optimizer is not None:
        groups = list(optimizer.param_groups)
        if len(groups) != len(state["lrs"]):
            raise ValueError("BagPipe resume: the optimizer's param groups differ from the "
                             "checkpointed run's")
        for g, lr in zip(groups, state["lrs"]):
            g["lr"] = lr
    for o, steps in zip(_bagpipe_optimizers(model), state["bagpipe_steps"]):
        o._steps = list(steps)
    if restore_rng:
        _set_rng_states(state["rng"])
    else:
        job.held_rng = state["rng"]
    job.control.barrier()
    return int(state["step"]), state["extra"]
