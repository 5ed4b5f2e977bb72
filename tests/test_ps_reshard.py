"""A PS checkpoint set written by K shards restores onto K' shards (issue 23 item 3).

`PSShard(restore=[dir_0, ..., dir_{K-1}], partitioner=...)` keeps the stored rows the
clients' partitioner routes to it. Against the set's own rows read through K shards: every
row (weights and optimizer state) is bitwise the same through K' shards, no row that was
never written is created, and training continued on K' shards is bitwise training continued
on K (the client's split is stable, so each key's gradients keep their summation order).
Bad sets are refused naming the table and the directory, before anything is served.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from torchrec_bagpipe.ps import PSClient, PSShard

DIM = 4
BOUND = 1000


def _client(shards: list[PSShard], partitioner: str, optimizer: str, **kw: Any) -> PSClient:
    return PSClient(shards, table="t", dim=DIM, lr=0.1, key_bound=BOUND, optimizer=optimizer,
                    partitioner=partitioner, **kw)


def _train(client: PSClient, steps: range, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for s in steps:
        keys = torch.randint(0, BOUND // 4, (40,), generator=g) * 3  # duplicates, gaps
        client.commit(s, keys, torch.randn(40, DIM, generator=g))


def _stored_rows(shards: list[PSShard]) -> int:
    return sum(int(s.table_stats("t")["store"]["rows"]) for s in shards)


def _checkpointed(tmp_path: Path, k: int, partitioner: str, optimizer: str
                  ) -> tuple[list[str], torch.Tensor, int, torch.Tensor]:
    """K shards trained 3 steps and checkpointed as a set: the set's directories, every row
    with state, the stored row count, and the rows after 2 more steps."""
    shards = [PSShard(shard_id=i, num_shards=k, checkpoint_dir=tmp_path / f"k{k}-{i}")
              for i in range(k)]
    keys = torch.arange(BOUND, dtype=torch.int64)
    with _client(shards, partitioner, optimizer) as c:
        _train(c, range(3), seed=1)
        assert c.checkpoint(label="set") == [2] * k
        rows = c.lookup(keys, with_state=True)
        stored = _stored_rows(shards)
        _train(c, range(3, 5), seed=2)
        after = c.lookup(keys, with_state=True)
    for s in shards:
        s.close()
    return [str(tmp_path / f"k{k}-{i}" / "set") for i in range(k)], rows, stored, after


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("partitioner", ["modulo", "hash", "fast_range"])
@pytest.mark.parametrize(("k", "k2"), [(2, 1), (1, 3), (3, 2)])
def test_a_set_of_k_shards_restores_bitwise_onto_k2(tmp_path, k, k2, partitioner, optimizer):
    dirs, want, stored, after = _checkpointed(tmp_path, k, partitioner, optimizer)
    keys = torch.arange(BOUND, dtype=torch.int64)
    shards = [PSShard(shard_id=i, num_shards=k2, restore=dirs[::-1], partitioner=partitioner)
              for i in range(k2)]
    assert all(s.restored == {"t": 2} for s in shards)
    assert _stored_rows(shards) == stored  # no row that was never written appears
    with _client(shards, partitioner, optimizer, expected_step=2) as c:
        assert torch.equal(c.lookup(keys, with_state=True), want)
        _train(c, range(3, 5), seed=2)
        assert torch.equal(c.lookup(keys, with_state=True), after)
    for s in shards:
        s.close()


def test_bad_sets_are_refused_naming_the_table_and_directory(tmp_path):
    dirs, _, _, _ = _checkpointed(tmp_path, 2, "modulo", "adagrad")
    with pytest.raises(ValueError, match=r"shard 1 of 2, but 1 directories were given"):
        PSShard(shard_id=0, num_shards=1, restore=dirs[1:])
    with pytest.raises(ValueError, match=r"each shard of the set exactly once"):
        PSShard(shard_id=0, num_shards=1, restore=[dirs[0], dirs[0]])
    # Shard 1 of another set at another step: not one checkpoint set.
    other = [PSShard(shard_id=i, num_shards=2, checkpoint_dir=tmp_path / f"o{i}")
             for i in range(2)]
    with _client(other, "modulo", "adagrad") as c:
        _train(c, range(5), seed=3)
        c.checkpoint(label="set")
    for s in other:
        s.close()
    with pytest.raises(ValueError, match=r"table 't' is at committed step 4 in .*o1.*but at 2 "
                                         r"in .*not one checkpoint set"):
        PSShard(shard_id=0, num_shards=1, restore=[dirs[0], str(tmp_path / "o1" / "set")])
    with pytest.raises(ValueError, match=r"'nowhere' is not a directory"):
        PSShard(shard_id=0, num_shards=1, restore=[dirs[0], "nowhere"])
    with pytest.raises(ValueError, match=r"partition"):
        PSShard(shard_id=0, num_shards=1, restore=dirs, partitioner="round_robin")
    # A shard restoring its own directory of another count is told it needs the set.
    with pytest.raises(ValueError, match=r"restores resharded"):
        PSShard(shard_id=0, num_shards=1, restore=dirs[0])
