"""`BagPipeTables`: the tables of one sharded module that the plan places on BagPipe.

Shared by the sharded EmbeddingBagCollection (embeddingbag.py) and EmbeddingCollection
(embedding.py): both hand this class their BagPipe tables and differ only in what they make
of the rows a batch reads (lookup.py: pooled bags or one embedding per id). It puts
together, in this order:

* the `PSTableView` of each table (table_view.py): the `<table>` submodules carrying the
  placeholder parameters and the state-dict access;
* the fused optimizer (fused_optimizer.py), one param group per fused table: the learning
  rate every step of that fused table commits at (its `group_lr`), and the optimizer state
  in TorchRec's layout (`read_optimizer_state` / `load_optimizer_state`);
* one `FusedTableRuntime` per fused table (the one path to the PS, committing at its
  group's learning rate), the `TableIO` over them and the `TableState` (table_state.py)
  through which every state-dict read and write of these tables goes: live row-wise
  sharded tensors of PS views;
* the `StepLifecycle` (step_lifecycle.py): submissions, the rows a batch reads, pending
  steps and their finishes;

and settles a state-dict write phase (`TableState.settle`) before the next batch enters.
The layout comes agreed by every rank (layout_agreement.py).

Thread-safety: one training thread per rank (the autograd thread runs the backward hook
while that thread waits in backward).

Invariants:
1. The PS is the only owner of row values and their optimizer state; the state-dict
   tensors (and the fused optimizer's state) are live views that read them through
   `TableIO` after the commits of finished steps (a pending step stays pending) and write
   them only when no forward waits for its backward (`StepLifecycle.close_forward`); the
   next batch (or the end of a load) settles the ranks, dropping every cache when any rank
   wrote.
2. Once a batch reached only some fused tables (`StepLifecycle.broken`) or the tables were
   closed, every call raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.distributed.fused_optimizer import BagPipeFusedOptimizer, FusedGroup
from torchrec_bagpipe.distributed.fused_table_runtime import FusedTableRuntime, build_fused_table
from torchrec_bagpipe.distributed.job import BagPipeJob
from torchrec_bagpipe.distributed.layout import FusedLayout
from torchrec_bagpipe.distributed.step_lifecycle import StepLifecycle
from torchrec_bagpipe.distributed.table_io import TableIO
from torchrec_bagpipe.distributed.table_state import TableState
from torchrec_bagpipe.distributed.table_view import PSTableView
from torchrec_bagpipe.distributed.types import BatchRows

__all__ = ["BagPipeTables"]


class BagPipeTables:
    """The BagPipe tables of one sharded module (see module docstring).

    Args:
        job, layout: the process's job and these tables' layout, as
            `layout_agreement.agreed_layout` returns them (every rank agreed on them;
            nothing is open on the PS yet).
        configs: the BagPipe tables' configs, in module order.
        weights: the unsharded module's weight of each table (`meta` when not materialised).
        param_prefix: the collection attribute the tables' parameters live under
            (`embedding_bags` for an EBC, `embeddings` for an EC).
    """

    def __init__(
        self,
        job: BagPipeJob,
        layout: FusedLayout,
        configs: Sequence[BaseEmbeddingConfig],
        weights: Mapping[str, torch.Tensor],
        *,
        device: torch.device,
        config: BagPipeConfig,
        param_prefix: str,
    ) -> None:
        self.config = config
        self._job = job
        self.layout = layout
        fused = layout.fused
        self.views: dict[str, PSTableView] = {
            t.name: PSTableView(self, t.name, t.dim, device) for t in layout.tables
        }
        self.optimizer = BagPipeFusedOptimizer(
            {f"{param_prefix}.{name}.weight": view.weight for name, view in self.views.items()},
            [
                FusedGroup(spec.name, spec.lr, spec.optimizer, [t.name for t in spec.tables],
                           [self.views[t.name].weight for t in spec.tables])
                for spec in fused
            ],
            pending_fn=self.finish_pending,
            state_io=self,
        )
        self.runtimes: list[FusedTableRuntime] = []
        try:
            for g, spec in enumerate(fused):
                self.runtimes.append(build_fused_table(spec, job=job, config=config,
                                                       lr=self.optimizer.group_lr(g)))
            self._io = TableIO(layout, self.runtimes, job)
            self._io.write_initial_weights(
                {t.name: weights[t.name] for t in layout.tables},
                {cfg.name: cfg.init_fn for cfg in configs},
            )
        except BaseException:
            for rt in self.runtimes:
                with contextlib.suppress(Exception):
                    rt.close()
            raise
        self.state = TableState(layout, self._io, self.runtimes, job,
                                drain=self._drain_for_state,
                                on_settle=self.optimizer.settle_steps)
        self.steps = StepLifecycle(layout, self.runtimes, device=device,
                                   control=job.control if config.check_finite_grads else None)
        self._closed = False
        job.register(self)

    # ---- batches (the step lifecycle, after the state-dict phase settled) -----------------------
    def enter(self, features: KeyedJaggedTensor, training: bool
              ) -> tuple[list[KeyedJaggedTensor], list[torch.Tensor]]:
        """`input_dist` of one batch (`StepLifecycle.enter`)."""
        self.check_open()
        self.state.settle()
        return self.steps.enter(features, training)

    def batch_rows(self, keys: Sequence[torch.Tensor], training: bool) -> list[BatchRows]:
        """The rows a batch of fused `keys` reads from each fused table
        (`StepLifecycle.batch_rows`)."""
        self.check_open()
        return self.steps.batch_rows(keys, training)

    def presubmit(self, features: KeyedJaggedTensor) -> None:
        """Submits a future training batch to the lookahead window (`StepLifecycle`)."""
        self.check_open()
        self.state.settle()
        self.steps.presubmit(features)

    def hold_submissions(self) -> None:
        """Queues the batches `enter` would submit until `release_submissions`."""
        self.steps.hold_submissions()

    def release_submissions(self) -> None:
        self.steps.release_submissions()

    def finish_pending(self) -> None:
        """Finishes, with a zero gradient, every step that received none (at the step's
        learning rate): an explicit end of step (the fused optimizer's `step()`)."""
        self.steps.finish_pending()

    def prescan(self, features: Iterable[KeyedJaggedTensor], progress: bool | None = None
                ) -> None:
        """Hands the whole trace (every step's local batch, in order) to each fused table's
        runtime (a collective: every rank calls it). `progress`: show the planner's bar
        (default: on rank 0).

        REQUIRES: no batch submitted yet; `optimization_prescan` set in the config.
        """
        self.check_open()
        if not self.config.optimization_prescan:
            raise ValueError(
                "prescan() needs BagPipeConfig(optimization_prescan=True) "
                "(--optimization-prescan)"
            )
        traces: list[list[torch.Tensor]] = [[] for _ in self.runtimes]
        for kjt in features:
            _, keys = self.layout.split(kjt)
            for g, k in enumerate(keys):
                traces[g].append(k)
        show = self._job.rank == 0 if progress is None else progress
        for g, rt in enumerate(self.runtimes):
            rt.prescan(traces[g], progress=show)

    def metrics(self) -> dict[str, dict[str, Any]]:
        """Runtime metrics per fused table (plain dicts)."""
        return {rt.name: rt.metrics() for rt in self.runtimes}

    def flush(self) -> None:
        """Finishes gradient-less steps and waits until every pending commit is applied."""
        self.finish_pending()
        for rt in self.runtimes:
            rt.flush()

    def close(self) -> None:
        """Drains pending commits and closes the runtimes (idempotent)."""
        if self._closed:
            return
        try:
            self.finish_pending()
            for rt in self.runtimes:
                rt.flush()
        finally:
            self._closed = True
            for rt in self.runtimes:
                rt.close()
            self._job.unregister(self)

    def check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this BagPipe module was closed; its PS sessions are gone")
        if self.steps.broken is not None:
            raise RuntimeError(
                f"this BagPipe module cannot continue: a batch reached only some of its fused "
                f"tables ({self.steps.broken!r})"
            )

    # ---- state dict access (every read and write goes through TableState) ---------------------
    def table_shape(self, table: str) -> tuple[int, int]:
        return self._io.shape(table)

    def table_weight(self, table: str) -> torch.Tensor:
        """The table's weights: a row-wise ShardedTensor of live PS views (table_state.py)."""
        self.check_open()
        return self.state.weight(table)

    def write_table(self, table: str, value: torch.Tensor) -> None:
        """A state-dict load of one table: this rank's rows of `value` (plain or sharded)
        into the PS; `finish_load` settles the ranks. Raises RuntimeError, writing nothing,
        between a training forward and its backward."""
        self._drain_for_state(write=True)
        self.state.load_weight(table, value)

    def finish_load(self) -> None:
        """After a state-dict load: every rank waits for the others' writes, then drops its
        cached rows (a collective)."""
        self.state.settle()

    def _drain_for_state(self, write: bool) -> None:
        """Before a state-dict read or write of the PS rows: the module is open; a write also
        needs no forward waiting for its backward (`StepLifecycle.close_forward`). A read
        leaves a pending step pending: the runtime reads after the commits of finished
        steps."""
        self.check_open()
        if write:
            self.steps.close_forward("writing a BagPipe table's state (a load)")

    # ---- optimizer state (the fused optimizer's OptimizerStateIO) -------------------------------
    @property
    def virtual_tables(self) -> frozenset[str]:
        """The virtual tables (use_virtual_table=True): no state-dict entries yet (their id
        space is no tensor; docs/virtual_tables.md)."""
        return frozenset(t.name for t in self.layout.tables if t.eviction is not None)

    def read_optimizer_state(self, table: str) -> dict[str, torch.Tensor]:
        """The table's optimizer state in TorchRec's layout: live row-wise ShardedTensors
        (none for a virtual table)."""
        self.check_open()
        if table in self.virtual_tables:
            return {}
        return dict(self.state.optimizer_state(table))

    def load_optimizer_state(self, states: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Writes this rank's rows of tables' optimizer states (plain or sharded values; every
        rank calls it), then settles the ranks. Raises RuntimeError, writing nothing,
        between a training forward and its backward."""
        self._drain_for_state(write=True)
        for table, tensors in states.items():
            self.state.load_optimizer_state(table, tensors)
        self.state.settle()
