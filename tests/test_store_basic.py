"""EmbeddingStore batch operations against a dict model, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from store_reference import reference_initial_rows, sgd_reference

from torchrec_bagpipe.ps import EmbeddingStore, OptimizerSpec


class DictModel:
    def __init__(self, dim: int, **init: object) -> None:
        self.dim = dim
        self.init = init
        self.rows: dict[int, np.ndarray] = {}

    def initial(self, key: int) -> np.ndarray:
        return reference_initial_rows(np.array([key]), self.dim, **self.init)[0]

    def get(self, key: int) -> np.ndarray:
        return self.rows[key] if key in self.rows else self.initial(key)

    def lookup(self, keys: list[int], insert: bool) -> np.ndarray:
        out = np.stack([self.get(k) for k in keys]) if keys else np.zeros((0, self.dim))
        if insert:
            for k in keys:
                self.rows.setdefault(k, self.initial(k))
        return out

    def assign(self, keys: list[int], rows: np.ndarray) -> None:
        for k, r in zip(keys, rows):
            self.rows[k] = r.copy()

    def apply_sgd(self, keys: list[int], grads: np.ndarray, lr: float, div: int) -> None:
        groups: dict[int, list[np.ndarray]] = {}
        for k, g in zip(keys, grads):
            groups.setdefault(k, []).append(g)
        for k, gs in groups.items():
            self.rows[k] = sgd_reference(self.get(k), gs, lr, div)

    def erase(self, keys: list[int]) -> int:
        n = 0
        for k in dict.fromkeys(keys):
            if k in self.rows:
                del self.rows[k]
                n += 1
        return n


def _bits(t: torch.Tensor | np.ndarray) -> np.ndarray:
    a = t.numpy() if isinstance(t, torch.Tensor) else t
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


INIT = {"init": "uniform", "init_bound": 0.05, "seed": 7}


def test_initial_rows_match_numpy_reference() -> None:
    keys = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 123456789, 5, 5], dtype=torch.int64)
    for spec in (
        {"init": "uniform", "init_bound": 0.25, "seed": 3},
        {"init": "uniform", "init_bound": [(0, 0.5), (100, 0.01), (10**12, 2.0)], "seed": 1},
        {"init": "zeros"},
        {"init": "constant", "init_value": -1.5},
    ):
        got = EmbeddingStore.initial_rows(keys, dim=33, **spec)
        want = reference_initial_rows(keys.numpy(), 33, **spec)
        assert np.array_equal(_bits(got), _bits(want)), spec


def test_uniform_values_are_in_range_and_spread() -> None:
    keys = torch.arange(2000)
    rows = EmbeddingStore.initial_rows(keys, dim=16, init_bound=0.5, seed=11)
    assert float(rows.min()) >= -0.5 and float(rows.max()) < 0.5
    assert abs(float(rows.mean())) < 0.01
    assert rows.std().item() == pytest.approx(0.5 / 3**0.5, rel=0.02)


def test_default_bound_is_torchrec_sqrt_one_over_n() -> None:
    s = EmbeddingStore(dim=4, key_bound=400)
    got = s.lookup(torch.arange(10), insert_missing=False)
    want = reference_initial_rows(np.arange(10), 4, init_bound=float(np.sqrt(1 / 400)))
    assert np.array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("threads,shards", [(1, 1), (2, 16), (2, 4)])
def test_random_ops_match_dict_model(threads: int, shards: int) -> None:
    dim = 8
    rng = np.random.default_rng(threads * 100 + shards)
    store = EmbeddingStore(dim=dim, num_threads=threads, num_shards=shards, page_rows=16, **INIT)
    model = DictModel(dim, **INIT)
    for _ in range(60):
        op = rng.integers(0, 5)
        n = int(rng.integers(0, 700))
        keys = rng.integers(-50, 400, n).tolist()
        kt = torch.tensor(keys, dtype=torch.int64)
        if op == 0:
            insert = bool(rng.integers(0, 2))
            got = store.lookup(kt, insert_missing=insert)
            assert np.array_equal(_bits(got), _bits(model.lookup(keys, insert)))
        elif op == 1:
            rows = rng.standard_normal((n, dim)).astype(np.float32)
            store.assign(kt, torch.from_numpy(rows))
            model.assign(keys, rows)
        elif op == 2:
            grads = rng.standard_normal((n, dim)).astype(np.float32)
            lr, div = float(rng.choice([0.1, 0.37, 1.0])), int(rng.integers(1, 4))
            store.apply_sgd(kt, torch.from_numpy(grads), lr, div)
            model.apply_sgd(keys, grads, lr, div)
        elif op == 3:
            assert store.erase(kt) == model.erase(keys)
        else:
            got = store.contains(kt)
            assert got.dtype == torch.bool
            assert got.tolist() == [k in model.rows for k in keys]
        assert len(store) == len(model.rows)
    exported = {}
    for ek, er in store.export(chunk_rows=37):
        for k, r in zip(ek.tolist(), er.numpy()):
            assert k not in exported
            exported[k] = r
    assert exported.keys() == model.rows.keys()
    for k, r in exported.items():
        assert np.array_equal(_bits(r), _bits(model.rows[k]))


def test_results_identical_across_threads_and_shards() -> None:
    def run(threads: int, shards: int) -> bytes:
        s = EmbeddingStore(dim=16, num_threads=threads, num_shards=shards, page_rows=64, **INIT)
        g = torch.Generator().manual_seed(0)
        for step in range(30):
            k = torch.randint(0, 3000, (2048,), generator=g)
            s.apply_sgd(k, torch.randn(2048, 16, generator=g), 0.1, 3)
            if step % 7 == 0:
                s.erase(torch.randint(0, 3000, (300,), generator=g))
            s.assign(torch.randint(0, 3000, (100,), generator=g), torch.randn(100, 16, generator=g))
        return s.lookup(torch.arange(3000), insert_missing=False).numpy().tobytes()

    ref = run(1, 16)
    for threads, shards in [(2, 16), (2, 1), (1, 4), (2, 256)]:
        assert run(threads, shards) == ref


def test_lookup_into_out_and_duplicates() -> None:
    s = EmbeddingStore(dim=4, **INIT)
    keys = torch.tensor([3, 3, 9, 3])
    out = torch.full((4, 4), 7.0)
    r = s.lookup(keys, out=out)
    assert r is out
    assert torch.equal(out[0], out[1]) and torch.equal(out[0], out[3])
    assert len(s) == 2
    assert s.stats()["lookups"] == 4


def test_lookup_without_insert_is_pure() -> None:
    s = EmbeddingStore(dim=4, **INIT)
    s.lookup(torch.arange(10), insert_missing=False)
    assert len(s) == 0
    assert not s.contains(torch.arange(10)).any()


def test_erase_then_reinsert_gets_initial_value() -> None:
    s = EmbeddingStore(dim=4, **INIT)
    k = torch.tensor([5])
    first = s.lookup(k).clone()
    s.apply_sgd(k, torch.ones(1, 4), 1.0)
    assert not torch.equal(s.lookup(k), first)
    assert s.erase(torch.tensor([5, 5, 6])) == 1
    assert torch.equal(s.lookup(k), first)


def test_reserve_keeps_contents() -> None:
    s = EmbeddingStore(dim=4, num_shards=4, **INIT)
    keys = torch.arange(1000)
    rows = torch.randn(1000, 4)
    s.assign(keys, rows)
    s.reserve(100_000)
    assert torch.equal(s.lookup(keys), rows)
    assert s.stats()["bytes_maps"] >= 100_000 * 16 / 0.7 * 0.9


@pytest.mark.parametrize(
    "spec,state_dim",
    [("sgd", 0), ("adagrad", 6), ("rowwise_adagrad", 1), (OptimizerSpec("adam"), 12)],
)
def test_state_api_lookup_assign_export_and_initial_state(
    spec: OptimizerSpec | str, state_dim: int
) -> None:
    s = EmbeddingStore(dim=6, **INIT, optimizer=spec)
    assert s.state_dim == state_dim and s.options()["optimizer"] == OptimizerSpec.of(spec)
    assert s.stats()["state_dim"] == state_dim
    init_state = EmbeddingStore.initial_state(3, 6, spec)
    assert init_state.shape == (3, state_dim)
    assert torch.equal(init_state, s.optimizer.initial_state(3, 6))
    # Unwritten rows read as the initial row and state, with or without inserting them.
    keys = torch.tensor([4, 9, 4])
    w, st = s.lookup_with_state(keys, insert_missing=False)
    assert torch.equal(w, EmbeddingStore.initial_rows(keys, dim=6, **INIT))
    assert torch.equal(st, init_state) and len(s) == 0
    out, state_out = torch.empty(3, 6), torch.empty(3, state_dim)
    w2, st2 = s.lookup_with_state(keys, out=out, state_out=state_out)
    assert w2 is out and st2 is state_out and torch.equal(out, w) and len(s) == 2
    # Assign with state sets both (last duplicate wins); without, stored rows keep theirs.
    rows, state = torch.randn(3, 6), torch.rand(3, state_dim)
    s.assign(keys, rows, state)
    w, st = s.lookup_with_state(torch.tensor([4, 9]))
    assert torch.equal(w, rows[[2, 1]]) and torch.equal(st, state[[2, 1]])
    s.assign(torch.tensor([9, 11]), torch.ones(2, 6))
    w, st = s.lookup_with_state(torch.tensor([9, 11]))
    assert torch.equal(w, torch.ones(2, 6))
    assert torch.equal(st[0], state[1]) and torch.equal(st[1], init_state[0])
    # Export with state: every stored row once, with its state.
    seen = {}
    for k, r, x in s.export(chunk_rows=2, with_state=True):
        assert r.shape[1] == 6 and x.shape[1] == state_dim
        seen.update({key: (row, sx) for key, row, sx in zip(k.tolist(), r, x)})
    assert sorted(seen) == [4, 9, 11]
    assert torch.equal(seen[4][1], state[2]) and torch.equal(seen[11][1], init_state[0])
    assert all(len(chunk) == 2 for chunk in s.export(chunk_rows=2))


def test_bytes_per_row_count_the_state() -> None:
    per_row = {}
    for kind in ("sgd", "adagrad", "rowwise_adagrad", "adam"):
        s = EmbeddingStore(dim=32, **INIT, optimizer=kind, page_rows=1024)
        s.lookup(torch.arange(4096))
        st = s.stats()
        per_row[kind] = (st["bytes_resident"] - st["bytes_maps"]) / st["rows"]
        assert st["slot_bytes"] == per_row[kind]  # full pages: the arena is slots only
    assert per_row == {"sgd": 128, "adagrad": 256, "rowwise_adagrad": 132, "adam": 384}
