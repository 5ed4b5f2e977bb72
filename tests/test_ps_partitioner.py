"""Partitioner: reference vectors pin the mapping (shared with the native tests)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrec_bagpipe.ps import Partitioner
from torchrec_bagpipe.ps.partitioner import (
    KINDS,
    REFERENCE_KEYS,
    REFERENCE_VECTORS,
    reference_shard_of,
)


@pytest.mark.parametrize(("kind", "shards"), sorted(REFERENCE_VECTORS))
def test_reference_vectors(kind: str, shards: int) -> None:
    keys = torch.tensor(REFERENCE_KEYS, dtype=torch.int64)
    want = list(REFERENCE_VECTORS[(kind, shards)])
    assert Partitioner(kind, shards).shard_of(keys).tolist() == want
    assert [reference_shard_of(kind, shards, k) for k in REFERENCE_KEYS] == want


@settings(deadline=None, max_examples=60)
@given(
    kind=st.sampled_from(KINDS),
    shards=st.integers(1, 17),
    keys=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40),
)
def test_native_matches_python_specification(kind: str, shards: int, keys: list[int]) -> None:
    p = Partitioner(kind, shards)
    got = p.shard_of(torch.tensor(keys, dtype=torch.int64)).tolist()
    assert got == [reference_shard_of(kind, shards, k) for k in keys]
    parts = p.split(torch.tensor(keys, dtype=torch.int64))
    assert len(parts) == shards
    for s, pos in enumerate(parts):
        assert pos.tolist() == sorted(pos.tolist())  # input order within a shard
        assert all(got[i] == s for i in pos.tolist())


def test_argument_errors() -> None:
    with pytest.raises(ValueError, match="partitioner"):
        Partitioner("range", 2)
    with pytest.raises(ValueError, match="num_shards"):
        Partitioner("hash", 0)
    with pytest.raises(TypeError, match="int64"):
        Partitioner("hash", 2).shard_of(torch.zeros(3))
