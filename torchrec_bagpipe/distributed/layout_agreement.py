"""`agreed_layout`: a module's BagPipe layout, agreed by every rank before anything opens on
the PS.

The job (job.py) and the layout (layout.py) of a sharded module's BagPipe tables are built
on each rank, then compared across ranks on the job's control group (agreement.py): a
rank's own set-up error or any difference in tables, settings or deployment fails every
rank at once, naming the rank and the field, so no rank opens a PS session the others do
not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.distributed.agreement import agree_before_open, describe
from torchrec_bagpipe.distributed.job import BagPipeJob, job_for
from torchrec_bagpipe.distributed.layout import FusedLayout, table_specs
from torchrec_bagpipe.distributed.table_optimizer import TableOptimizer

__all__ = ["agreed_layout"]


def agreed_layout(
    configs: Sequence[BaseEmbeddingConfig],
    embedding_names: Sequence[Sequence[str]],
    optimizers: Mapping[str, TableOptimizer],
    *,
    env: ShardingEnv,
    device: torch.device,
    config: BagPipeConfig,
    module_fqn: str,
    weighted: bool,
    where: str,
    problem: BaseException | None,
) -> tuple[BagPipeJob, FusedLayout]:
    """The job and the layout of a module's BagPipe tables, agreed by every rank before
    anything opens on the PS (a collective on the job's control group, agreement.py).

    `embedding_names`: per table, its features' output keys as the whole module names them
    (a feature shared with a stock table is still `feature@table`); `optimizers`: each
    table's optimizer and initial learning rate (`table_optimizer.table_optimizer`, read
    before TorchRec's sharders see the module: see sharded_module.py); `weighted`: whether
    bags take per-id weights; `where`: names the module in error messages.

    `problem`: this rank's own set-up error so far (a bad plan, an unsupported optimizer), or
    None. A rank's own mistakes are not raised alone: every rank hears of them through the
    agreement and raises together (`SpecMismatchError` naming the rank and its error), as it
    does on any difference in tables, settings or deployment.
    """
    try:
        job = job_for(config, env, device)
    except ValueError as e:
        # This module's deployment differs from the process's job: the other ranks hear of
        # it (or of this rank's earlier mistake) through the job's control group.
        current = BagPipeJob.current()
        if current is None:
            raise (problem or e) from None
        agree_before_open(current.control, None, where=where, error=problem or e)
        raise
    layout: FusedLayout | None = None
    if problem is None:
        try:
            layout = FusedLayout(
                table_specs(configs, optimizers), embedding_names,
                session=job.next_session_id(), module_fqn=module_fqn, weighted=weighted,
                where=where,
            )
        except Exception as e:
            problem = e
    agree_before_open(
        job.control,
        None if layout is None else describe(layout.tables, layout.fused, config,
                                             job.deployment()),
        where=where, error=problem,
    )
    assert layout is not None
    return job, layout
