"""The one settings path: each PS component takes one spec (torchrec_bagpipe.ps.*_spec*),
whose fields, defaults and checks are stated once and whose defaults are the native
struct's; a BagPipeConfig becomes specs in torchrec_bagpipe.ps.config_specs only; the server
CLI takes its config flags from BagPipeConfig itself and its defaults from the specs."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest
import torch

from torchrec_bagpipe import BagPipeConfig
from torchrec_bagpipe._native import C
from torchrec_bagpipe.ps import (
    ClientSpec,
    EmbeddingStore,
    LoadSpec,
    OptimizerSpec,
    PSClient,
    PSShard,
    ShardSpec,
    StoreLayout,
    StoreSpec,
    TableSchema,
    TcpServerSpec,
    UcxServerSpec,
)
from torchrec_bagpipe.ps.config_specs import client_spec, shard_spec
from torchrec_bagpipe.ps.server import CONFIG_FLAGS, build_parser


# ---- defaults: each spec's are the native struct's --------------------------------------------
def _fields(native: Any) -> dict[str, Any]:
    """A bound native struct as a dict (nested structs as dicts too)."""
    out = {}
    for name in dir(native):
        if name.startswith("_"):
            continue
        value = getattr(native, name)
        if callable(value):
            continue
        if type(value).__module__ == C.__name__:
            value = _fields(value)
        out[name] = value
    return out


# spec built with only what it requires -> (its native struct, the native default struct,
# the native fields those required values set)
REQUIRED = {
    "OptimizerSpec": (lambda: OptimizerSpec().native(), C.OptimizerSpec, set()),
    # A uniform init needs a bound: 0.0 is the native default one.
    "TableSchema": (lambda: TableSchema(dim=1, init_bound=0.0).native(), C.TableSchema,
                    {"dim"}),
    "StoreLayout": (lambda: StoreLayout().native(), C.StoreOptions, set()),
    "StoreSpec": (lambda: StoreSpec(dim=1, init_bound=0.0).native(), C.StoreOptions, {"dim"}),
    "LoadSpec": (lambda: LoadSpec().native(), C.LoadOverrides, set()),
    "ShardSpec": (lambda: ShardSpec().native(), C.ShardOptions, set()),
    "ShardSpec.store": (lambda: ShardSpec().store.native(), C.StoreOptions, set()),
    "ClientSpec": (lambda: ClientSpec(table="t", dim=1, lr=1.0, init_bound=0.0).native(),
                   C.ClientOptions, {"table", "dim", "lr", "session"}),
    "ClientSpec.connect": (
        lambda: ClientSpec(table="t", dim=1, lr=1.0, init_bound=0.0).native_connect(),
        C.ConnectOptions, set()),
    "TcpServerSpec": (lambda: TcpServerSpec().native(), C.TcpServerOptions, set()),
    "UcxServerSpec": (lambda: UcxServerSpec().native(), getattr(C, "UcxServerOptions", None),
                      set()),
}


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_spec_defaults_are_the_native_defaults(name: str) -> None:
    build, native_type, required = REQUIRED[name]
    if native_type is None:
        pytest.skip("built without UCX")
    got, want = _fields(build()), _fields(native_type())
    assert set(got) == set(want) and want, name
    differ = {k for k in want if got[k] != want[k]}
    assert differ == required, {k: (got[k], want[k]) for k in differ ^ required}


def test_every_native_field_is_a_spec_field() -> None:
    """A native option nobody can set from Python would be a default stated in C++ only."""
    renamed = {"grad_division": "gradient_division", "partition": "partitioner",
               "session": "session_id", "expected_dim": "dim", "start_step": "expected_step"}
    pairs = [(ClientSpec, C.ClientOptions), (ClientSpec, C.ConnectOptions),
             (ShardSpec, C.ShardOptions), (StoreSpec, C.StoreOptions),
             (TableSchema, C.TableSchema), (LoadSpec, C.LoadOverrides),
             (TcpServerSpec, C.TcpServerOptions), (OptimizerSpec, C.OptimizerSpec)]
    if hasattr(C, "UcxServerOptions"):
        pairs.append((UcxServerSpec, C.UcxServerOptions))
    for spec, native in pairs:
        names = {f.name for f in dataclasses.fields(spec)}
        for field in _fields(native()):
            assert renamed.get(field, field) in names, f"{native.__name__}.{field}"


# ---- from a BagPipeConfig -------------------------------------------------------------------
def test_shard_spec_takes_the_config_store_fields() -> None:
    cfg = BagPipeConfig(store_threads=3, memory_budget="64M", spill_dir="/tmp/spill")
    spec = shard_spec(cfg, 1, 2, store=StoreLayout(num_shards=4, page_rows=256), dim=8)
    s, store = spec.native(), spec.store.native()
    assert (s.shard_id, s.num_shards, s.expected_dim) == (1, 2, 8)
    assert (store.num_threads, store.memory_budget, store.spill_dir) == (3, 64 << 20,
                                                                         "/tmp/spill")
    assert (store.num_shards, store.page_rows) == (4, 256)
    # The same spec from its fields.
    assert spec == ShardSpec(1, 2, dim=8, store=StoreLayout(
        num_threads=3, memory_budget="64M", spill_dir="/tmp/spill", num_shards=4,
        page_rows=256))


def test_shard_spec_takes_the_config_checkpoint_chain_fields() -> None:
    """ps_checkpoint_* reach the shard's native options; their defaults are the spec's."""
    default = shard_spec(BagPipeConfig(), 0, 1)
    assert default == ShardSpec()
    cfg = BagPipeConfig(ps_checkpoint_incremental=False, ps_checkpoint_full_every=3,
                        ps_checkpoint_chain_fraction=0.25)
    s = shard_spec(cfg, 0, 1, checkpoint_dir="/tmp/ck", checkpoint_every=2).native()
    assert (s.checkpoint_incremental, s.checkpoint_full_every,
            s.checkpoint_chain_fraction) == (False, 3, 0.25)
    with pytest.raises(TypeError, match="come from the BagPipeConfig"):
        shard_spec(cfg, 0, 1, checkpoint_full_every=2)
    with pytest.raises(ValueError, match="checkpoint_full_every"):
        ShardSpec(checkpoint_full_every=0)
    with pytest.raises(ValueError, match="checkpoint_chain_fraction"):
        ShardSpec(checkpoint_chain_fraction=0.0)
    with pytest.raises(ValueError, match="ps_checkpoint_full_every"):
        BagPipeConfig(ps_checkpoint_full_every=0)


# ---- checks name the field -----------------------------------------------------------------------
def test_specs_name_the_bad_field() -> None:
    with pytest.raises(ValueError, match="rank 2 must be below world_size 2"):
        ClientSpec(table="t", dim=4, lr=1.0, rank=2, world_size=2, init="zeros")
    with pytest.raises(ValueError, match="partitioner"):
        ClientSpec(table="t", dim=4, lr=1.0, partitioner="nearest", init="zeros")
    with pytest.raises(ValueError, match="checkpoint_every needs a checkpoint_dir"):
        ShardSpec(0, 1, checkpoint_every=5)
    with pytest.raises(TypeError, match="num_threads"):
        StoreSpec(dim=4, num_threads=1.5, init="zeros")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="io_threads must be in"):
        TcpServerSpec(io_threads=65)
    with pytest.raises(ValueError, match="keepalive_interval"):
        ClientSpec(table="t", dim=4, lr=1.0, init="zeros", keepalive_interval=-1.0)
    with pytest.raises(TypeError, match="EmbeddingStore takes a StoreSpec"):
        EmbeddingStore(4)  # type: ignore[arg-type]


def test_replacing_fields_checks_them_again() -> None:
    spec = StoreSpec(dim=4, init="zeros", optimizer="adagrad")
    assert spec.optimizer == OptimizerSpec("adagrad")
    assert dataclasses.replace(spec, dim=8).dim == 8
    with pytest.raises(ValueError, match="dim"):
        dataclasses.replace(spec, dim=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.dim = 8  # type: ignore[misc]


# ---- the components take their spec or its fields -------------------------------------------
def test_components_built_from_specs_match_the_keyword_apis() -> None:
    keys = torch.tensor([3, 9, 3])
    kw = EmbeddingStore(dim=4, num_shards=4, init="uniform", init_bound=0.5, seed=5)
    spec = StoreSpec(dim=4, num_shards=4, init="uniform", init_bound=0.5, seed=5)
    from_spec = EmbeddingStore(spec)
    assert from_spec.options() == kw.options()
    assert torch.equal(from_spec.lookup(keys), kw.lookup(keys))
    replaced = EmbeddingStore(spec, num_shards=8)  # keywords replace the spec's fields
    assert replaced.options()["num_shards"] == 8

    shard = PSShard(ShardSpec(0, 1, dim=4))
    cfg = BagPipeConfig(partitioner="fast_range", gradient_division=True, init_seed=5)
    with PSClient([shard], client_spec(cfg, table="t", dim=4, lr=0.5, rank=0, world_size=1,
                                       init="uniform", init_bound=0.5)) as c:
        assert torch.equal(c.lookup(keys), kw.lookup(keys))  # same init: bound and seed
        assert c.partitioner.kind == "fast_range"
    with pytest.raises(ValueError, match="--dim 4"):
        shard.create_table("u", TableSchema(dim=8, init="zeros"))
    shard.close()


def test_server_flags_are_the_config_fields_and_the_spec_defaults() -> None:
    trainer = argparse.ArgumentParser()
    BagPipeConfig.add_arguments(trainer)
    want = {a.dest: (a.option_strings, a.help, a.default) for a in trainer._actions}
    server = {a.dest: a for a in build_parser()._actions}
    got = {dest: (a.option_strings, a.help, a.default) for dest, a in server.items()}
    names = [n for group in CONFIG_FLAGS.values() for n in group]
    assert names
    for name in names:
        assert got[name] == want[name], name
    with pytest.raises(ValueError, match="no field"):
        BagPipeConfig.add_arguments(argparse.ArgumentParser(), ["not_a_field"])
    # The server's own flags default to the specs' fields of the same name.
    tcp, ucx, shard = TcpServerSpec(), UcxServerSpec(), ShardSpec()
    for dest, spec in (("handshake_timeout", tcp), ("idle_timeout", tcp), ("host", tcp),
                       ("port", tcp), ("max_connections", tcp), ("max_unauthenticated", tcp),
                       ("max_unauthenticated_per_host", tcp), ("progress_threads", ucx),
                       ("max_frame_bytes", shard), ("checkpoint_every", shard),
                       ("shard_id", shard), ("num_shards", shard)):
        assert server[dest].default == getattr(spec, dest), dest
    assert server["store_shards"].default == StoreLayout().num_shards
