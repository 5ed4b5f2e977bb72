"""The fused optimizer of a BagPipe-sharded embedding module: TorchRec's face of the PS's
optimizers.

Like TorchRec's fused TBE optimizers, the update happens during backward: autograd yields
each fused table's |U| x dim row gradient, which the module hands to its fused table's
runtime (`FusedTableRuntime.finish_step`); the runtime commits it to the PS at the learning
rate this optimizer's param group gives (`group_lr`: each fused table's
`StepLearningRate`), and the PS applies the table's optimizer (SGD, Adagrad, row-wise
Adagrad, Adam: see `table_optimizer.py` for how TorchRec users choose it) once per row per
step. The gradient never passes through this class. `step()` only finishes steps whose rows
received no gradient (their loss did not depend on them): they commit a zero gradient so
every rank advances the same step sequence.

* ``param_groups``: one group per fused table (``lr``, ``fused_table``), so TorchRec's
  `CombinedOptimizer` and LR schedulers see them. The learning rate a step's commit carries is
  the group's ``lr`` when that step's backward runs (stock TorchRec copies it into its kernels
  in ``zero_grad``/``step``, i.e. before the next backward: the same value in a training
  loop). For Adam it is the bias-corrected step size ``lr * sqrt(1 - beta2^t) / (1 - beta1^t)``
  of the group's step count t (`ps.optimizer_spec.adam_step_size`), so the PS stays
  step-agnostic.
* ``state`` / ``state_dict()`` / ``load_state_dict()``: the optimizer state in TorchRec's
  key layout, ``state[param]["<table>.momentum1"]`` (and ``"<table>.exp_avg_sq"`` for Adam;
  row-wise Adagrad's momentum1 is 1-D): live row-wise ShardedTensors of PS views (reads
  and in-place writes go to the PS in bounded chunks: table_state.py), plus
  ``"<table>.step"`` for Adam (the step count of its bias correction, a 0-d tensor: a value
  written into it in place, e.g. by DCP's load, takes effect at the next `state` read, the
  end of a load or the module's next batch).
  ``load_state_dict`` takes TorchRec's sharded values or plain whole tensors (each rank
  writes its rows; a collective, as a module's ``load_state_dict``). SGD tables have empty
  state, as in stock TorchRec.

Thread-safety: driven by the rank's training thread and its autograd thread, which never
run concurrently for one rank.

Invariants:
1. A group's step count is the number of steps its fused table finished (zero-gradient
   finishes included); the learning rate of step t is computed from it before the step's
   commit (`next_lr`) and the count advances only once that commit was submitted
   (`step_finished`).
2. Every rank finishes the same steps with the same param-group learning rates, so every
   rank's commit of a step carries the same lr (the PS refuses otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.optim.fused import FusedOptimizer

from torchrec_bagpipe.distributed.table_optimizer import UnsupportedOptimizerError
from torchrec_bagpipe.ps.optimizer_spec import OptimizerSpec, adam_step_size

__all__ = ["BagPipeFusedOptimizer", "FusedGroup", "GroupLearningRate", "OptimizerStateIO",
           "UnsupportedOptimizerError"]


@dataclass
class FusedGroup:
    """One fused table as a param group: its tables' placeholder parameters (in table order)."""

    name: str  # the fused table's PS table name
    lr: float
    optimizer: OptimizerSpec
    tables: list[str]
    params: list[torch.Tensor]


