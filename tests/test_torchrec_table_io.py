"""Table IO and the FusedTableRuntime API against a plain tensor model of the tables.

One spawned rank (world size 1: the PS shard is hosted in that process) lays out three
tables in two fused tables, opens their runtimes and drives `TableIO` with Hypothesis:
random row ranges written and read in chunks of random size (chunk boundaries inside and
across ranges), compared with a reference tensor per table; after `settle` a training
step through the runtime sees exactly the written rows; bad ranges and shapes are refused
before anything is written. The optimizer state and loads go through `TableState` (its live
sharded tensors, one rank: every shard local).
"""

from __future__ import annotations

import pytest
from _dist import run_world

pytestmark = pytest.mark.slow


def _table_io_worker(rank: int, world: int, max_examples: int) -> str:
    import torch
    import torch.distributed as dist
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import get_embedding_names_by_table

    from torchrec_bagpipe.config import BagPipeConfig
    from torchrec_bagpipe.distributed.fused_table_runtime import build_fused_table
    from torchrec_bagpipe.distributed.job import job_for
    from torchrec_bagpipe.distributed.layout import FusedLayout, table_specs
    from torchrec_bagpipe.distributed.table_io import TableIO
    from torchrec_bagpipe.distributed.table_optimizer import TableOptimizer
    from torchrec_bagpipe.distributed.table_state import TableState
    from torchrec_bagpipe.ps.optimizer_spec import OptimizerSpec

    configs = [
        EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=37, feature_names=["f0"]),
        EmbeddingBagConfig(name="b", embedding_dim=4, num_embeddings=23, feature_names=["f1"]),
        EmbeddingBagConfig(name="c", embedding_dim=3, num_embeddings=41, feature_names=["f0"]),
    ]
    config = BagPipeConfig()
    job = job_for(config, ShardingEnv.from_process_group(dist.group.WORLD), torch.device("cpu"))
    # a and b: Adagrad (one fused table), c: Adam; their rows carry optimizer state.
    optimizers = {"a": TableOptimizer(OptimizerSpec(kind="adagrad"), 0.1),
                  "b": TableOptimizer(OptimizerSpec(kind="adagrad"), 0.1),
                  "c": TableOptimizer(OptimizerSpec(kind="adam"), 0.1)}
    state_dims = {"a": 4, "b": 4, "c": 6}
    layout = FusedLayout(
        table_specs(configs, optimizers),
        get_embedding_names_by_table(configs),
        session=job.next_session_id(), module_fqn="table_io_test", weighted=False,
    )
    assert [sorted(t.name for t in spec.tables) for spec in layout.fused] == [["a", "b"], ["c"]]
    runtimes = [build_fused_table(spec, job=job, config=config) for spec in layout.fused]

    def whole(sharded):  # a live sharded tensor's values (world 1: every shard is local)
        shards = sorted(sharded.local_shards(), key=lambda s: s.metadata.shard_offsets[0])
        return torch.cat([s.tensor.clone() for s in shards])

    def states(table_io):
        return TableState(layout, table_io, runtimes, job, drain=lambda write: None)
    try:
        io = TableIO(layout, runtimes, job)
        # The reference starts from the PS's lazy default init and initial optimizer state,
        # as read in one go: rows [weights | state].
        ref = {c.name: io.read_rows(c.name, 0, c.num_embeddings, with_state=True)
               for c in configs}
        for c in configs:
            bound = float(c.get_weight_init_max())
            d = c.embedding_dim
            assert ref[c.name].shape == (c.num_embeddings, d + state_dims[c.name])
            assert bool((ref[c.name][:, :d].abs() <= bound).all()), c.name
            assert not ref[c.name][:, d:].any(), c.name
            assert torch.equal(io.read_rows(c.name, 0, c.num_embeddings), ref[c.name][:, :d])

        ops = st.lists(
            st.tuples(st.sampled_from(configs), st.integers(0, 45), st.integers(0, 45),
                      st.booleans(), st.booleans()),
            min_size=1, max_size=8,
        )

        @settings(max_examples=max_examples, deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(chunk=st.integers(1, 50), ops=ops, seed=st.integers(0, 2**31 - 1))
        def prop(chunk, ops, seed):
            gen = torch.Generator().manual_seed(seed)
            chunked = TableIO(layout, runtimes, job, chunk_rows=chunk)
            for cfg, x, y, write, state in ops:
                n = cfg.num_embeddings
                d = cfg.embedding_dim
                width = d + (state_dims[cfg.name] if state else 0)
                lo, hi = sorted((min(x, n), min(y, n)))
                if write:
                    # (states >= 0: the Adagrad sums and Adam's second moments are.)
                    rows = torch.rand(hi - lo, width, generator=gen)
                    chunked.write_rows(cfg.name, lo, rows, with_state=state)
                    ref[cfg.name][lo:hi, :width] = rows  # weights only: the state stays
                else:
                    got = chunked.read_rows(cfg.name, lo, hi, with_state=state)
                    assert torch.equal(got, ref[cfg.name][lo:hi, :width]), (cfg.name, lo, hi)
            for c in configs:
                got = chunked.read_rows(c.name, 0, c.num_embeddings, with_state=True)
                assert torch.equal(got, ref[c.name]), (c.name, chunk)
            # The state in TorchRec's layout.
            st_a = states(chunked).optimizer_state("a")
            assert list(st_a) == ["momentum1"]
            assert torch.equal(whole(st_a["momentum1"]), ref["a"][:, 4:])
            st_c = states(chunked).optimizer_state("c")
            assert list(st_c) == ["momentum1", "exp_avg_sq"]
            assert torch.equal(torch.cat([whole(st_c["momentum1"]), whole(st_c["exp_avg_sq"])],
                                         1), ref["c"][:, 3:])

        prop()

        # Bad ranges and shapes: clear errors, nothing written.
        before = {c.name: io.read_rows(c.name, 0, c.num_embeddings) for c in configs}
        for bad in (lambda: io.read_rows("a", 30, 38), lambda: io.read_rows("a", 5, 4),
                    lambda: io.write_rows("b", 20, torch.zeros(4, 4)),
                    lambda: io.write_rows("c", -1, torch.zeros(1, 3)),
                    lambda: runtimes[1].write_rows(0, torch.zeros(2, 4)),
                    lambda: runtimes[0].read_rows(55, 61)):
            with pytest.raises(ValueError, match=r"outside|do not fit"):
                bad()
        for c in configs:
            assert torch.equal(io.read_rows(c.name, 0, c.num_embeddings), before[c.name])

        # An optimizer-state load keeps the weights; a misshapen entry is refused, naming it.
        new_state = {"momentum1": torch.rand(41, 3, generator=torch.Generator().manual_seed(3)),
                     "exp_avg_sq": torch.rand(41, 3, generator=torch.Generator().manual_seed(4))}
        state = states(io)
        with pytest.raises(ValueError, match="'exp_avg_sq' must have shape"):
            state.load_optimizer_state("c", {**new_state, "exp_avg_sq": torch.zeros(41)})
        state.load_optimizer_state("c", new_state)
        state.settle()
        assert torch.equal(io.read_rows("c", 0, 41), before["c"])
        got = state.optimizer_state("c")
        assert all(torch.equal(whole(got[k]), new_state[k]) for k in new_state)

        # A state-dict style load, then a training step through the runtime: the step's
        # rows are the loaded rows (caches invalidated), and a zero gradient changes nothing.
        loaded = torch.randn(23, 4, generator=torch.Generator().manual_seed(7))
        state.load_weight("b", loaded)
        state.settle()
        rt = runtimes[0]
        start_b = layout.fused_start("b")
        keys = torch.tensor([start_b + 3, start_b + 3, start_b + 22, 5], dtype=torch.int64)
        rt.submit(keys)
        step = rt.next_step()
        assert torch.equal(step.keys, keys)
        want = torch.cat([loaded[[3, 3, 22]], ref["a"][[5], :4]])
        assert torch.equal(step.rows.detach()[step.inverse], want)
        rt.finish_step(step, torch.zeros_like(step.rows.detach()))  # at the table lr, 0.1
        rt.flush()
        assert torch.equal(io.read_rows("b", 0, 23), loaded)
        rows, inverse = rt.eval_rows(keys)
        assert torch.equal(rows[inverse], want)
    finally:
        for rt in runtimes:
            rt.close()
    return "ok"


def test_table_io_reads_and_writes_ranges_like_a_plain_tensor():
    assert run_world(_table_io_worker, 1, args=(30,), timeout=300) == ["ok"]
