"""Lookup for a BagPipe-sharded module: the rows a batch reads, then pooled or sequence
embeddings.

Two separate steps per fused table:

* **Rows for this batch** (`BatchRows`): the batch's unique rows `rows` ([U, dim], on the
  device) and `inverse` ([n] int64): the batch's i-th id reads `rows[inverse[i]]`.
  - training (`train_step`): the fused table's next runtime step, checked to be this batch;
    its rows are a leaf tensor whose gradient is the step's |U| x dim row gradient (the
    sharded module hands it to `finish_step`);
  - eval (`eval_rows`): the unique rows read straight from the PS after the commits of
    finished steps (a pending step stays pending), outside the runtime's step sequence.
* **Pooling** (`Pooler`): sum, or sum / bag length for mean, per slot, with per-id weights
  for a weighted module, through `torch.nn.functional.embedding_bag` over `inverse`, so
  autograd yields exactly the |U| x dim row gradient (EmbeddingBagCollection).
* **Sequence embeddings** (`sequence_embeddings`): one row per id, unpooled, one
  `JaggedTensor` per slot (EmbeddingCollection); gathered with `index_select` over
  `inverse`, whose backward sums each row's gradients into the |U| x dim row gradient.

Thread-safety: the rank's training thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from torchrec_bagpipe.distributed.fused_table_runtime import FusedTableRuntime

if TYPE_CHECKING:
    from torchrec_bagpipe.runtime.controller import Step

__all__ = ["BatchRows", "Pooler", "eval_rows", "sequence_embeddings", "train_step"]


@dataclass(frozen=True)
class BatchRows:
    """The rows one batch reads from one fused table (see module docstring)."""

    rows: torch.Tensor     # [U, dim] fp32
    inverse: torch.Tensor  # [n] int64, on the rows' device

    @staticmethod
    def of_step(step: Step) -> BatchRows:
        return BatchRows(step.rows, step.inverse)


def train_step(runtime: FusedTableRuntime, keys: torch.Tensor) -> Step:
    """The fused table's next runtime step, which must be the batch of fused `keys`
    (RuntimeError otherwise: steps are consumed in submission order)."""
    step = runtime.next_step()
    if step.inverse.numel() != keys.numel() or not torch.equal(step.keys, keys):
        raise RuntimeError(
            f"BagPipe fused table {runtime.name!r}: the runtime's next step is not "
            "this batch (steps must be consumed in submission order)"
        )
    return step


def eval_rows(runtime: FusedTableRuntime, keys: torch.Tensor,
              device: torch.device) -> BatchRows:
    """The rows of fused `keys` as the PS holds them after every finished step, on `device`."""
    rows, inverse = runtime.eval_rows(keys)
    return BatchRows(rows.to(device), inverse.to(device))


class Pooler:
    """Pools one fused table's rows per (slot, sample) bag.

    Args:
        mean: per slot of the fused table (slot order), whether the bag is averaged.
        weighted: whether the KJT's per-id weights scale the rows.
    """

    def __init__(self, mean: Sequence[bool], weighted: bool) -> None:
        self._mean = torch.tensor(list(mean), dtype=torch.bool)
        self._has_mean = any(mean)
        self._weighted = weighted

    def __call__(self, kjt: KeyedJaggedTensor, batch: BatchRows) -> torch.Tensor:
        """[slots * B, dim], slot-major, for `kjt` in the fused table's slot order."""
        rows = batch.rows
        offsets = kjt.offsets().to(device=rows.device, dtype=torch.int64)
        weights = kjt.weights_or_none() if self._weighted else None
        if weights is not None:
            weights = weights.to(device=rows.device, dtype=rows.dtype)
        pooled = F.embedding_bag(
            batch.inverse.to(device=rows.device, dtype=torch.int64), rows, offsets,
            mode="sum", per_sample_weights=weights, include_last_offset=True,
        )
        if self._has_mean:
            b = kjt.stride()
            lengths = kjt.lengths().to(device=rows.device, dtype=rows.dtype)
            is_mean = self._mean.to(rows.device).repeat_interleave(b)
            denom = torch.where(is_mean, lengths.clamp(min=1.0), torch.ones_like(lengths))
            pooled = pooled / denom.unsqueeze(1)
        return pooled


def sequence_embeddings(kjt: KeyedJaggedTensor, batch: BatchRows, need_indices: bool
                        ) -> list[JaggedTensor]:
    """Per slot of `kjt` (one fused table's KJT, in its slot order): the embedding of every
    id, unpooled, as TorchRec's EmbeddingCollection returns it: values [ids, dim], the
    slot's lengths, and the ids as weights when `need_indices`."""
    rows = batch.rows
    embeddings = rows.index_select(0, batch.inverse.to(device=rows.device, dtype=torch.int64))
    per_key = kjt.length_per_key()
    b = kjt.stride()
    lengths = kjt.lengths()
    values = torch.split(embeddings, per_key)
    ids = torch.split(kjt.values(), per_key) if need_indices else None
    return [
        JaggedTensor(values=values[i], lengths=lengths[i * b:(i + 1) * b],
                     weights=ids[i] if ids is not None else None)
        for i in range(len(per_key))
    ]
