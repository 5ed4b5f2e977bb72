"""The DLRM example's model trained in one process on the global batch: the reference that
a distributed run (stock TorchRec or BagPipe, W ranks) must reproduce.

`reference_losses(argv, initial_state, embedding_optimizer=None, world=2)` builds the model of
`argv` (tables materialised), loads `initial_state`, reads every rank's training batches
(`dlrm_dataloader.get_dataloader(args, "train", r, world)`) and trains on their
concatenation (rank 0's samples, then rank 1's, ...; mean loss, so the gradient is what DDP
and TorchRec's gradient division give) with torch's own optimizers: the tables with
`embedding_optimizer` = (class, kwargs) (default: dlrm_main's choice, ``--adagrad`` ->
`torch.optim.Adagrad`, else SGD), the dense part with dlrm_main's (Adagrad or SGD), both
under the example's LR policy (`lr_scheduler.LRPolicyScheduler`). It returns the loss of each
step before its update: the mean of the ranks' batch losses of that step.

Dense embedding gradients: rows a batch does not read get a zero gradient, which leaves them
unchanged under SGD and (row-wise) Adagrad without weight decay — the lazy update the PS and
fbgemm apply. (Adam is not lazy with dense gradients: not offered here.)
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["cat_batches", "reference_losses"]


def cat_batches(batches: list[Batch]) -> Batch:
    """The global batch: the ranks' samples in rank order."""
    dicts = [b.sparse_features.to_dict() for b in batches]
    keys = batches[0].sparse_features.keys()
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=keys,
        values=torch.cat([d[k].values() for k in keys for d in dicts]),
        lengths=torch.cat([d[k].lengths() for k in keys for d in dicts]),
    )
    return Batch(dense_features=torch.cat([b.dense_features for b in batches]),
                 sparse_features=kjt, labels=torch.cat([b.labels for b in batches]))


def reference_losses(argv: list[str], initial_state: Mapping[str, torch.Tensor],
                     embedding_optimizer: tuple[type, dict[str, Any]] | None = None,
                     world: int = 2) -> list[float]:
    """The global loss of each training step of the single-process model (module doc)."""
    import dlrm_main
    from dlrm_dataloader import get_dataloader
    from lr_scheduler import LRPolicyScheduler

    args = dlrm_main.parse_args(argv)
    if args.multi_hot_sizes is not None or args.undersampling_rate is not None:
        raise ValueError("the single-process reference reads plain one-hot training batches")
    model = dlrm_main.build_model(args, torch.device("cpu"), torch.device("cpu"))
    model.load_state_dict(dict(initial_state))
    tables = [p for n, p in model.named_parameters() if "embedding_bags" in n]
    dense = [p for n, p in model.named_parameters() if "embedding_bags" not in n]
    if embedding_optimizer is None:
        kwargs: dict[str, Any] = {"lr": args.learning_rate}
        if args.adagrad:
            kwargs["eps"] = args.eps
        embedding_optimizer = (torch.optim.Adagrad if args.adagrad else torch.optim.SGD,
                               kwargs)
    cls, kwargs = embedding_optimizer
    opts = [cls(tables, **kwargs), dlrm_main._optimizer_factory(args)(dense)]
    policies = [LRPolicyScheduler(o, args.lr_warmup_steps, args.lr_decay_start,
                                  args.lr_decay_steps) for o in opts]
    loaders = [itertools.islice(iter(get_dataloader(args, "train", r, world)),
                                args.limit_train_batches) for r in range(world)]
    losses = []
    for per_rank in zip(*loaders):
        for o in opts:
            o.zero_grad()
        loss, _ = model(cat_batches(list(per_rank)))
        loss.backward()
        for o in opts:
            o.step()
        for p in policies:
            p.step()
        losses.append(float(loss.detach()))
    return losses
