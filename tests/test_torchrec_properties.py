"""Hypothesis: a BagPipe-sharded EBC computes exactly what TorchRec's unsharded EBC computes.

Random tables (dims, sizes, features shared by several tables, sum and mean pooling,
weighted or not), each placed on BagPipe or on TorchRec's table-wise fused kernel in the
same EBC, and random KJTs (extra keys in any order, multi-hot and empty bags): the sharded
forward equals the unsharded forward (keys in the unsharded order), one backward + fused SGD
step equals SGD on the unsharded weights, the state dict has the unsharded keys in order,
and an eval forward afterwards sees the updated rows. Runs in one
spawned rank (world size 1: the PS shard is hosted in that process), many examples per
process.
"""

from __future__ import annotations

import pytest
from _dist import run_world

pytestmark = pytest.mark.slow

FEATURES = ["f0", "f1", "f2", "f3"]


def _property_worker(rank: int, world: int, max_examples: int) -> str:
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import table_wise
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_bagpipe.config import BagPipeConfig
    from torchrec_bagpipe.distributed import (
        BagPipeEmbeddingBagCollectionSharder,
        bagpipe_plan,
        close_model,
    )

    lr = 0.3

    @st.composite
    def model_and_batch(draw):
        weighted = draw(st.booleans())
        n_tables = draw(st.integers(1, 4))
        tables = []
        for t in range(n_tables):
            feats = draw(st.lists(st.sampled_from(FEATURES), min_size=1, max_size=3,
                                  unique=True))
            mean = (not weighted) and draw(st.booleans())
            tables.append(EmbeddingBagConfig(
                name=f"t{t}", embedding_dim=draw(st.sampled_from([1, 2, 4, 8])),
                num_embeddings=draw(st.integers(1, 70)), feature_names=feats,
                pooling=PoolingType.MEAN if mean else PoolingType.SUM,
            ))
        used = sorted({f for t in tables for f in t.feature_names})
        extra = draw(st.lists(st.sampled_from(["x0", "x1"]), unique=True, max_size=2))
        keys = draw(st.permutations(used + extra))
        batch = draw(st.integers(1, 5))
        bound = {f: min(t.num_embeddings for t in tables if f in t.feature_names)
                 for f in used}
        lengths, values = [], []
        for k in keys:
            for _ in range(batch):
                n = draw(st.integers(0, 4))
                lengths.append(n)
                values += draw(st.lists(st.integers(0, bound.get(k, 1000) - 1),
                                        min_size=n, max_size=n))
        weights = draw(st.lists(st.floats(0.25, 2.0, width=32), min_size=len(values),
                                max_size=len(values))) if weighted else None
        config = BagPipeConfig(
            optimization_cache_capacity=draw(st.sampled_from([1, 4])),
            bagpipe_aggregation=draw(st.sampled_from(["ps", "collective"])),
        )
        # Each table on BagPipe or stock (table-wise, fused: dims divisible by 4, as
        # fbgemm's kernels need); at least one on BagPipe.
        eligible = [t.name for t in tables if t.embedding_dim % 4 == 0]
        stock = draw(st.lists(st.sampled_from(eligible), unique=True,
                              max_size=min(len(eligible), len(tables) - 1))) if eligible else []
        return tables, weighted, keys, lengths, values, weights, config, stock

    @settings(max_examples=max_examples, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(model_and_batch(), st.integers(0, 2**31 - 1))
    def prop(spec, seed):
        tables, weighted, keys, lengths, values, weights, config, stock = spec
        torch.manual_seed(seed)
        ebc = EmbeddingBagCollection(tables=tables, is_weighted=weighted)
        initial = {k: v.detach().clone() for k, v in ebc.state_dict().items()}
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=list(keys), values=torch.tensor(values, dtype=torch.int64),
            lengths=torch.tensor(lengths, dtype=torch.int32),
            weights=torch.tensor(weights, dtype=torch.float32) if weighted else None,
        )
        want = ebc(kjt)
        upstream = torch.randn_like(want.values())

        sharder = BagPipeEmbeddingBagCollectionSharder(
            config, {"learning_rate": lr, "optimizer": EmbOptimType.EXACT_SGD})
        model = EmbeddingBagCollection(tables=tables, is_weighted=weighted)
        model.load_state_dict(initial)
        plan = bagpipe_plan(model, world, stock={
            name: table_wise(rank=0, compute_kernel="fused") for name in stock})
        dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan,
                                       sharders=[sharder])
        dmp.load_state_dict(initial)  # TorchRec's CPU kernels start from their own init
        try:
            got = dmp(kjt).wait()  # the sharded module's output is a LazyAwaitable
            assert got.keys() == want.keys(), (got.keys(), want.keys())
            assert got.length_per_key() == want.length_per_key()
            torch.testing.assert_close(got.values(), want.values(), rtol=1e-6, atol=1e-6)
            (got.values() * upstream).sum().backward()
            dmp.fused_optimizer.step()

            (want.values() * upstream).sum().backward()
            with torch.no_grad():
                for p in ebc.parameters():
                    if p.grad is not None:
                        p -= lr * p.grad
            after = dmp.state_dict()
            assert list(after) == list(ebc.state_dict()), (list(after), stock)
            for k, v in ebc.state_dict().items():
                got_v = after[k]
                if isinstance(got_v, ShardedTensor):  # one shard in world 1 (stock or BagPipe)
                    got_v = got_v.local_shards()[0].tensor
                torch.testing.assert_close(got_v, v, rtol=1e-6, atol=1e-6, msg=k)
            # Eval forwards read the updated rows straight from the PS.
            dmp.eval()
            with torch.no_grad():
                evaluated = dmp(kjt).wait()
                torch.testing.assert_close(evaluated.values(), ebc(kjt).values(),
                                           rtol=1e-6, atol=1e-6)
        finally:
            close_model(dmp)

    prop()

    # A batch that is not the one the pipeline submitted ahead is refused.
    tables = [EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=10,
                                 feature_names=["f0"])]
    model = EmbeddingBagCollection(tables=tables)
    dmp = DistributedModelParallel(
        model, device=torch.device("cpu"), plan=bagpipe_plan(model, world),
        sharders=[BagPipeEmbeddingBagCollectionSharder(fused_params={"learning_rate": lr})],
    )
    module = dmp.module
    a = KeyedJaggedTensor.from_lengths_sync(["f0"], torch.tensor([1, 2]), torch.tensor([1, 1]))
    b = KeyedJaggedTensor.from_lengths_sync(["f0"], torch.tensor([1, 3]), torch.tensor([1, 1]))
    same_as_a = KeyedJaggedTensor.from_lengths_sync(["f0"], torch.tensor([1, 2]),
                                                    torch.tensor([1, 1]))
    module.presubmit(a)
    module.presubmit(a)
    dmp(same_as_a).wait().values().sum().backward()  # equal contents: accepted
    try:
        dmp(b)
    except RuntimeError as e:
        assert "submitted ahead" in str(e), e
    else:
        raise AssertionError("a batch other than the presubmitted one was accepted")
    close_model(dmp)
    return "ok"


def test_sharded_ebc_matches_torchrec_ebc_forward_and_sgd():
    assert run_world(_property_worker, 1, args=(40,), timeout=600) == ["ok"]
