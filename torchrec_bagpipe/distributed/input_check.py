"""Validation of a sharded module's input KJT, before anything reaches the runtime or the PS.

`check_kjt` refuses, with a ValueError / TypeError naming the feature and the position, what
the kernels would otherwise turn into garbage indices or silent truncation: ids that are not
integers, negative lengths, lengths that do not add up to the values, offsets that do not
start at 0, decrease, or end elsewhere than at the number of values, lengths and offsets
that disagree, weights of another size or dtype. A refused batch consumes no PS step (the
layout calls this before the batch is submitted).

Thread-safety: pure function of its argument.
"""

from __future__ import annotations

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["check_kjt"]

_ID_DTYPES = (torch.int32, torch.int64)


def _where(features: KeyedJaggedTensor, index: int) -> str:
    """The feature and sample of flat bag `index` (key-major, as KJTs lay bags out)."""
    stride = max(features.stride(), 1)
    keys = features.keys()
    k = index // stride
    name = repr(keys[k]) if k < len(keys) else "?"
    return f"feature {name}, sample {index % stride}"


def check_kjt(features: KeyedJaggedTensor) -> None:
    """Raises TypeError / ValueError if `features` is not a well-formed KJT of integer ids."""
    values = features.values()
    if values.dtype not in _ID_DTYPES:
        raise TypeError(
            f"KJT ids must be int32 or int64, got {values.dtype} (float ids would be truncated)"
        )
    if values.dim() != 1:
        raise ValueError(f"KJT values must be 1-D, got shape {tuple(values.shape)}")
    n = values.numel()
    bags = len(features.keys()) * features.stride()
    lengths = features.lengths_or_none()
    offsets = features.offsets_or_none()
    if lengths is not None:
        if lengths.dtype not in _ID_DTYPES:
            raise TypeError(f"KJT lengths must be int32 or int64, got {lengths.dtype}")
        lengths = lengths.reshape(-1).to("cpu", torch.int64)
        if lengths.numel() != bags:
            raise ValueError(
                f"KJT lengths hold {lengths.numel()} entries, expected {bags} "
                f"({len(features.keys())} keys x stride {features.stride()})"
            )
        neg = torch.nonzero(lengths < 0)
        if neg.numel():
            i = int(neg[0])
            raise ValueError(f"KJT length {int(lengths[i])} is negative ({_where(features, i)})")
        total = int(lengths.sum())
        if total != n:
            raise ValueError(f"KJT lengths add up to {total} ids, but it holds {n} values")
    if offsets is not None:
        if offsets.dtype not in _ID_DTYPES:
            raise TypeError(f"KJT offsets must be int32 or int64, got {offsets.dtype}")
        offsets = offsets.reshape(-1).to("cpu", torch.int64)
        if offsets.numel() != bags + 1:
            raise ValueError(f"KJT offsets hold {offsets.numel()} entries, expected {bags + 1}")
        if int(offsets[0]) != 0 or int(offsets[-1]) != n:
            raise ValueError(
                f"KJT offsets must run from 0 to the {n} values, got {int(offsets[0])} .. "
                f"{int(offsets[-1])}"
            )
        steps = offsets[1:] - offsets[:-1]
        dec = torch.nonzero(steps < 0)
        if dec.numel():
            i = int(dec[0])
            raise ValueError(
                f"KJT offsets decrease at position {i + 1} ({int(offsets[i])} -> "
                f"{int(offsets[i + 1])}, {_where(features, i)})"
            )
        if lengths is not None and not torch.equal(steps, lengths):
            i = int(torch.nonzero(steps != lengths)[0])
            raise ValueError(
                f"KJT lengths and offsets disagree at {_where(features, i)} (length "
                f"{int(lengths[i])}, offsets {int(offsets[i])} -> {int(offsets[i + 1])})"
            )
    weights = features.weights_or_none()
    if weights is not None:
        if not weights.is_floating_point():
            raise TypeError(f"KJT weights must be floating point, got {weights.dtype}")
        if weights.numel() != n:
            raise ValueError(f"KJT weights hold {weights.numel()} entries for {n} ids")
