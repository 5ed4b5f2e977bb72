"""An exact reference for the runtime + PS, used until the real pieces are wired in.

`ReferenceController` follows ARCHITECTURE §4's controller API with the simplest correct
semantics: no cache, every step gathers its rows from a table shared by all ranks (a
shared-memory file), gradients are summed over ranks with an all-reduce and rank 0 applies
SGD, exactly as DESIGN §2 states synchronous SGD.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from torchrec_bagpipe.distributed import ps_runtime


@dataclass
class Step:
    step: int
    keys: torch.Tensor
    unique_keys: torch.Tensor
    inverse: torch.Tensor
    rows: torch.Tensor


class SharedTable:
    def __init__(self, path: str, num_keys: int, dim: int, job: Any, init: Any) -> None:
        self.dim = dim
        self._job = job
        if job.rank == 0:
            t = torch.from_file(path, shared=True, size=num_keys * dim, dtype=torch.float32)
            t.copy_(init(num_keys, dim).reshape(-1))
        job.control.barrier()
        if job.rank != 0:
            t = torch.from_file(path, shared=True, size=num_keys * dim, dtype=torch.float32)
        self.table = t.view(num_keys, dim)
        self.assigned = 0

    def lookup(self, keys: torch.Tensor) -> torch.Tensor:
        return self.table[keys].clone()

    def assign(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        self.table[keys] = rows
        self.assigned += keys.numel()

    def committed_step(self) -> int:
        return -1

    def close(self) -> None:
        pass


class ReferenceController:
    def __init__(self, spec: Any, config: Any, job: Any, table: SharedTable) -> None:
        self.spec = spec
        self.config = config
        self.job = job
        self.table = table
        self.queue: deque[tuple[int, torch.Tensor]] = deque()
        self.submitted = 0
        self.finished = 0
        self.trace: list[torch.Tensor] | None = None
        self.division = job.gradient_division

    def prescan(self, trace: list[torch.Tensor]) -> None:
        if self.submitted:
            raise RuntimeError("prescan after submit")
        self.trace = [t.clone() for t in trace]

    def submit(self, keys: torch.Tensor) -> None:
        t = self.submitted
        if self.trace is not None and (
            t >= len(self.trace) or not torch.equal(self.trace[t], keys)
        ):
                raise ValueError(f"step {t}: the batch does not match the prescan plan")
        self.queue.append((t, keys.clone()))
        self.submitted += 1

    def next_step(self) -> Step:
        t, keys = self.queue.popleft()
        unique, inverse = torch.unique(keys, return_inverse=True)
        rows = self.table.lookup(unique).requires_grad_(True)
        return Step(t, keys, unique, inverse, rows)

    def finish_step(self, step: Step, grad: torch.Tensor) -> None:
        assert step.step == self.finished, (step.step, self.finished)
        dense = torch.zeros(self.spec.num_keys, self.spec.dim)
        dense.index_add_(0, step.unique_keys, grad.to(torch.float32))
        self.job.control.all_reduce_sum_(dense)
        if self.division:
            dense = dense / float(self.job.world_size)
        touched = torch.nonzero(dense.abs().sum(1) > 0).flatten()
        self.job.control.barrier()
        if self.job.rank == 0:
            u = dense[touched] * float(self.spec.lr)
            self.table.table[touched] = self.table.table[touched] - u
        self.job.control.barrier()
        self.finished += 1

    def flush(self) -> None:
        pass

    def invalidate_all(self) -> None:
        pass

    def metrics(self) -> dict[str, Any]:
        return {"steps": self.finished, "submitted": self.submitted}

    def close(self) -> None:
        pass


def _uniform_init(spec: Any, seed: int) -> Any:
    def init(num_keys: int, dim: int) -> torch.Tensor:
        out = torch.empty(num_keys, dim)
        g = torch.Generator().manual_seed(seed)
        for t in spec.tables:
            lo = spec.offsets[t.name]
            out[lo : lo + t.num_embeddings].uniform_(t.init_min, t.init_max, generator=g)
        return out

    return init


def install(shared_dir: str) -> None:
    """Routes build_fused_table to the reference in this process."""

    def build(spec: Any, *, job: Any, config: Any, lazy_init: bool) -> Any:
        path = os.path.join(shared_dir, spec.name.replace("/", "_").replace(":", "_") + ".bin")
        table = SharedTable(path, spec.num_keys, spec.dim, job, _uniform_init(spec, 1234))
        ctl = ReferenceController(spec, config, job, table)
        return ps_runtime.FusedTableRuntime(spec, table, ctl, lazy_init)

    ps_runtime.build_fused_table = build  # type: ignore[assignment]
