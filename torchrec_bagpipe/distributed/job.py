"""`BagPipeJob`: what every BagPipe module of one trainer process shares.

One job per trainer process owns the dedicated gloo groups (one for the runtime's
collectives, one for the TorchRec layer's barriers), the job token, the PS endpoints (and
the PS shard hosted inside this process in the zero-config default), and clean shutdown.
Each fused table opens its own PS session on the job (`fused_table_runtime.py`).

Thread-safety: `job_for` runs on the training thread during sharding; every rank calls it in
the same order (it may run collectives). `close_job` runs on the training thread or at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import secrets
import time
import weakref
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torchrec.distributed.types import ShardingEnv

from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.distributed.agreement import (
    PER_RANK_FIELDS,
    agree_before_open,
    config_fields,
    flatten,
    redact,
)
from torchrec_bagpipe.distributed.checkpoint_manifest import (
    Manifest,
    ps_set_dir,
    ps_set_dirs,
    ps_shard_dir,
    read_manifest,
)
from torchrec_bagpipe.distributed.process_group_collectives import (
    TorchDistCollectives,
    new_runtime_group,
)

__all__ = ["BagPipeJob", "JobMember", "close_job", "job_for"]


class JobMember(Protocol):
    """A module the job closes on shutdown (a sharded BagPipe module)."""

    def close(self) -> None: ...


class BagPipeJob:
    """Per-process state shared by every BagPipe module (see module docstring).

    Deployment (decided once per process, identically on every rank):
    * `ps_addresses` (or the launcher's ``BAGPIPE_PS_ADDRESSES``) given: the shards are
      those servers, reached over TCP (over UCX with ``ps_type="rdma"``).
    * otherwise (zero-config): rank r < S hosts shard r (S = `ps_shards` or the world size)
      in this process, serves it on loopback TCP (UCX for ``"rdma"``) for the other ranks,
      and reaches it in-process itself (``ps_type="local"``) or through its server too
      (``"tcp"``, ``"rdma"``); the shards' addresses go through torch.distributed's store.
    """

    @staticmethod
    def current() -> BagPipeJob | None:
        """The process's open job, or None (no BagPipe module sharded yet, or closed)."""
        return _JOB if _JOB is not None and not _JOB.closed else None

    def __init__(self, config: BagPipeConfig, env: ShardingEnv, device: torch.device) -> None:
        self.config = config
        self.rank = env.rank
        self.world_size = env.world_size
        self.device = device
        # Two groups: the controllers run their collectives on a worker thread of their own
        # (runtime/worker.py), so the TorchRec layer's barriers and broadcasts use a
        # second group and never interleave with them.
        self.collectives = TorchDistCollectives(new_runtime_group(config.ps_timeout))
        self.control = TorchDistCollectives(new_runtime_group(config.ps_timeout))
        if self.collectives.world_size != self.world_size:
            raise ValueError(
                f"BagPipe needs the sharding env to span the default process group "
                f"(env world size {self.world_size}, default group {self.collectives.world_size})"
            )
        # The ranks agree on the deployment before deploying it (a rank hosting a shard the
        # others do not expect would leave them waiting for its address): every rank fails
        # together, naming the field (agreement.py; the token compared by digest only).
        agree_before_open(self.control,
                          flatten(config_fields(config, [f for f in _DEPLOYMENT_FIELDS
                                                         if f not in PER_RANK_FIELDS])),
                          where="BagPipe job (the PS deployment)")
        self._modules: weakref.WeakSet[JobMember] = weakref.WeakSet()
        self._next_session = 0
        self.closed = False
        self.shard: Any = None
        self.server: Any = None
        self.hosts_shards = False  # the trainers host the shards (no ps_addresses): _deploy
        self._store = dist.distributed_c10d._get_default_store()
        self.job_token = self._agree_token()
        # Whole-job checkpoints (job_checkpoint.py): where they go, and the set resumed from.
        resume = config.resume or os.environ.get("BAGPIPE_RESUME") or None
        self.checkpoint_dir: str | None = (config.checkpoint_dir
                                           or os.environ.get("BAGPIPE_CHECKPOINT_DIR")
                                           or resume or None)
        every = config.checkpoint_every or int(os.environ.get("BAGPIPE_CHECKPOINT_EVERY", "0"))
        self.checkpoint_every: int = every if self.checkpoint_dir else 0
        self.resume_dir: str | None = resume
        self.resumed: Manifest | None = None
        # The resumed set's random streams, held back by load_job_checkpoint(restore_rng=False)
        # until restore_rng_state() (job_checkpoint.py).
        self.held_rng: dict[str, Any] | None = None
        if resume is not None:
            self.resumed = read_manifest(resume)
            if self.resumed is None:
                raise FileNotFoundError(
                    f"BagPipe resume: {resume} holds no whole-job checkpoint (no MANIFEST.json)")
        # A set of another world size or shard count resumes reshaped: hosted shards restore
        # it re-partitioned (_deploy), the trainers' state is re-split (job_checkpoint.py).
        self.endpoints = self._deploy()

    def expected_step(self, table: str) -> int:
        """The committed step PS table `table` must be at when a session opens: -1 in a fresh
        job, the resumed checkpoint's step of it otherwise (StartStepError if absent)."""
        if self.resumed is None:
            return -1
        if table not in self.resumed.tables:
            from torchrec_bagpipe.ps.client import StartStepError

            raise StartStepError(
                f"PS table {table!r} is not in the whole-job checkpoint {self.resume_dir} "
                f"(it holds {sorted(self.resumed.tables)}): the model differs from the one "
                "checkpointed")
        return self.resumed.tables[table]

    # ---- deployment -------------------------------------------------------------------------
    def _agree_token(self) -> str:
        token = self.config.job_token or os.environ.get("BAGPIPE_JOB_TOKEN")
        if token:
            return token
        mine = secrets.token_hex(16) if self.rank == 0 else None
        return str(self.control.broadcast_object(mine, src=0))

    def _deploy(self) -> list[Any]:
        from torchrec_bagpipe.ps.config_specs import shard_spec
        from torchrec_bagpipe.ps.shard import PSShard

        config = self.config
        kind = config.ps_type
        launched = os.environ.get("BAGPIPE_PS_TYPE")
        if kind == "local" and launched:
            # The launcher's choice, for a training command that names no --ps-type.
            kind = launched.lower()
            if kind not in ("local", "tcp", "rdma"):
                raise ValueError(
                    f"BAGPIPE_PS_TYPE={launched!r}: expected one of local, tcp, rdma"
                )
        addresses = list(config.ps_addresses)
        if not addresses and os.environ.get("BAGPIPE_PS_ADDRESSES"):
            addresses = [a for a in os.environ["BAGPIPE_PS_ADDRESSES"].split(",") if a]
        if kind == "rdma":
            from torchrec_bagpipe.ps.rdma import require_rdma

            require_rdma()  # RdmaUnavailableError naming libucx-dev in a build without UCX
        scheme = "ucx://" if kind == "rdma" else "tcp://"
        if addresses:
            if config.ps_shards is not None and config.ps_shards != len(addresses):
                raise ValueError(
                    f"BagPipeConfig.ps_shards ({config.ps_shards}) does not match the "
                    f"{len(addresses)} PS addresses"
                )
            if (self.resumed is not None and self.resumed.ps_shards != len(addresses)
                    and self.resumed.partitioner != config.partitioner):
                # The servers re-partitioned the set by the partitioner it records
                # (launch/ps_role.py); this job must route keys the same way.
                raise ValueError(
                    f"BagPipe resume: the checkpoint in {self.resume_dir} was taken with "
                    f"{self.resumed.ps_shards} PS shards and partitioner "
                    f"{self.resumed.partitioner!r}; resuming it on {len(addresses)} servers "
                    f"re-partitions its rows with that partitioner, this job's is "
                    f"{config.partitioner!r}")
            return [f"{scheme}{a}" if "://" not in a else a for a in addresses]
        self.hosts_shards = True
        shards = config.ps_shards if config.ps_shards is not None else self.world_size
        if shards > self.world_size:
            raise ValueError(
                f"BagPipeConfig.ps_shards={shards}: without ps_addresses each shard lives in "
                f"a trainer process, so at most world_size={self.world_size} shards"
            )
        if self.rank < shards:
            ckpt = ps_shard_dir(self.checkpoint_dir, self.rank) if self.checkpoint_dir else None
            restore: str | list[str] | bool = False
            if self.resumed is not None:
                assert self.resume_dir is not None
                # The same shard count: this shard's own part; another: every part,
                # re-partitioned by this job's partitioner.
                if self.resumed.ps_shards == shards:
                    restore = ps_set_dir(self.resume_dir, self.rank, self.resumed.label)
                    parts = [(self.rank, restore)]
                else:
                    restore = ps_set_dirs(self.resume_dir, self.resumed)
                    parts = list(enumerate(restore))
                for owner, d in parts:
                    if not os.path.isdir(d):
                        raise FileNotFoundError(
                            f"BagPipe resume: PS shard {owner}'s tables of checkpoint set "
                            f"{self.resumed.label} are missing ({d})")
            self.shard = PSShard(shard_spec(config, self.rank, shards, checkpoint_dir=ckpt),
                                 restore=restore, partitioner=config.partitioner)
            if kind == "rdma":
                self.server = self.shard.serve_ucx(job_token=self.job_token)
            else:
                self.server = self.shard.serve(job_token=self.job_token)
            self._store.set(self._key(f"addr/{self.rank}"),
                            f"{self.server.host}:{self.server.port}")
        keys = [self._key(f"addr/{r}") for r in range(shards)]
        self._store.wait(keys, datetime.timedelta(seconds=self.config.connect_timeout))
        endpoints: list[Any] = []
        for r, key in enumerate(keys):
            if r == self.rank and kind == "local":
                endpoints.append(self.shard)
            else:
                endpoints.append(scheme + self._store.get(key).decode())
        return endpoints

    def _key(self, name: str) -> str:
        # The token's digest, not the token: a key can appear in a store error message.
        return f"torchrec_bagpipe/{redact(self.job_token)}/{name}"

    def deployment(self) -> dict[str, Any]:
        """What every rank's sessions depend on beyond its config: the shard count, the
        world size and the resolved gradient division (agreement.py compares them)."""
        return {"ps_shards": len(self.endpoints), "world_size": self.world_size,
                "gradient_division": self.config.resolved_gradient_division()}

    # ---- sessions ---------------------------------------------------------------------------
    def next_session_id(self) -> int:
        sid = self._next_session
        self._next_session += 1
        return sid

    def register(self, module: JobMember) -> None:
        """`module` is closed by `close` (held weakly)."""
        self._modules.add(module)

    def unregister(self, module: JobMember) -> None:
        self._modules.discard(module)

    # ---- shutdown ---------------------------------------------------------------------------
    def close(self) -> None:
        """Drains and closes every module of this process, waits (bounded) until every rank
        is done with the PS, then stops this process's shard (idempotent)."""
        if self.closed:
            return
        self.closed = True
        errors: list[BaseException] = []
        for module in list(self._modules):
            try:
                module.close()
            except Exception as e:  # keep closing the others
                errors.append(e)
        if self.shard is None:
            if self.hosts_shards:
                # A rank hosting none of the job's shards (ps_shards < world size) only says
                # it is done: the hosts wait for every rank before stopping their shards (a
                # host that gave up waiting reports it; its store may be gone by now).
                with contextlib.suppress(Exception):
                    self._store.add(self._key("barrier/closed"), 1)
        else:
            try:
                self._store_barrier("closed")
            except Exception as e:
                errors.append(e)
            finally:
                self.shard.close(drain_timeout=1.0)
                self.shard = None
                self.server = None
        if errors:
            raise errors[0]

    def _store_barrier(self, name: str) -> None:
        """Every rank reached `name` (bounded by ps_timeout). The store may vanish once rank 0,
        which hosts it, has seen everyone: that also means everyone arrived."""
        key = self._key(f"barrier/{name}")
        self._store.add(key, 1)
        deadline = time.monotonic() + self.config.ps_timeout
        while True:
            try:
                if int(self._store.add(key, 0)) >= self.world_size:
                    return
            except Exception:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"BagPipe shutdown: not every rank finished with the PS within "
                    f"{self.config.ps_timeout} s; stopping this rank's shard anyway"
                )
            time.sleep(0.01)


