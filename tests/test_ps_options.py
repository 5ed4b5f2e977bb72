"""The one settings path: a BagPipeConfig becomes the native components' option structs in
torchrec_bagpipe.ps.options only, the keyword APIs build the same structs, and the server CLI
takes its config flags from BagPipeConfig itself."""

from __future__ import annotations

import argparse

import pytest
import torch

from torchrec_bagpipe import BagPipeConfig
from torchrec_bagpipe.ps import EmbeddingStore, PSClient, PSShard
from torchrec_bagpipe.ps.options import (
    client_options,
    ps_client_options,
    ps_shard_options,
    shard_options,
    store_options,
)
from torchrec_bagpipe.ps.server import CONFIG_FLAGS, build_parser


def test_shard_options_take_the_config_store_fields() -> None:
    cfg = BagPipeConfig(store_threads=3, memory_budget="64M", spill_dir="/tmp/spill")
    o = shard_options(cfg, 1, 2, store_shards=4, page_rows=256, dim=8)
    assert (o.shard.shard_id, o.shard.num_shards, o.shard.expected_dim) == (1, 2, 8)
    assert (o.store.num_threads, o.store.memory_budget, o.store.spill_dir) == (3, 64 << 20,
                                                                             "/tmp/spill")
    assert (o.store.num_shards, o.store.page_rows) == (4, 256)
    # The same options from keywords.
    k = ps_shard_options(1, 2, dim=8, store_threads=3, memory_budget="64M",
                         spill_dir="/tmp/spill", store_shards=4, page_rows=256)
    for field in ("num_threads", "memory_budget", "spill_dir", "num_shards", "page_rows"):
        assert getattr(k.store, field) == getattr(o.store, field), field


def test_option_builders_name_the_bad_argument() -> None:
    with pytest.raises(ValueError, match="rank 2 must be below world_size 2"):
        ps_client_options(table="t", dim=4, lr=1.0, rank=2, world_size=2, init="zeros")
    with pytest.raises(ValueError, match="partitioner"):
        ps_client_options(table="t", dim=4, lr=1.0, partitioner="nearest", init="zeros")
    with pytest.raises(ValueError, match="checkpoint_every needs a checkpoint_dir"):
        ps_shard_options(0, 1, checkpoint_every=5)
    with pytest.raises(TypeError, match="num_threads"):
        store_options(4, num_threads=1.5, init="zeros")  # type: ignore[arg-type]


def test_components_built_from_options_match_the_keyword_apis() -> None:
    keys = torch.tensor([3, 9, 3])
    kw = EmbeddingStore(4, num_shards=4, init="uniform", init_bound=0.5, seed=5)
    opt = EmbeddingStore.from_options(store_options(4, num_shards=4, init="uniform",
                                                    init_bound=0.5, seed=5))
    assert opt.options() == kw.options()
    assert torch.equal(opt.lookup(keys), kw.lookup(keys))

    shard = PSShard.from_options(ps_shard_options(0, 1, dim=4))
    cfg = BagPipeConfig(partitioner="fast_range", gradient_division=True, init_seed=5)
    with PSClient.from_options([shard], client_options(
            cfg, table="t", dim=4, lr=0.5, rank=0, world_size=1, init="uniform",
            init_bound=0.5)) as c:
        assert torch.equal(c.lookup(keys), kw.lookup(keys))  # same init: bound and seed
        assert c.partitioner.kind == "fast_range"
    with pytest.raises(ValueError, match="--dim 4"):
        shard.create_table("u", 8, init="zeros")
    shard.close()


def test_server_config_flags_are_the_config_fields() -> None:
    trainer = argparse.ArgumentParser()
    BagPipeConfig.add_arguments(trainer)
    want = {a.dest: (a.option_strings, a.help, a.default) for a in trainer._actions}
    got = {a.dest: (a.option_strings, a.help, a.default) for a in build_parser()._actions}
    names = [n for group in CONFIG_FLAGS.values() for n in group]
    assert names
    for name in names:
        assert got[name] == want[name], name
    with pytest.raises(ValueError, match="no field"):
        BagPipeConfig.add_arguments(argparse.ArgumentParser(), ["not_a_field"])