class OptimizerStateIO(Protocol):
    """Where the optimizer state lives (the sharded module, through its TableIO)."""

    def read_optimizer_state(self, table: str) -> dict[str, torch.Tensor]:
        """TorchRec's state entries of `table` ("momentum1", ...): live tensors of the PS."""
        ...

    def load_optimizer_state(self, states: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Writes this rank's rows of the state entries of the tables named, then settles the
        ranks (a collective: every rank calls it)."""
        ...


class BagPipeFusedOptimizer(FusedOptimizer):
    """KeyedOptimizer face of the PS's optimizers (one param group per fused table; see the
    module docstring).

    `group_lr(g)` is fused table g's learning rate source (its runtime asks it at every
    finish); `step()` finishes the steps that got no gradient (`pending_fn`).
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        groups: list[FusedGroup],
        pending_fn: Callable[[], None],
        state_io: OptimizerStateIO,
    ) -> None:
        param_groups = [
            {"params": list(g.params), "lr": g.lr, "fused_table": g.name} for g in groups
        ]
        self._groups: list[FusedGroup] = []  # no state until constructed (KeyedOptimizer
        self._step_tensors: list[tuple[int, str, torch.Tensor, int]] = []  # reads it in
        super().__init__(params, {}, param_groups)  # its __init__)
        self._groups = list(groups)
        self._steps = [0] * len(groups)  # invariant 1
        self._pending_fn = pending_fn
        self._io = state_io
        # Adam's step tensors handed out by `state` since the last settle: (group, table,
        # tensor, the count it was made with).
        self._step_tensors = []
        self._plain: dict[str, dict[str, torch.Tensor]] = {}

    # ---- the learning rate of a step ----------------------------------------------------------
    def step_lr(self, group: int) -> float:
        """The learning rate the next step of fused table `group` commits: the group's ``lr``
        now (Adam: its bias-corrected step size)."""
        g = self._groups[group]
        raw = list(self.param_groups)[group]["lr"]
        value = float(raw.item() if isinstance(raw, torch.Tensor) else raw)
        if not (math.isfinite(value) and value >= 0.0):
            raise ValueError(
                f"the learning rate of BagPipe fused table {g.name!r} is {value}; it must be "
                "finite and >= 0"
            )
        spec = g.optimizer
        if spec.kind == "adam":
            return adam_step_size(value, spec.beta1, spec.beta2, self._steps[group] + 1)
        return value

    def group_lr(self, group: int) -> GroupLearningRate:
        """Fused table `group`'s learning rate of each step (a `StepLearningRate`)."""
        return GroupLearningRate(self, group)

    def _step_finished(self, group: int) -> None:
        self._steps[group] += 1  # invariant 1

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self._pending_fn()

    def zero_grad(self, set_to_none: bool = False) -> None:
        return None

    def set_optimizer_step(self, step: int) -> None:
        """Sets every group's step count (TorchRec's hook, e.g. when resuming Adam)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        self._steps = [step] * len(self._groups)

    # ---- state, in TorchRec's layout -------------------------------------------------------------
    @property  # type: ignore[override]
    def state(self) -> dict[Any, dict[str, Any]]:
        """param -> its table's state entries: live sharded tensors of the PS, and Adam's
        step count (module docstring)."""
        self.settle_steps()  # counts written into the tensors handed out before
        out: dict[Any, dict[str, Any]] = {}
        for g, group in enumerate(self._groups):
            for table, param in zip(group.tables, group.params):
                entries: dict[str, Any] = {
                    f"{table}.{k}": v for k, v in self._io.read_optimizer_state(table).items()
                }
                if group.optimizer.kind == "adam":
                    step = torch.tensor(self._steps[g], dtype=torch.int64)
                    self._step_tensors.append((g, table, step, self._steps[g]))
                    entries[f"{table}.step"] = step
                out[param] = entries
        return out

    @state.setter
    def state(self, value: Mapping[Any, Any]) -> None:
        if value:
            raise AttributeError("the state of BagPipe's fused optimizer lives in the PS")

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """TorchRec's `KeyedOptimizer.load_state_dict` (values copied into the live state
        tensors, param groups replaced), also taking plain whole tensors for the sharded
        entries: each rank writes its rows of them."""
        current = self.state
        new_state = dict(state_dict["state"])
        plain: dict[str, dict[str, torch.Tensor]] = {}
        for key, param in self.params.items():
            entries = new_state.get(key)
            if param not in current or not isinstance(entries, Mapping):
                continue
            fixed = dict(entries)
            for name, value in entries.items():
                ours = current[param].get(name)
                if (isinstance(ours, ShardedTensor) and isinstance(value, torch.Tensor)
                        and not isinstance(value, ShardedTensor)):
                    table, _, _ = name.rpartition(".")
                    plain[table] = {
                        n.rpartition(".")[2]: v for n, v in entries.items()
                        if n.rpartition(".")[0] == table and n.rpartition(".")[2] != "step"
                    }
                    fixed[name] = ours  # the same views: the copy into them is a no-op
            new_state[key] = fixed
        self._plain = plain
        super().load_state_dict({**state_dict, "state": new_state})

    def post_load_state_dict(self) -> None:
        """After `load_state_dict` copied the values into the `state` tensors: the step
        counts, then the plain entries written and the ranks settled."""
        plain, self._plain = self._plain, {}
        self.settle_steps()
        self._io.load_optimizer_state(plain)

    def settle_steps(self) -> None:
        """Takes the Adam step counts written into the tensors `state` handed out (every
        rank, when the module settles; unchanged tensors keep the counts)."""
        records, self._step_tensors = self._step_tensors, []
        if not records:
            return
        steps = list(self._steps)
        loaded: dict[int, tuple[str, int]] = {}
        for g, table, tensor, made in records:
            value = int(tensor.item())
            if value == made:
                continue
            if value < 0:
                raise ValueError(f"BagPipe table {table!r}: a loaded Adam step count must be "
                                 f">= 0, got {value}")
            if g in loaded and loaded[g][1] != value:
                raise ValueError(
                    f"BagPipe fused table {self._groups[g].name!r}: the loaded Adam step "
                    f"counts of its tables differ ({loaded[g][1]} for {loaded[g][0]!r}, "
                    f"{value} for {table!r})"
                )
            loaded[g] = (table, value)
            steps[g] = value
        self._steps = steps


class GroupLearningRate:
    """One param group's learning rate, step by step: what its fused table's runtime commits
    each step at (`fused_table_runtime.StepLearningRate`)."""

    def __init__(self, optimizer: BagPipeFusedOptimizer, group: int) -> None:
        self._optimizer = optimizer
        self._group = group

    def next_lr(self) -> float:
        return self._optimizer.step_lr(self._group)

    def step_finished(self) -> None:
        self._optimizer._step_finished(self._group)
