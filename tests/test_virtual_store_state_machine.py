"""A Hypothesis state machine drives a virtual table's PS side — an EmbeddingStore (one of its
optimizers) whose rows are created by training steps and evicted by the native eviction rule
(`C.EvictionRule`, csrc/cache/eviction_rule.h) at each step boundary — and a dict model with
the pure-Python `ReferenceEvictionRule` side by side, over ids anywhere in [0, 2^50).

Checked bit for bit after every rule: the evicted keys, the rule's counts and last steps, the
store's live rows (exactly the trained, not evicted keys: never-trained ids take no memory),
and every read of rows and optimizer state (an evicted row reads as its initial value and
initial state again, and a later step recreates it from there).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from store_reference import optimizer_reference, reference_initial_rows

from torchrec_bagpipe._native import C
from torchrec_bagpipe.ps import EmbeddingStore, OptimizerSpec
from torchrec_bagpipe.runtime.eviction import EvictionSpec
from torchrec_bagpipe.testing.reference_eviction import ReferenceEvictionRule

DIM = 3
N = 1 << 50
INIT = {"init": "uniform", "init_bound": 0.25, "seed": 7}
HOT = [0, 1, 2, 3, 2**49 + 5, N - 1]
keys_st = st.lists(st.one_of(st.sampled_from(HOT), st.integers(0, 20),
                             st.integers(0, N - 1)), min_size=0, max_size=12)
SPECS = [
    EvictionSpec(),
    EvictionSpec(ttl_steps=1),
    EvictionSpec(ttl_steps=3),
    EvictionSpec(ttl_steps=2, trigger_rows=6),
    EvictionSpec(threshold=1.5, decay_rate=0.9),
    EvictionSpec(threshold=2.5, decay_rate=0.7, trigger_rows=4),
    EvictionSpec(threshold=1.0, decay_rate=0.5, ttl_steps=4),
    EvictionSpec(admit_after=2),
    EvictionSpec(admit_after=3, ttl_steps=2),
    EvictionSpec(admit_probability=0.5, admit_seed=3, ttl_steps=2),
    EvictionSpec(admit_after=2, admit_probability=0.3, admit_seed=(1 << 64) - 1),
    EvictionSpec(max_rows=3),
    EvictionSpec(max_rows=4, threshold=1.0, decay_rate=0.7, trigger_rows=6),
    EvictionSpec(max_rows=2, ttl_steps=3, admit_after=2),
]
OPTIMIZERS = [OptimizerSpec("sgd"), OptimizerSpec("adagrad", eps=1e-6),
              OptimizerSpec("adam", beta1=0.8, beta2=0.99, eps=1e-6)]


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


class VirtualStoreMachine(RuleBasedStateMachine):
    @initialize(spec=st.sampled_from(SPECS), opt=st.sampled_from(OPTIMIZERS),
                shards=st.sampled_from([1, 4]))
    def open(self, spec: EvictionSpec, opt: OptimizerSpec, shards: int) -> None:
        self.spec, self.opt = spec, opt
        self.store = EmbeddingStore(dim=DIM, **INIT, key_bound=N, optimizer=opt,
                                    num_shards=shards)
        self.rule = C.EvictionRule(spec.native())
        self.model = ReferenceEvictionRule(spec)
        self.rows: dict[int, np.ndarray] = {}
        self.state: dict[int, np.ndarray] = {}
        self.step = 0
        self.trained: set[int] = set()

    def _init_state(self) -> np.ndarray:
        return np.full(self.opt.state_dim(DIM), self.opt.initial_state_value, dtype=np.float32)

    def _model(self, keys: list[int]) -> tuple[np.ndarray, np.ndarray]:
        init = reference_initial_rows(np.array(keys, dtype=np.int64), DIM, **INIT)
        rows = np.stack([self.rows.get(k, init[i]) for i, k in enumerate(keys)]) if keys \
            else np.zeros((0, DIM), np.float32)
        state = np.stack([self.state.get(k, self._init_state()) for k in keys]) if keys \
            else np.zeros((0, self.opt.state_dim(DIM)), np.float32)
        return rows, state

    @rule(data=st.data(), keys=keys_st, lr=st.sampled_from([0.05, 0.5]))
    def train_step(self, data: st.DataObject, keys: list[int], lr: float) -> None:
        # Admission first (once per id of the step): only admitted ids are trained.
        verdict = {}
        for k in dict.fromkeys(keys):
            verdict[k] = self.rule.admit(k)
            assert verdict[k] == self.model.admit(k), k
        keys = [k for k in keys if verdict[k]]
        grads = data.draw(hnp.arrays(np.float32, (len(keys), DIM),
                                     elements=st.floats(-10, 10, width=32)))
        if self.opt.kind == "adam":
            from torchrec_bagpipe.ps.optimizer_spec import adam_step_size
            lr = adam_step_size(lr, self.opt.beta1, self.opt.beta2, self.step + 1)
        self.store.apply_gradients(torch.tensor(keys, dtype=torch.int64),
                                   torch.from_numpy(grads), lr)
        groups: dict[int, list[np.ndarray]] = {}
        for k, g in zip(keys, grads):
            groups.setdefault(k, []).append(g)
        for k, gs in groups.items():
            w, s = self._model([k])
            o = self.opt
            self.rows[k], self.state[k] = optimizer_reference(
                w[0], s[0], gs, lr, 1, o.kind, o.eps, o.beta1, o.beta2, o.weight_decay)
        uniq = list(dict.fromkeys(keys))  # first-occurrence order, as the planner's union
        got = self.rule.on_step(self.step, np.array(uniq, dtype=np.int64)).tolist()
        want = self.model.on_step(self.step, uniq)
        assert got == want, (got, want)
        if self.spec.max_rows:  # the cap holds at every boundary (beyond one step's keys)
            assert self.model.live <= max(self.spec.max_rows, len(uniq))
        if got:
            self.store.erase(torch.tensor(got, dtype=torch.int64))
        for k in got:
            del self.rows[k]
            del self.state[k]
        self.trained.update(uniq)
        self.step += 1

    @rule(keys=keys_st, with_state=st.booleans())
    def read(self, keys: list[int], with_state: bool) -> None:
        want, want_state = self._model(keys)
        kt = torch.tensor(keys, dtype=torch.int64)
        if with_state:
            got, got_state = self.store.lookup_with_state(kt, insert_missing=False)
            assert np.array_equal(bits(got_state.numpy()), bits(want_state))
        else:
            got = self.store.lookup(kt, insert_missing=False)
        assert np.array_equal(bits(got.numpy()), bits(want))

    @invariant()
    def live_rows_agree(self) -> None:
        if not hasattr(self, "store"):
            return
        # Without a rule every trained row stays; with one, exactly the rule's live rows.
        live = len(self.rows)
        assert len(self.store) == live
        if self.spec.tracks:
            assert self.rule.live == self.model.live == live
            assert self.rule.evicted == self.model.evicted
            for k, (count, last) in self.model.rows.items():
                assert self.rule.get(k) == (count, last)
        assert set(self.rows) <= self.trained


VirtualStoreMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_virtual_store_state_machine = VirtualStoreMachine.TestCase


def test_the_rule_refuses_bad_options_and_out_of_order_steps() -> None:
    import pytest

    with pytest.raises(ValueError, match="decay_rate"):
        C.EvictionRule({"threshold": 1.0, "decay_rate": 1.5})
    with pytest.raises(ValueError, match="unknown option 'ttl'"):
        C.EvictionRule({"ttl": 3})
    with pytest.raises(ValueError, match="decay_rate"):
        EvictionSpec(decay_rate=0.0)
    r = C.EvictionRule({"ttl_steps": 1})
    r.on_step(3, np.array([1], dtype=np.int64))
    with pytest.raises(ValueError, match="step 3 after step 3"):
        r.on_step(3, np.array([1], dtype=np.int64))


@pytest.mark.parametrize("spec", [EvictionSpec(ttl_steps=1), EvictionSpec(ttl_steps=7),
                                  EvictionSpec(ttl_steps=5, trigger_rows=40),
                                  EvictionSpec(ttl_steps=3, admit_after=2)],
                         ids=["ttl1", "ttl7", "ttl5-trigger", "ttl3-admission"])
def test_step_ttl_rule_without_a_scan_equals_the_reference_over_long_runs(
        spec: EvictionSpec) -> None:
    """The step-TTL rule's touch queue (eviction_rule.h invariant 2: rounds without a scan,
    compactions) decides exactly as the reference, over enough steps to compact often."""
    rng = np.random.default_rng(spec.ttl_steps)
    rule, model = C.EvictionRule(spec.native()), ReferenceEvictionRule(spec)
    for step in range(600):
        hot = rng.integers(0, 30, 8)  # touched again and again: stale touches pile up
        cold = rng.integers(0, 2000, int(rng.integers(0, 40)))
        keys = list(dict.fromkeys(int(k) for k in np.concatenate([hot, cold])))
        admitted = []
        for k in keys:
            verdict = bool(rule.admit(k))
            assert verdict == model.admit(k), (step, k)
            if verdict:
                admitted.append(k)
        got = rule.on_step(step, np.array(admitted, dtype=np.int64)).tolist()
        assert got == model.on_step(step, admitted), step
        assert rule.live == model.live
    assert rule.evicted == model.evicted > 0
