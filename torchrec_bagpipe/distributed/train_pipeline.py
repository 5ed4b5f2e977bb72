"""`BagPipeTrainPipeline`: TorchRec's sparse-dist pipeline with a lookahead window.

`TrainPipelineSparseDist` already runs `input_dist` of batch i+1 before the forward of
batch i. This subclass reads L further batches ahead from the dataloader and submits each
one to every pipelined BagPipe-sharded module (EBC or EC; its BagPipe tables) as it enters
the window (`presubmit`), so the runtime's
planner sees L future batches (online mode) or checks each against its prescan plan
(prescan mode) while the current batch trains. Everything else — device copies, the
fused splits, forward, backward, the optimizer step — is TorchRec's, so losses equal the
plain training loop's.

With `prescan_batches`, the pipeline hands every module its whole trace before the first
batch is submitted: it holds the first `input_dist`'s submission while the model is
rewritten, reads each module's input out of every prescan batch with the same argument
mapping TorchRec's rewrite found, calls `prescan`, then releases the held submission.

Invariants:
1. Batches reach each controller in dataloader order: window batches are submitted in
   order, and a batch handed to TorchRec before the window was ready is submitted by its
   own `input_dist`, which always precedes the window's submissions.
2. A window holding submitted batches is never dropped: switching to a new dataloader
   iterator while one is pending is an error.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.train_pipeline.pipeline_context import TrainPipelineContext
from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward

from torchrec_bagpipe.distributed.sharded_module import BagPipeShardedModule
from torchrec_bagpipe.distributed.utils import bagpipe_modules

__all__ = ["BagPipeTrainPipeline"]


class BagPipeTrainPipeline(TrainPipelineSparseDist):
    """TrainPipelineSparseDist with a window of `lookahead` future batches.

    Args: those of `TrainPipelineSparseDist`, plus
        lookahead: batches read ahead of TorchRec's own pipeline; default: the largest
            `lookahead` (adaptive: `lookahead_max`) of the model's BagPipe configs (0
            without BagPipe modules).
        prescan_batches: this rank's whole training sequence, for prescan mode (the
            modules' config must set `optimization_prescan`; ignored without BagPipe
            modules).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        *args: Any,
        lookahead: int | None = None,
        prescan_batches: Iterable[Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, optimizer, device, *args, **kwargs)
        modules = [m for _, m in bagpipe_modules(model)]
        if lookahead is None:
            lookahead = max((max(m.bagpipe_config.lookahead, m.bagpipe_config.lookahead_max)
                             for m in modules), default=0)
        if lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {lookahead}")
        self._bagpipe_modules: list[BagPipeShardedModule] = modules
        self._lookahead = int(lookahead)
        self._prescan_batches = prescan_batches
        self._prescanned = prescan_batches is None or not modules
        self._window: deque[list[Any]] = deque()  # [batch, submitted]
        self._window_iter: Iterator[Any] | None = None
        self._window_exhausted = False
        self._window_ready = False
        self.prescan_seconds = 0.0

    @property
    def lookahead(self) -> int:
        return self._lookahead

    # ---- TorchRec hooks -------------------------------------------------------------------
    def _next_batch(self, dataloader_iter: Iterator[Any]) -> Any | None:
        if dataloader_iter is not self._window_iter:
            if any(submitted for _, submitted in self._window):
                raise RuntimeError(
                    "BagPipeTrainPipeline: a new dataloader iterator was passed while "
                    f"{sum(s for _, s in self._window)} batches of the previous one are "
                    "already submitted to the BagPipe runtime; exhaust the previous iterator "
                    "(or use a separate pipeline object)"
                )
            self._window.clear()
            self._window_iter = dataloader_iter
            self._window_exhausted = False
        self._fill_window()
        if not self._window:
            return None
        batch, _ = self._window.popleft()
        return batch

    def _pipeline_model(
        self,
        batch: Any | None,
        context: TrainPipelineContext,
        pipelined_forward: type[PipelinedForward] = PipelinedForward,
    ) -> None:
        for m in self._bagpipe_modules:
            m.hold_submissions()
        try:
            super()._pipeline_model(batch, context, pipelined_forward)
            if not self._prescanned:
                start = time.perf_counter()
                self._prescan()
                self.prescan_seconds = time.perf_counter() - start
                self._prescanned = True
        finally:
            for m in self._bagpipe_modules:
                m.release_submissions()
        self._window_ready = True
        self._submit_window()

    # ---- window -------------------------------------------------------------------------
    def _pipelined_bagpipe(self) -> list[BagPipeShardedModule]:
        return [m for m in self._pipelined_modules if isinstance(m, BagPipeShardedModule)]

    def _fill_window(self) -> None:
        it = self._window_iter
        while not self._window_exhausted and len(self._window) < self._lookahead + 1:
            assert it is not None
            batch = next(it, None)
            if batch is None:
                self._window_exhausted = True
                break
            self._window.append([batch, False])
        self._submit_window()

    def _submit_window(self) -> None:
        if not self._window_ready or not self._model.training:
            return
        modules = self._pipelined_bagpipe()
        for entry in self._window:
            if entry[1]:
                continue
            for m in modules:
                m.presubmit(self._module_features(m, entry[0]))
            entry[1] = True

    def _module_features(self, module: BagPipeShardedModule, batch: Any) -> Any:
        forward = module.forward
        args, kwargs = forward.args.build_args_kwargs(batch)  # type: ignore[attr-defined]
        args, kwargs = module.preprocess_input(args, kwargs)
        if kwargs:
            return next(iter(kwargs.values()))
        return args[0]

    def _prescan(self) -> None:
        pipelined = self._pipelined_bagpipe()
        missing = [m for m in self._bagpipe_modules if m not in pipelined]
        if missing:
            raise ValueError(
                "BagPipeTrainPipeline(prescan_batches=...): some BagPipe modules are not "
                "pipelined by TorchRec (their input is computed inside the model), so their "
                "trace cannot be read from the batches; call their prescan() directly"
            )
        batches = list(self._prescan_batches or [])
        for m in pipelined:
            m.prescan(self._module_features(m, b) for b in batches)