_JOB: BagPipeJob | None = None  # the process's job (see BagPipeJob.current)


# Fields fixed by the first module a process shards: where the PS is and how it is reached.
_DEPLOYMENT_FIELDS = ("ps_type", "ps_addresses", "ps_shards", "job_token", "memory_budget",
                      "spill_dir", "store_threads", "ps_timeout", "connect_timeout",
                      "checkpoint_dir", "checkpoint_every", "resume")


def job_for(config: BagPipeConfig, env: ShardingEnv, device: torch.device) -> BagPipeJob:
    """The process's job, created on first use (a collective: every rank calls it).

    Every BagPipe module of a process shares the job, so they must agree on the deployment
    fields (ValueError naming the first that differs).
    """
    global _JOB
    job = BagPipeJob.current()
    if job is None:
        _JOB = job = BagPipeJob(config, env, device)
        return job
    if (job.rank, job.world_size) != (env.rank, env.world_size):
        raise ValueError(
            "every BagPipe module of a process must use the same sharding env "
            f"(rank {env.rank}/{env.world_size} vs {job.rank}/{job.world_size})"
        )
    for name in _DEPLOYMENT_FIELDS:
        mine, theirs = getattr(config, name), getattr(job.config, name)
        if mine != theirs:
            if name == "job_token":
                mine, theirs = "<token>", "<another token>"  # never in a message
            raise ValueError(
                f"BagPipeConfig.{name}={mine!r} differs from {theirs!r}, which the first "
                "BagPipe module of this process fixed; every module of a process shares one "
                "PS deployment"
            )
    return job


def close_job() -> None:
    """Closes the process's job, if one is open (idempotent): drains and closes every
    BagPipe module of the process, waits (bounded) until every rank is done with the PS,
    then stops the shard this process hosts.

    Runs at exit on its own while the default process group still exists; a script that
    destroys the process group itself calls it first (every rank).
    """
    job = BagPipeJob.current()
    if job is not None:
        job.close()


def _close_at_exit() -> None:
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            close_job()


atexit.register(_close_at_exit)
