"""`ShardedBagPipeEmbeddingBagCollection`: an EmbeddingBagCollection whose rows live in the PS.

This file holds the TorchRec `ShardedModule` face and the step lifecycle; the rest lives in
`layout.py` (tables, slots, fused tables, KJT -> fused keys, output column order),
`lookup.py` (the rows a batch reads, pooling), `table_io.py` (table rows in the PS by range,
initial weights) and `fused_table_runtime.py` (the one path to the PS, one per fused table).

Data flow of one training batch (ARCHITECTURE §5):

* `input_dist` (called one or more batches ahead by TrainPipelineSparseDist) validates the
  KJT, turns it into fused keys per fused table and submits them to the runtime
  (`FusedTableRuntime.submit`), unless `BagPipeTrainPipeline` already submitted that batch
  ahead (then it only checks the batch is the one submitted). It returns a
  `KJTListSplitsAwaitable` holding the batch's features permuted into slot order.
* `compute` takes the oldest step from each fused table (`next_step`): the batch's unique
  rows as a |U| x dim leaf tensor and the inverse map; it pools them, so autograd yields
  exactly the |U| x dim row gradient. A hook on the leaf hands that gradient to the fused
  optimizer (fused_optimizer.py), which calls `finish_step` with the step's learning rate.
* `output_dist` returns the `KeyedTensor` in the unsharded EBC's key order.

Eval (module not training) forwards read the rows straight from the PS after draining
pending commits; they never enter the runtime's step sequence.

Thread-safety: one training thread per rank (the autograd thread runs the backward hook
while that thread waits in backward).

Invariants:
1. Each fused table's steps are consumed in submission order; `compute` checks the step it
   gets belongs to its batch (same fused keys) and refuses anything else.
2. At most one step per fused table is in flight between `compute` and its gradient; a new
   `compute` first finishes a step that received no gradient with a zero gradient.
3. The PS is the only owner of row values and their optimizer state; `state_dict` (and the
   fused optimizer's) reads them back after a flush and `load_state_dict` writes them, then
   invalidates every rank's cache (table_io.py).
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torchrec.distributed.embedding_sharding import KJTListSplitsAwaitable
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.types import (
    Awaitable,
    LazyAwaitable,
    LazyNoWait,
    NoWait,
    ParameterSharding,
    ShardedModule,
    ShardingEnv,
)
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    get_embedding_names_by_table,
)
from torchrec.optim.fused import EmptyFusedOptimizer, FusedOptimizerModule
from torchrec.optim.keyed import KeyedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.distributed.agreement import agree_before_open, describe
from torchrec_bagpipe.distributed.fused_optimizer import BagPipeFusedOptimizer, FusedGroup
from torchrec_bagpipe.distributed.fused_table_runtime import FusedTableRuntime, build_fused_table
from torchrec_bagpipe.distributed.grad_check import check_finite_grad
from torchrec_bagpipe.distributed.job import BagPipeJob, job_for
from torchrec_bagpipe.distributed.layout import FusedLayout, check_plan, table_specs
from torchrec_bagpipe.distributed.lookup import BatchRows, Pooler, eval_rows, train_step
from torchrec_bagpipe.distributed.table_io import TableIO
from torchrec_bagpipe.distributed.table_optimizer import TableOptimizer, table_optimizer
from torchrec_bagpipe.distributed.types import BAGPIPE_KERNEL, BagPipeEBCContext

if TYPE_CHECKING:
    from torchrec_bagpipe.runtime.controller import Step

__all__ = ["BAGPIPE_KERNEL", "ShardedBagPipeEmbeddingBagCollection"]


class _PSTableView(nn.Module):
    """`embedding_bags.<table>`: a placeholder `weight` plus state-dict access to the PS.

    The placeholder is an empty (0, dim) parameter that carries `_in_backward_optimizers`
    (so TorchRec's `in_backward_optimizer_filter` keeps it out of the dense optimizer) and
    never receives a gradient; the table's values are read from / written to the PS.
    """

    def __init__(self, owner: ShardedBagPipeEmbeddingBagCollection, table: str, dim: int,
                 device: torch.device) -> None:
        super().__init__()
        # A plain attribute, not a submodule: registering the owner would make the module
        # tree cyclic (named_modules, state_dict and .to() would loop).
        object.__setattr__(self, "_owner", owner)
        self._table = table
        weight = nn.Parameter(torch.empty(0, dim, device=device), requires_grad=False)
        weight._in_backward_optimizers = [EmptyFusedOptimizer()]  # type: ignore[attr-defined]
        self.weight = weight

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str,
                            keep_vars: bool) -> None:
        destination[prefix + "weight"] = self._owner.read_table(self._table)

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str,
                              local_metadata: Any, strict: bool, missing_keys: list[str],
                              unexpected_keys: list[str], error_msgs: list[str]) -> None:
        key = prefix + "weight"
        if key not in state_dict:
            if strict:
                missing_keys.append(key)
            return
        value = state_dict[key]
        shape = self._owner.table_shape(self._table)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
            error_msgs.append(
                f"size mismatch for {key}: copying a param with shape {got}, the BagPipe "
                f"table {self._table!r} has shape {shape}"
            )
            return
        self._owner.write_table(self._table, value)


class ShardedBagPipeEmbeddingBagCollection(
    ShardedModule[KJTList, KeyedTensor, KeyedTensor, BagPipeEBCContext],
    FusedOptimizerModule,
):
    """Sharded EBC whose tables live in the BagPipe PS (see module docstring)."""

    def __init__(
        self,
        module: EmbeddingBagCollection,
        table_name_to_parameter_sharding: Mapping[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        config: BagPipeConfig | None = None,
        fused_params: Mapping[str, Any] | None = None,
        module_fqn: str | None = None,
    ) -> None:
        super().__init__()
        self._config = config if config is not None else BagPipeConfig()
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        self._module_fqn = module_fqn or ""
        self._is_weighted = bool(module.is_weighted())
        where = f"BagPipe EBC {self._module_fqn or '<root>'}"

        # ---- layout: tables, slots and fused tables --------------------------------------
        # A rank's own mistakes are collected, not raised: every rank hears of them through
        # the job's control group below and raises together (agreement.py).
        configs = module.embedding_bag_configs()
        layout: FusedLayout | None = None
        problem: BaseException | None = None
        optimizers: dict[str, TableOptimizer] = {}
        try:
            check_plan(configs, table_name_to_parameter_sharding, where)
            optimizers = {
                cfg.name: table_optimizer(module.embedding_bags[cfg.name].weight, fused_params,
                                          f"{where}, table {cfg.name!r}")
                for cfg in configs
            }
        except Exception as e:
            problem = e
        try:
            self._job = job_for(self._config, env, self._device)
        except ValueError as e:
            # This module's deployment differs from the process's job: the other ranks hear
            # of it (or of this rank's earlier mistake) through the job's control group.
            current = BagPipeJob.current()
            if current is None:
                raise (problem or e) from None
            agree_before_open(current.control, None, where=where, error=problem or e)
            raise
        if problem is None:
            try:
                layout = FusedLayout(
                    table_specs(configs, optimizers), get_embedding_names_by_table(configs),
                    session=self._job.next_session_id(), module_fqn=self._module_fqn,
                    weighted=self._is_weighted,
                )
            except Exception as e:
                problem = e
        # Before anything opens on the PS, the ranks compare their tables and settings and
        # fail together on any difference (agreement.py).
        agree_before_open(
            self._job.control,
            None if layout is None else describe(layout.tables, layout.fused, self._config,
                                                 self._job.deployment()),
            where=where, error=problem,
        )
        assert layout is not None
        self._layout = layout
        fused = self._layout.fused
        columns = self._layout.output_columns
        self._output_columns = columns.to(self._device) if columns is not None else None
        self._poolers = [
            Pooler([self._layout.table(s.table).pooling == "mean" for s in spec.slots],
                   self._is_weighted)
            for spec in fused
        ]

        # ---- runtime: one FusedTableRuntime per fused table; initial weights -------------
        self._runtimes: list[FusedTableRuntime] = []
        try:
            for spec in fused:
                self._runtimes.append(build_fused_table(spec, job=self._job, config=self._config))
            self._io = TableIO(self._layout, self._runtimes, self._job)
            self._io.write_initial_weights(
                {t.name: module.embedding_bags[t.name].weight for t in self._layout.tables},
                {cfg.name: cfg.init_fn for cfg in configs},
            )
        except BaseException:
            for rt in self._runtimes:
                with contextlib.suppress(Exception):
                    rt.close()
            raise

        # ---- torch state: placeholders, fused optimizer ------------------------------------
        self.embedding_bags = nn.ModuleDict({
            t.name: _PSTableView(self, t.name, t.dim, self._device) for t in self._layout.tables
        })
        params = {f"embedding_bags.{t.name}.weight": self.embedding_bags[t.name].weight
                  for t in self._layout.tables}
        self._optim = BagPipeFusedOptimizer(
            params,
            [
                FusedGroup(spec.name, spec.lr, spec.optimizer, [t.name for t in spec.tables],
                           [self.embedding_bags[t.name].weight for t in spec.tables])
                for spec in fused
            ],
            finish_fn=self._finish,
            pending_fn=self._finish_pending,
            state_io=self,
        )

        # ---- step bookkeeping ------------------------------------------------------------
        self._presubmitted: deque[_Ahead] = deque()
        self._held: list[list[torch.Tensor]] | None = None
        self._pending: list[deque[Step]] = [deque() for _ in fused]
        self._closed = False
        self._job.register(self)
        self.register_load_state_dict_post_hook(_after_load)

    # ---- TorchRec ShardedModule API ------------------------------------------------------------
    @property
    def unsharded_module_type(self) -> type[nn.Module]:
        return EmbeddingBagCollection

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        return self._optim

    def create_context(self) -> BagPipeEBCContext:
        return BagPipeEBCContext()

    def input_dist(  # type: ignore[override]
        self, ctx: BagPipeEBCContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KJTList]]:
        self._check_open()
        ahead = self._presubmitted[0] if self.training and self._presubmitted else None
        if ahead is not None and _same_data(ahead.signature, _signature(features)):
            # The very tensors submitted ahead (not modified since): reuse their split.
            per_group, keys = ahead.per_group, ahead.keys
        else:
            per_group, keys = self._layout.split(features)
        ctx.training = self.training
        ctx.batch_size = features.stride()
        ctx.keys = keys
        if self.training:
            self._enter_window(keys)
        return KJTListSplitsAwaitable(
            [NoWait(NoWait(k)) for k in per_group], ctx, self._module_fqn, None
        )

    def compute(self, ctx: BagPipeEBCContext, dist_input: KJTList) -> KeyedTensor:
        self._check_open()
        b = ctx.batch_size
        parts: list[torch.Tensor] = []
        for g, spec in enumerate(self._layout.fused):
            if ctx.training:
                rows = self._train_rows(g, ctx.keys[g])
            else:
                self._finish_pending()
                rows = eval_rows(self._runtimes[g], ctx.keys[g], self._device)
            pooled = self._poolers[g](dist_input[g], rows)
            # Slot-major (slots x batch x dim) -> batch x (slots * dim): one copy, whose
            # backward is one copy too (per-slot views would each back-propagate a zero-filled
            # gradient of the whole pooled tensor).
            parts.append(pooled.view(len(spec.slots), b, spec.dim).transpose(0, 1)
                         .reshape(b, len(spec.slots) * spec.dim))
        if not parts:
            values = torch.empty(b, 0, device=self._device)
        else:
            values = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
            if self._output_columns is not None:
                values = values.index_select(1, self._output_columns)
        return KeyedTensor(
            keys=self._layout.embedding_names,
            length_per_key=self._layout.embedding_dims,
            values=values,
            key_dim=1,
        )

    def output_dist(
        self, ctx: BagPipeEBCContext, output: KeyedTensor
    ) -> LazyAwaitable[KeyedTensor]:
        return LazyNoWait(output)

    def sharded_parameter_names(self, prefix: str = "") -> Iterator[str]:
        for name, _ in self.named_parameters(prefix):
            yield name

    # ---- BagPipe extensions (used by BagPipeTrainPipeline and tools) ------------------------
    def presubmit(self, features: KeyedJaggedTensor) -> None:
        """Submits a future training batch to the runtime's lookahead window.

        `input_dist` of the same batch, later, then only checks it matches.
        """
        self._check_open()
        per_group, keys = self._layout.split(features)
        self._submit(keys)
        self._presubmitted.append(_Ahead(_signature(features), per_group, keys))

    def hold_submissions(self) -> None:
        """Queues the batches `input_dist` would submit until `release_submissions`."""
        if self._held is None:
            self._held = []

    def release_submissions(self) -> None:
        held, self._held = self._held, None
        for keys in held or []:
            self._submit(keys)

    def prescan(self, features: Iterable[KeyedJaggedTensor],
                progress: bool | None = None) -> None:
        """Hands the whole trace (every step's local batch, in order) to each fused table's
        runtime (a collective: every rank calls it). `progress`: show the planner's bar
        (default: on rank 0).

        REQUIRES: no batch submitted yet; `optimization_prescan` set in the config.
        """
        self._check_open()
        if not self._config.optimization_prescan:
            raise ValueError(
                "prescan() needs BagPipeConfig(optimization_prescan=True) "
                "(--optimization-prescan)"
            )
        traces: list[list[torch.Tensor]] = [[] for _ in self._runtimes]
        for kjt in features:
            _, keys = self._layout.split(kjt)
            for g, k in enumerate(keys):
                traces[g].append(k)
        show = self._job.rank == 0 if progress is None else progress
        for g, rt in enumerate(self._runtimes):
            rt.prescan(traces[g], progress=show)

    def bagpipe_metrics(self) -> dict[str, dict[str, Any]]:
        """Runtime metrics per fused table (plain dicts)."""
        return {rt.name: rt.metrics() for rt in self._runtimes}

    @property
    def bagpipe_config(self) -> BagPipeConfig:
        return self._config

    def flush(self) -> None:
        """Finishes gradient-less steps and waits until every pending commit is applied."""
        self._finish_pending()
        for rt in self._runtimes:
            rt.flush()

    def close(self) -> None:
        """Drains pending commits and closes the runtime (idempotent)."""
        if self._closed:
            return
        try:
            self._finish_pending()
            for rt in self._runtimes:
                rt.flush()
        finally:
            self._closed = True
            for rt in self._runtimes:
                rt.close()
            self._job.unregister(self)

    # ---- state dict access ------------------------------------------------------------------
    def table_shape(self, table: str) -> tuple[int, int]:
        return self._io.shape(table)

    def read_table(self, table: str) -> torch.Tensor:
        """The table's current values, read from the PS after draining pending commits."""
        self._check_open()
        self._finish_pending()
        return self._io.read_rows(table, 0, self._io.shape(table)[0])

    def write_table(self, table: str, value: torch.Tensor) -> None:
        """Writes a whole table into the PS (rank 0 writes; `_after_load` synchronises)."""
        self._check_open()
        self._finish_pending()
        self._io.load_table(table, value)

    def _after_load(self) -> None:
        self._io.finish_load()

    # ---- optimizer state (the fused optimizer's OptimizerStateIO) -------------------------------
    def read_optimizer_state(self, table: str) -> dict[str, torch.Tensor]:
        """The table's optimizer state in TorchRec's layout, read from the PS after draining
        pending commits."""
        self._check_open()
        self._finish_pending()
        return self._io.optimizer_state(table)

    def load_optimizer_state(self, states: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Writes tables' optimizer states into the PS (rank 0 writes; every rank calls it
        with the same values), then every rank drops its cached rows."""
        self._check_open()
        self._finish_pending()
        for table, tensors in states.items():
            self._io.load_optimizer_state(table, tensors)
        self._io.finish_load()

    # ---- step lifecycle -----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this BagPipe EBC was closed; its PS session is gone")

    def _submit(self, keys: list[torch.Tensor]) -> None:
        for rt, k in zip(self._runtimes, keys):
            rt.submit(k)

    def _enter_window(self, keys: list[torch.Tensor]) -> None:
        if self._presubmitted:
            expected = self._presubmitted.popleft().keys
            if any(a is not b and not torch.equal(a, b) for a, b in zip(expected, keys)):
                raise RuntimeError(
                    "the batch entering input_dist is not the batch BagPipeTrainPipeline "
                    "submitted ahead for this step; feed the pipeline and the model the "
                    "same batches in the same order"
                )
            return
        if self._held is not None:
            self._held.append(keys)
            return
        self._submit(keys)

    def _train_rows(self, g: int, keys: torch.Tensor) -> BatchRows:
        if self._pending[g]:
            self._finish_pending()
        step = train_step(self._runtimes[g], keys)
        rows = step.rows
        if not torch.is_grad_enabled():
            # A training-mode forward without autograd: the step commits a zero gradient.
            self._pending[g].append(step)
            self._finish_pending()
            return BatchRows(rows.detach(), step.inverse)
        if not rows.requires_grad:
            rows.requires_grad_(True)
        self._pending[g].append(step)
        rows.register_hook(functools.partial(self._on_rows_grad, g, step))
        return BatchRows.of_step(step)

    def _on_rows_grad(self, g: int, step: Step, grad: torch.Tensor) -> None:
        pending = self._pending[g]
        if not pending or pending[0] is not step:
            raise RuntimeError(
                f"BagPipe fused table {self._runtimes[g].name!r}: a gradient arrived for a "
                "step that is already finished (backward ran twice through one forward?)"
            )
        self._optim.finish(g, step, grad.detach())

    def _finish(self, g: int, step: Step, grad: torch.Tensor, lr: float) -> None:
        pending = self._pending[g]
        assert pending and pending[0] is step
        if self._config.check_finite_grads:
            # Before anything is committed; the step stays pending if it raises.
            check_finite_grad(grad, self._job.control, table=self._runtimes[g].name,
                              step=step.step)
        pending.popleft()
        self._runtimes[g].finish_step(step, grad, lr)

    def _finish_pending(self) -> None:
        """Finishes, with a zero gradient, every step that received none."""
        for g, pending in enumerate(self._pending):
            while pending:
                step = pending[0]
                zeros = torch.zeros_like(step.rows.detach(), memory_format=torch.contiguous_format)
                self._optim.finish(g, step, zeros)


@dataclass
class _Ahead:
    """A batch submitted ahead by the pipeline, with the split `input_dist` can reuse."""

    signature: tuple[Any, ...]
    per_group: list[KeyedJaggedTensor]
    keys: list[torch.Tensor]


def _signature(features: KeyedJaggedTensor) -> tuple[Any, ...]:
    """A KJT's keys, stride and data tensors with their in-place versions (the tensors are
    held, so their identity cannot be reused while the signature lives)."""
    tensors = (features.values(), features.lengths_or_none(), features.offsets_or_none(),
               features.weights_or_none())
    return (tuple(features.keys()), features.stride(),
            *((t, t._version) if t is not None else (None, 0) for t in tensors))


def _same_data(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two signatures name the same, unmodified tensors (TorchRec's CPU device copy
    of a batch keeps them), so the split computed ahead can be reused without a compare."""
    if a[:2] != b[:2]:
        return False
    return all(x[0] is y[0] and x[1] == y[1] for x, y in zip(a[2:], b[2:]))


def _after_load(module: nn.Module, incompatible_keys: Any) -> None:
    assert isinstance(module, ShardedBagPipeEmbeddingBagCollection)
    module._after_load()
