"""Process-level wiring between the TorchRec layer, the runtime and the PS.

One `BagPipeJob` per trainer process owns what every BagPipe module of that process shares:
the dedicated gloo group the runtime's collectives run on, the PS shard hosted inside this
process in the zero-config default, and clean shutdown. `build_fused_table` opens one PS
session and one `BagPipeController` for a fused table.

Thread-safety: `job_for` and `build_fused_table` run on the training thread during
sharding; every rank calls them in the same order (they may run collectives).
"""

from __future__ import annotations

import atexit
import contextlib
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.types import ShardingEnv

from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.distributed.collectives import TorchDistCollectives, new_runtime_group
from torchrec_bagpipe.distributed.types import FusedTableSpec

__all__ = ["BagPipeJob", "FusedTableRuntime", "build_fused_table", "job_for"]


@dataclass
class FusedTableRuntime:
    """The runtime pieces of one fused table on this rank."""

    spec: FusedTableSpec
    client: Any  # PSClientLike + lookup/assign
    controller: Any  # BagPipeController
    lazy_init: bool

    def close(self) -> None:
        try:
            self.controller.close()
        finally:
            self.client.close()


class BagPipeJob:
    """Per-process state shared by every BagPipe module (see module docstring)."""

    def __init__(self, config: BagPipeConfig, env: ShardingEnv, device: torch.device) -> None:
        self.config = config
        self.rank = env.rank
        self.world_size = env.world_size
        self.device = device
        # Two groups: the controllers run their collectives on a worker thread of their own
        # (runtime/controller.py), so the TorchRec layer's barriers and broadcasts use a
        # second group and never interleave with them.
        self.collectives = TorchDistCollectives(new_runtime_group(config.ps_timeout))
        self.control = TorchDistCollectives(new_runtime_group(config.ps_timeout))
        if self.collectives.world_size != self.world_size:
            raise ValueError(
                f"BagPipe needs the sharding env to span the default process group "
                f"(env world size {self.world_size}, default group {self.collectives.world_size})"
            )
        self._modules: weakref.WeakSet[Any] = weakref.WeakSet()
        self._next_session = 0
        self.gradient_division = config.resolved_gradient_division()
        self.closed = False

    def next_session_id(self) -> int:
        sid = self._next_session
        self._next_session += 1
        return sid

    def register(self, module: Any) -> None:
        self._modules.add(module)

    def unregister(self, module: Any) -> None:
        self._modules.discard(module)

    def close(self) -> None:
        """Drains and closes every module of this process (idempotent)."""
        if self.closed:
            return
        self.closed = True
        errors = []
        for module in list(self._modules):
            try:
                module.close()
            except Exception as e:  # keep closing the others
                errors.append(e)
        if errors:
            raise errors[0]


_JOB: BagPipeJob | None = None


def job_for(config: BagPipeConfig, env: ShardingEnv, device: torch.device) -> BagPipeJob:
    """The process's job, created on first use (a collective: every rank calls it)."""
    global _JOB
    if _JOB is None or _JOB.closed:
        _JOB = BagPipeJob(config, env, device)
    elif (_JOB.rank, _JOB.world_size) != (env.rank, env.world_size):
        raise ValueError(
            "every BagPipe module of a process must use the same sharding env "
            f"(rank {env.rank}/{env.world_size} vs {_JOB.rank}/{_JOB.world_size})"
        )
    return _JOB


def current_job() -> BagPipeJob | None:
    return _JOB if _JOB is not None and not _JOB.closed else None


def build_fused_table(
    spec: FusedTableSpec, *, job: BagPipeJob, config: BagPipeConfig, lazy_init: bool
) -> FusedTableRuntime:
    """Opens the PS session of one fused table and its controller on this rank."""
    raise RuntimeError(
        "the BagPipe runtime and PS client are not available in this build"
    )


def _close_at_exit() -> None:
    job = _JOB
    if job is not None and not job.closed and dist.is_initialized():
        with contextlib.suppress(Exception):
            job.close()


atexit.register(_close_at_exit)
