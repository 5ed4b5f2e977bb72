"""Lookup for a BagPipe-sharded module: a batch's rows, pooled or as sequence embeddings.

The rows a batch reads from a fused table come from the step lifecycle
(step_lifecycle.py) as `types.BatchRows` (rows [U, dim] on the device, `inverse`: the
batch's i-th id reads ``rows[inverse[i]]``); this file turns them into the module's output,
given the batch's KJT of that fused table (its ids enter here once):

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

import torch
import torch.nn.functional as F
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from torchrec_bagpipe.distributed.types import BatchRows

__all__ = ["Pooler", "sequence_embeddings"]


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
