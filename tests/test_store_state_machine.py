"""A Hypothesis state machine drives EmbeddingStore (with a small memory budget, so pages
spill, and one of its optimizers) and a dict model side by side; every read of rows and
optimizer state is compared bit for bit."""

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
from store_reference import optimizer_reference, reference_initial_rows, sgd_reference

from torchrec_bagpipe.ps import EmbeddingStore, OptimizerSpec
from torchrec_bagpipe.ps.optimizer_spec import adam_step_size

DIM = 4
INIT = {"init": "uniform", "init_bound": [(-(2**40), 0.5), (0, 0.05), (40, 0.01)], "seed": 123}
PAGE_ROWS = 16  # 16 rows of 64 bytes: 1 KiB of rows on a 4 KiB mapping
PAGE_BYTES = 4096
BUDGET = 3 * PAGE_BYTES
OPTIMIZERS = [
    OptimizerSpec("sgd"),
    OptimizerSpec("sgd", weight_decay=0.01),
    OptimizerSpec("adagrad", eps=1e-6, initial_accumulator_value=0.1),
    OptimizerSpec("rowwise_adagrad", weight_decay=0.001),
    OptimizerSpec("adam", beta1=0.8, beta2=0.99, eps=1e-6),
]

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
        self.state: dict[int, np.ndarray] = {}  # optimizer state of the stored rows
        self.saved: dict[int, np.ndarray] | None = None
        self.saved_state: dict[int, np.ndarray] = {}
        self.saves = 0
        self.steps = 0

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

    @initialize(
        threads=st.sampled_from([1, 2]),
        shards=st.sampled_from([1, 4, 16]),
        spec=st.sampled_from(OPTIMIZERS),
    )
    def open_store(self, threads: int, shards: int, spec: OptimizerSpec) -> None:
        self.threads, self.shards, self.spec = threads, shards, spec
        self.state_dim = spec.state_dim(DIM)
        self.store = EmbeddingStore(dim=DIM, **INIT, **self._open_kwargs(), optimizer=spec)

    def initial_state(self) -> np.ndarray:
        return np.full(self.state_dim, self.spec.initial_state_value, dtype=np.float32)

    def model_state(self, keys: list[int]) -> np.ndarray:
        if not keys:
            return np.zeros((0, self.state_dim), dtype=np.float32)
        return np.stack([self.state.get(k, self.initial_state()) for k in keys])

    def initial(self, keys: list[int]) -> np.ndarray:
        return reference_initial_rows(np.array(keys, dtype=np.int64), DIM, **INIT)

    def model_rows(self, keys: list[int]) -> np.ndarray:
        if not keys:
            return np.zeros((0, DIM), dtype=np.float32)
        init = self.initial(keys)
        return np.stack([self.rows.get(k, init[i]) for i, k in enumerate(keys)])

    @rule(keys=keys_st, insert=st.booleans(), with_state=st.booleans())
    def lookup(self, keys: list[int], insert: bool, with_state: bool) -> None:
        want, want_state = self.model_rows(keys), self.model_state(keys)
        kt = torch.tensor(keys, dtype=torch.int64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if with_state:
                got, got_state = self.store.lookup_with_state(kt, insert_missing=insert)
                assert np.array_equal(bits(got_state.numpy()), bits(want_state))
            else:
                got = self.store.lookup(kt, insert_missing=insert)
        assert np.array_equal(bits(got.numpy()), bits(want))
        if insert:
            for k, r in zip(keys, want):
                self.rows.setdefault(k, r.copy())
                self.state.setdefault(k, self.initial_state())

    @rule(data=st.data(), keys=keys_st, with_state=st.booleans())
    def assign(self, data: st.DataObject, keys: list[int], with_state: bool) -> None:
        rows = data.draw(rows_st(len(keys)))
        state = None
        if with_state:
            state = data.draw(
                hnp.arrays(np.float32, (len(keys), self.state_dim), elements=floats_st)
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.store.assign(
                torch.tensor(keys, dtype=torch.int64),
                torch.from_numpy(rows),
                None if state is None else torch.from_numpy(state),
            )
        for i, (k, r) in enumerate(zip(keys, rows)):
            self.rows[k] = r.copy()
            if state is not None:
                self.state[k] = state[i].copy()
            else:
                self.state.setdefault(k, self.initial_state())

    @rule(
        data=st.data(),
        keys=keys_st,
        lr=st.sampled_from([0.01, 0.5, 1.0, 3.0]),
        divisor=st.integers(1, 4),
    )
    def apply_gradients(
        self, data: st.DataObject, keys: list[int], lr: float, divisor: int
    ) -> None:
        grads = data.draw(rows_st(len(keys)))
        sp = self.spec
        if sp.kind == "adam":
            self.steps += 1
            lr = adam_step_size(lr, sp.beta1, sp.beta2, self.steps)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.store.apply_gradients(
                torch.tensor(keys, dtype=torch.int64), torch.from_numpy(grads), lr, divisor
            )
        groups: dict[int, list[np.ndarray]] = {}
        for k, g in zip(keys, grads):
            groups.setdefault(k, []).append(g)
        for k, gs in groups.items():
            w, s = optimizer_reference(
                self.model_rows([k])[0], self.model_state([k])[0], gs, lr, divisor, sp.kind,
                sp.eps, sp.beta1, sp.beta2, sp.weight_decay,
            )
            self.rows[k], self.state[k] = w, s

    @precondition(lambda self: self.spec.kind == "sgd" and self.spec.weight_decay == 0.0)
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
            self.state[k] = self.initial_state()

    @rule(keys=keys_st)
    def erase(self, keys: list[int]) -> None:
        n = self.store.erase(torch.tensor(keys, dtype=torch.int64))
        expected = sum(1 for k in set(keys) if k in self.rows)
        for k in keys:
            self.rows.pop(k, None)
            self.state.pop(k, None)
        assert n == expected

    @rule(keys=keys_st)
    def contains(self, keys: list[int]) -> None:
        got = self.store.contains(torch.tensor(keys, dtype=torch.int64)).tolist()
        assert got == [k in self.rows for k in keys]

    @rule(weights_only=st.booleans())
    def save(self, weights_only: bool) -> None:
        self.saves += 1
        meta = {"saves": str(self.saves)}
        self.store.save(f"{self.dir}/ck", meta=meta, weights_only=weights_only)
        self.saved = {k: v.copy() for k, v in self.rows.items()}
        # A weights-only checkpoint loads with every row at the initial state.
        self.saved_state = {
            k: self.initial_state() if weights_only else v.copy() for k, v in self.state.items()
        }
        self.saved_count = self.saves

    @precondition(lambda self: self.saved is not None)
    @rule(threads=st.sampled_from([1, 2]), shards=st.sampled_from([1, 8]))
    def load(self, threads: int, shards: int) -> None:
        self.threads, self.shards = threads, shards
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.store = EmbeddingStore.load(f"{self.dir}/ck", **self._open_kwargs())
        assert self.store.meta == {"saves": str(self.saved_count)}
        assert self.store.optimizer == self.spec
        assert self.saved is not None
        self.rows = {k: v.copy() for k, v in self.saved.items()}
        self.state = {k: v.copy() for k, v in self.saved_state.items()}

    @rule()
    def export_matches(self) -> None:
        seen: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for k, r, x in self.store.export(chunk_rows=7, with_state=True):
            for key, row, state in zip(k.tolist(), r.numpy(), x.numpy()):
                assert key not in seen
                seen[key] = (row, state)
        assert seen.keys() == self.rows.keys()
        for k, (r, x) in seen.items():
            assert np.array_equal(bits(r), bits(self.rows[k]))
            assert np.array_equal(bits(x), bits(self.state[k]))

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
            dim=DIM, **INIT, memory_budget=BUDGET, spill_dir=f"{d}/spill", page_rows=PAGE_ROWS
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            s.lookup(torch.arange(-8, 71))
        assert s.stats()["pages_spilled"] > 0
    finally:
        shutil.rmtree(d, ignore_errors=True)
