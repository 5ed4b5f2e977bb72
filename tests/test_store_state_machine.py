"""A Hypothesis state machine drives EmbeddingStore (with a small memory budget, so pages
spill) and a dict model side by side; every read is compared bit for bit."""

from __future__ import annotations

import shutil
import tempfile
import warnings

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from store_reference import reference_initial_rows, sgd_reference

from torchrec_bagpipe.ps import EmbeddingStore

DIM = 4
INIT = {"init": "uniform", "init_bound": [(-(2**40), 0.5), (0, 0.05), (40, 0.01)], "seed": 123}
PAGE_ROWS = 16  # 16 rows of 64 bytes: 1 KiB of rows on a 4 KiB mapping
PAGE_BYTES = 4096
BUDGET = 3 * PAGE_BYTES

keys_st = st.lists(
    st.one_of(st.integers(-8, 70), st.sampled_from([-(2**63), 2**63 - 1, 2**40])),
    min_size=0,
    max_size=40,
)
floats_st = st.floats(-1e3, 1e3, allow_nan=False, width=32)


def rows_st(n: int) -> st.SearchStrategy[np.ndarray]:
    return hnp.arrays(np.float32, (n, DIM), elements=floats_st)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="bagpipe-sm-")
        self.rows: dict[int, np.ndarray] = {}
        self.saved: dict[int, np.ndarray] | None = None
        self.saves = 0

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def _open_kwargs(self) -> dict[str, object]:
        return {
            "num_threads": self.threads,
            "num_shards": self.shards,
            "memory_budget": BUDGET,
            "spill_dir": f"{self.dir}/spill",
            "page_rows": PAGE_ROWS,
        }

    @initialize(threads=st.sampled_from([1, 2]), shards=st.sampled_from([1, 4, 16]))
    def open_store(self, threads: int, shards: int) -> None:
        self.threads, self.shards = threads, shards
        self.store = EmbeddingStore(DIM, **INIT, **self._open_kwargs())

    def initial(self, keys: list[int]) -> np.ndarray:
        return reference_initial_rows(np.array(keys, dtype=np.int64), DIM, **INIT)

    def model_rows(self, keys: list[int]) -> np.ndarray:
        if not keys:
            return np.zeros((0, DIM), dtype=np.float32)
        init = self.initial(keys)
        return np.stack([self.rows.get(k, init[i]) for i, k in enumerate(keys)])

    @rule(keys=keys_st, insert=st.booleans())
    def lookup(self, keys: list[int], insert: bool) -> None:
        want = self.model_rows(keys)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = self.store.lookup(torch.tensor(keys, dtype=torch.int64), insert_missing=insert)
        assert np.array_equal(bits(got.numpy()), bits(want))
        if insert:
            for k, r in zip(keys, want):
                self.rows.setdefault(k, r.copy())

    @rule(data=st.data(), keys=keys_st)
    def assign(self, data: st.DataObject, keys: list[int]) -> None:
        rows = data.draw(rows_st(len(keys)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.store.assign(torch.tensor(keys, dtype=torch.int64), torch.from_numpy(rows))
        for k, r in zip(keys, rows):
            self.rows[k] = r.copy()

    @rule(
        data=st.data(),
        keys=keys_st,
        lr=st.sampled_from([0.01, 0.5, 1.0, 3.0]),
        divisor=st.integers(1, 4),
    )
    def apply_sgd(self, data: st.DataObject, keys: list[int], lr: float, divisor: int) -> None:
        grads = data.draw(rows_st(len(keys)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.store.apply_sgd(
                torch.tensor(keys, dtype=torch.int64), torch.from_numpy(grads), lr, divisor
            )
        groups: dict[int, list[np.ndarray]] = {}
        for k, g in zip(keys, grads):
            groups.setdefault(k, []).append(g)
        for k, gs in groups.items():
            self.rows[k] = sgd_reference(self.model_rows([k])[0], gs, lr, divisor)

    @rule(keys=keys_st)
    def erase(self, keys: list[int]) -> None:
        n = self.store.erase(torch.tensor(keys, dtype=torch.int64))
        expected = sum(1 for k in set(keys) if k in self.rows)
        for k in keys:
            self.rows.pop(k, None)
        assert n == expected

    @rule(keys=keys_st)
    def contains(self, keys: list[int]) -> None:
        got = self.store.contains(torch.tensor(keys, dtype=torch.int64)).tolist()
        assert got == [k in self.rows for k in keys]

    @rule()
    def save(self) -> None:
        self.saves += 1
        self.store.save(f"{self.dir}/ck", meta={"saves": str(self.saves)})
        self.saved = {k: v.copy() for k, v in self.rows.items()}
        self.saved_count = self.saves

    @precondition(lambda self: self.saved is not None)
    @rule(threads=st.sampled_from([1, 2]), shards=st.sampled_from([1, 8]))
    def load(self, threads: int, shards: int) -> None:
        self.threads, self.shards = threads, shards
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.store = EmbeddingStore.load(f"{self.dir}/ck", **self._open_kwargs())
        assert self.store.meta == {"saves": str(self.saved_count)}
        assert self.saved is not None
        self.rows = {k: v.copy() for k, v in self.saved.items()}

    @rule()
    def export_matches(self) -> None:
        seen: dict[int, np.ndarray] = {}
        for k, r in self.store.export(chunk_rows=7):
            for key, row in zip(k.tolist(), r.numpy()):
                assert key not in seen
                seen[key] = row
        assert seen.keys() == self.rows.keys()
        for k, r in seen.items():
            assert np.array_equal(bits(r), bits(self.rows[k]))

    @invariant()
    def size_and_budget(self) -> None:
        if not hasattr(self, "store"):
            return
        assert len(self.store) == len(self.rows)
        s = self.store.stats()
        assert s["bytes_resident"] - s["bytes_maps"] <= BUDGET
        assert s["bytes_spilled"] == s["pages_spilled"] * s["page_bytes"]


StoreMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStoreMachine = StoreMachine.TestCase


def test_spill_really_happens_in_the_machine_setting() -> None:
    """The machine's budget is small enough that its workloads spill (not vacuous)."""
    d = tempfile.mkdtemp(prefix="bagpipe-sm-")
    try:
        s = EmbeddingStore(
            DIM, **INIT, memory_budget=BUDGET, spill_dir=f"{d}/spill", page_rows=PAGE_ROWS
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            s.lookup(torch.arange(-8, 71))
        assert s.stats()["pages_spilled"] > 0
    finally:
        shutil.rmtree(d, ignore_errors=True)
