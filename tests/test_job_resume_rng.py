"""A resumed run continues the random streams of the run that never stopped (issue 23).

One gloo rank trains a BagPipe-sharded model with dropout, a DataLoader (whose iterator's
creation draws from torch's generator) and a loss scaled by draws from Python's `random` and
NumPy; it checkpoints the whole job after step 3 and goes on to step 8. A second process
resumes from that checkpoint: it loads the trainer state holding the random streams back,
creates and positions the data iterator, then restores them (`restore_rng_state`). Its
final dense weights, tables and optimizer state are bitwise the uninterrupted run's. A
third run restores the streams before creating the iterator (what `load_job_checkpoint`
alone does) and diverges: the test can tell.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from torch import nn

STEPS = 8
SAVE_AT = 3


def _model(seed: int) -> nn.Module:
    from _scenarios import TwoTower, tables_for
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    class DropoutTower(TwoTower):
        def __init__(self, ebc: EmbeddingBagCollection) -> None:
            super().__init__(ebc)
            self.drop = nn.Dropout(0.5)

        def forward(self, batch):  # type: ignore[override]
            x = torch.cat([self.ebc(batch.sparse_features).values(),
                           torch.relu(self.dense(batch.dense_features))], dim=1)
            logits = self.over(self.drop(x)).squeeze(-1)
            loss = self.loss_fn(logits, batch.labels)
            return loss, (loss.detach(), logits.detach(), batch.labels)

    torch.manual_seed(seed)
    tables, _ = tables_for("mean")
    ebc = EmbeddingBagCollection(tables=tables)
    torch.manual_seed(seed + 1)
    return DropoutTower(ebc)


def _run(rank: int, world: int, ckpt: str, mode: str) -> dict[str, np.ndarray]:
    from _scenarios import (
        Case,
        batches_for,
        full_state,
        fused_state,
        make_dmp,
        make_samples,
    )
    from torch.utils.data import DataLoader

    from torchrec_bagpipe.distributed import (
        close_model,
        load_job_checkpoint,
        restore_rng_state,
        save_job_checkpoint,
    )

    config = {"checkpoint_dir": ckpt}
    if mode != "full":
        config["resume"] = ckpt
    case = Case(kind="mean", config=config, steps=STEPS, batch=8)
    dmp, opt = make_dmp(case, _model(0), world)
    samples = make_samples("mean", STEPS, world, case.batch, 0)
    loader = DataLoader(batches_for("mean", samples, rank, 0, True), batch_size=None,
                        collate_fn=lambda b: b)
    torch.manual_seed(1234)  # the stream training draws from
    random.seed(5)
    np.random.seed(6)
    start = 0
    if mode == "resume":
        start, _ = load_job_checkpoint(dmp, optimizer=opt, restore_rng=False)
    elif mode == "resume_early":
        start, _ = load_job_checkpoint(dmp, optimizer=opt)  # restored before the iterator
    batches = iter(loader)  # draws from torch's generator
    for _ in itertools.islice(batches, start):
        pass
    if mode == "resume":
        restore_rng_state()
    for step, b in enumerate(batches, start=start + 1):
        opt.zero_grad()
        loss, _ = dmp(b)
        scale = (1 + 0.1 * random.random()) * (1 + 0.1 * float(np.random.rand()))
        (loss * scale).backward()
        opt.step()
        if mode == "full" and step == SAVE_AT:
            save_job_checkpoint(dmp, step=step, optimizer=opt)
    state = full_state(dmp, rank)
    state.update(fused_state(opt))
    close_model(dmp)
    # NumPy copies: tensors would cross the result queue as shared memory of a process that
    # has exited.
    return {k: v.detach().cpu().numpy().copy() for k, v in state.items()}


@pytest.mark.slow
def test_a_resumed_run_with_dropout_is_bitwise_the_uninterrupted_one(tmp_path):
    from _dist import run_world

    ckpt = str(tmp_path / "ckpt")
    (full,) = run_world(_run, world_size=1, args=(ckpt, "full"))
    (resumed,) = run_world(_run, world_size=1, args=(ckpt, "resume"))
    (early,) = run_world(_run, world_size=1, args=(ckpt, "resume_early"))
    assert set(resumed) == set(full)
    for name in full:
        assert resumed[name].tobytes() == full[name].tobytes(), name
    # Restoring the streams before the iterator's creation shifts them: the dense tower
    # trains on other dropout masks.
    assert any(early[n].tobytes() != full[n].tobytes() for n in full
               if "dense" in n or "over" in n)
