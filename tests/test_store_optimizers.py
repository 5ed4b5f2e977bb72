"""The store's optimizers against the arithmetic contract of csrc/store/embedding_store.h.

* Hypothesis properties: every kernel, bit for bit, against a numpy reference that runs the
  contract one float32 op at a time (duplicates, zero, negative-zero and subnormal gradients,
  weight decay, every kernel width), for any thread and shard count; NaN / inf rows stay in
  their row; the state survives spilling and checkpoints.
* `row_update` (the torch-ops form a trainer cache runs) equals the store bit for bit.
* Over a few steps, each optimizer agrees within fp32 tolerance with the textbook one
  (torch.optim.SGD / Adagrad / SparseAdam, a float64 row-wise Adagrad).
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
from collections import defaultdict

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from store_reference import optimizer_reference, reference_initial_rows, same_bits_or_both_nan

from torchrec_bagpipe.ps import EmbeddingStore, OptimizerSpec
from torchrec_bagpipe.ps.optimizer_spec import adam_step_size
from torchrec_bagpipe.runtime.row_update import row_update, sqrt32

KINDS = ["sgd", "adagrad", "rowwise_adagrad", "adam"]
INIT = {"init": "uniform", "init_bound": 0.5, "seed": 17}
DIMS = [1, 3, 4, 16, 17, 32, 33, 64, 100, 128]  # fixed-width kernels and the generic one

SPECIAL = [0.0, -0.0, 1e-45, -1e-45, 3e-39, -1.1754942106924411e-38, 1e-20, 1e20, -1e20, 7.0]
grad_elements = st.one_of(
    st.floats(-10.0, 10.0, width=32),
    st.sampled_from(SPECIAL),
    st.floats(-1.1754942106924411e-38, 1.1754942106924411e-38, width=32),
)


def spec_st(kind: str) -> st.SearchStrategy[OptimizerSpec]:
    return st.builds(
        OptimizerSpec,
        kind=st.just(kind),
        eps=st.sampled_from([0.0, 1e-10, 1e-8, 1e-3, 0.5]),
        beta1=st.sampled_from([0.0, 0.5, 0.9]),
        beta2=st.sampled_from([0.9, 0.999, 0.99999]),
        weight_decay=st.sampled_from([0.0, 0.0, 1e-4, 0.5]),
        initial_accumulator_value=st.sampled_from([0.0, 0.1, 1e-42]),
    )


class Model:
    """Dict model: stored (row, state) per key; absent keys read as initial row and state."""

    def __init__(self, dim: int, spec: OptimizerSpec) -> None:
        self.dim, self.spec = dim, spec
        self.rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def get(self, key: int) -> tuple[np.ndarray, np.ndarray]:
        if key in self.rows:
            return self.rows[key]
        w = reference_initial_rows(np.array([key]), self.dim, **INIT)[0]
        s = np.full(self.spec.state_dim(self.dim), self.spec.initial_state_value, np.float32)
        return w, s

    def apply(self, keys: list[int], grads: np.ndarray, lr: float, divisor: int) -> None:
        groups: dict[int, list[np.ndarray]] = defaultdict(list)
        for k, g in zip(keys, grads):
            groups[k].append(g)
        sp = self.spec
        for k, gs in groups.items():
            w, s = self.get(k)
            self.rows[k] = optimizer_reference(
                w, s, gs, lr, divisor, sp.kind, sp.eps, sp.beta1, sp.beta2, sp.weight_decay
            )

    def read(self, keys: list[int]) -> tuple[np.ndarray, np.ndarray]:
        pairs = [self.get(k) for k in keys]
        sd = self.spec.state_dim(self.dim)
        w = np.stack([p[0] for p in pairs]) if pairs else np.zeros((0, self.dim), np.float32)
        s = np.stack([p[1] for p in pairs]) if pairs else np.zeros((0, sd), np.float32)
        return w, s


def step_lr(spec: OptimizerSpec, lr: float, step: int) -> float:
    return adam_step_size(lr, spec.beta1, spec.beta2, step) if spec.kind == "adam" else lr


def check_store_equals_model(store: EmbeddingStore, model: Model, keys: list[int]) -> None:
    got_w, got_s = store.lookup_with_state(
        torch.tensor(keys, dtype=torch.int64), insert_missing=False
    )
    want_w, want_s = model.read(keys)
    assert same_bits_or_both_nan(got_w.numpy(), want_w)
    assert same_bits_or_both_nan(got_s.numpy(), want_s)


# ---- the kernels against the numpy reference --------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_kernel_matches_numpy_reference_bitwise(kind: str, data: st.DataObject) -> None:
    dim = data.draw(st.sampled_from(DIMS), label="dim")
    spec = data.draw(spec_st(kind), label="spec")
    threads = data.draw(st.sampled_from([1, 2]), label="threads")
    shards = data.draw(st.sampled_from([1, 4, 16]), label="shards")
    store = EmbeddingStore(dim=dim, **INIT, optimizer=spec, num_threads=threads, num_shards=shards)
    model = Model(dim, spec)
    for step in range(1, data.draw(st.integers(1, 4), label="steps") + 1):
        keys = data.draw(st.lists(st.integers(0, 12), max_size=30), label="keys")
        grads = data.draw(hnp.arrays(np.float32, (len(keys), dim), elements=grad_elements))
        lr = step_lr(spec, data.draw(st.sampled_from([1e-30, 0.01, 0.5, 3.7])), step)
        divisor = data.draw(st.sampled_from([1, 1, 2, 3, 7]), label="divisor")
        store.apply_gradients(
            torch.tensor(keys, dtype=torch.int64), torch.from_numpy(grads), lr, divisor
        )
        model.apply(keys, grads, lr, divisor)
    check_store_equals_model(store, model, list(range(-1, 14)))


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_nan_and_inf_rows_stay_in_their_rows(kind: str, data: st.DataObject) -> None:
    dim = data.draw(st.sampled_from([4, 32, 33]))
    spec = data.draw(spec_st(kind))
    keys = data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=25))
    grads = data.draw(hnp.arrays(np.float32, (len(keys), dim), elements=grad_elements))
    poisoned = data.draw(st.sets(st.sampled_from(sorted(set(keys))), min_size=1))
    for i, k in enumerate(keys):
        if k in poisoned and data.draw(st.booleans()):
            grads[i, data.draw(st.integers(0, dim - 1))] = data.draw(
                st.sampled_from([np.nan, np.inf, -np.inf])
            )
    store = EmbeddingStore(dim=dim, **INIT, optimizer=spec, num_threads=2)
    clean = EmbeddingStore(dim=dim, **INIT, optimizer=spec)
    model = Model(dim, spec)
    lr = step_lr(spec, 0.1, 1)
    store.apply_gradients(torch.tensor(keys), torch.from_numpy(grads), lr, 2)
    model.apply(keys, grads, lr, 2)
    # Every row follows the arithmetic (NaN where the reference has NaN)...
    check_store_equals_model(store, model, list(range(10)))
    # ...and the rows of clean keys are exactly those of a store that never saw the others.
    mask = np.array([k not in poisoned for k in keys])
    ok_keys = [k for k in keys if k not in poisoned]
    clean.apply_gradients(
        torch.tensor(ok_keys, dtype=torch.int64), torch.from_numpy(grads[mask]), lr, 2
    )
    probe = torch.tensor(sorted(set(range(10)) - poisoned), dtype=torch.int64)
    a = store.lookup_with_state(probe, insert_missing=False)
    b = clean.lookup_with_state(probe, insert_missing=False)
    assert np.array_equal(a[0].numpy().view(np.uint32), b[0].numpy().view(np.uint32))
    assert np.array_equal(a[1].numpy().view(np.uint32), b[1].numpy().view(np.uint32))


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_state_round_trips_through_spill_and_checkpoint(kind: str, data: st.DataObject) -> None:
    dim = data.draw(st.sampled_from([4, 16, 33]))
    spec = data.draw(spec_st(kind))
    tmp = tempfile.mkdtemp(prefix="bagpipe-opt-")
    try:
        spill = {"memory_budget": 3 * 4096, "spill_dir": f"{tmp}/spill", "page_rows": 16}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            store = EmbeddingStore(dim=dim, **INIT, optimizer=spec, **spill)
            model = Model(dim, spec)
            rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
            steps = data.draw(st.integers(2, 6))
            save_at = data.draw(st.integers(1, steps - 1))
            for step in range(1, steps + 1):
                keys = rng.integers(0, 300, int(rng.integers(1, 400))).tolist()
                grads = rng.standard_normal((len(keys), dim)).astype(np.float32)
                lr = step_lr(spec, 0.05, step)
                store.apply_gradients(torch.tensor(keys), torch.from_numpy(grads), lr, 1)
                model.apply(keys, grads, lr, 1)
                if step == save_at:
                    store.save(f"{tmp}/ck", meta={"step": str(step)})
                    store = EmbeddingStore.load(
                        f"{tmp}/ck",
                        optimizer=spec,
                        num_shards=data.draw(st.sampled_from([1, 8])),
                        num_threads=data.draw(st.sampled_from([1, 2])),
                        **spill,
                    )
            assert store.stats()["pages_spilled"] > 0
            check_store_equals_model(store, model, list(range(300)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("kind", KINDS)
def test_bitwise_independent_of_threads_and_shards(kind: str) -> None:
    spec = OptimizerSpec(kind, weight_decay=1e-3, initial_accumulator_value=0.1)

    def run(threads: int, shards: int) -> tuple[bytes, bytes]:
        s = EmbeddingStore(
            dim=16, num_threads=threads, num_shards=shards, page_rows=64, **INIT, optimizer=spec
        )
        g = torch.Generator().manual_seed(0)
        for step in range(1, 16):
            k = torch.randint(0, 3000, (2048,), generator=g)
            s.apply_gradients(k, torch.randn(2048, 16, generator=g), step_lr(spec, 0.1, step), 3)
            if step % 7 == 0:
                s.erase(torch.randint(0, 3000, (300,), generator=g))
        w, st_ = s.lookup_with_state(torch.arange(3000), insert_missing=False)
        return w.numpy().tobytes(), st_.numpy().tobytes()

    ref = run(1, 16)
    for threads, shards in [(2, 16), (2, 1), (1, 4), (2, 256)]:
        assert run(threads, shards) == ref


# ---- the torch-ops form -------------------------------------------------------------------

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dim", [1, 7, 32, 128])
def test_row_update_equals_the_store_bitwise(device: str, kind: str, dim: int) -> None:
    spec = OptimizerSpec(
        kind, eps=1e-6, beta1=0.8, beta2=0.99, weight_decay=0.01, initial_accumulator_value=0.05
    )
    store = EmbeddingStore(dim=dim, **INIT, optimizer=spec, num_threads=2)
    rng = np.random.default_rng(dim)
    keys = torch.arange(500)
    w, s = store.lookup_with_state(keys, insert_missing=False)
    w, s = w.to(device), s.to(device)
    for step in range(1, 9):
        # One row per key (the caller sums duplicates); magnitudes from 1e-40 to 1e20.
        g = rng.standard_normal((500, dim)).astype(np.float32)
        g *= np.float32(10.0) ** rng.integers(-40, 20, (500, 1)).astype(np.float32)
        g[rng.random((500, dim)) < 0.1] = 0.0
        lr = step_lr(spec, 0.3, step)
        divisor = [1, 2, 3][step % 3]
        store.apply_gradients(keys, torch.from_numpy(g), lr, divisor)
        w, s = row_update(w, s, torch.from_numpy(g).to(device), lr, divisor, spec)
    want_w, want_s = store.lookup_with_state(keys, insert_missing=False)
    assert same_bits_or_both_nan(w.cpu().numpy(), want_w.numpy())
    assert same_bits_or_both_nan(s.cpu().numpy(), want_s.numpy())


@pytest.mark.parametrize("device", DEVICES)
def test_sqrt32_is_the_ieee_square_root(device: str) -> None:
    """torch's own float32 sqrt is not correctly rounded on CPU; sqrt32 is (numpy's is)."""
    rng = np.random.default_rng(5)
    bits = rng.integers(0, 0x7F800001, 1_000_000, dtype=np.uint32)  # +0 .. +inf, subnormals
    x = bits.view(np.float32)
    got = sqrt32(torch.from_numpy(x).to(device)).cpu().numpy()
    assert np.array_equal(got.view(np.uint32), np.sqrt(x).view(np.uint32))


def test_row_update_leaves_inputs_alone_and_checks_shapes() -> None:
    spec = OptimizerSpec("adam")
    w, s, g = torch.ones(3, 4), torch.zeros(3, 8), torch.ones(3, 4)
    w2, s2 = row_update(w, s, g, 0.1, 1, spec)
    assert torch.equal(w, torch.ones(3, 4)) and torch.equal(s, torch.zeros(3, 8))
    assert not torch.equal(w2, w) and s2.shape == (3, 8)
    with pytest.raises(ValueError, match="shapes"):
        row_update(w, torch.zeros(3, 4), g, 0.1, 1, spec)
    with pytest.raises(ValueError, match="divisor"):
        row_update(w, s, g, 0.1, 0, spec)
    with pytest.raises(TypeError, match="float32"):
        row_update(w.double(), s, g, 0.1, 1, spec)


# ---- against the textbook optimizers, within fp32 tolerance ----------------------------------


def _store_and_table(kind: str, dim: int, rows: int, **spec_kw: float):
    spec = OptimizerSpec(kind, **spec_kw)
    store = EmbeddingStore(dim=dim, **INIT, optimizer=spec)
    w0 = store.lookup(torch.arange(rows))
    return spec, store, w0


def _batches(
    rows: int, dim: int, steps: int, all_rows: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        keys = torch.randint(0, rows, (64,), generator=g)
        if all_rows:
            keys = torch.cat([torch.arange(rows), keys])
        out.append((keys, torch.randn(keys.numel(), dim, generator=g)))
    return out


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_sgd_matches_torch_sgd(weight_decay: float) -> None:
    _, store, w0 = _store_and_table("sgd", 8, 50, weight_decay=weight_decay)
    emb = torch.nn.Embedding.from_pretrained(w0.clone(), freeze=False)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1, weight_decay=weight_decay)
    for keys, grads in _batches(50, 8, 6, all_rows=weight_decay != 0.0):
        store.apply_gradients(keys, grads, 0.1)
        opt.zero_grad()
        (emb(keys) * grads).sum().backward()
        opt.step()
    torch.testing.assert_close(
        store.lookup(torch.arange(50)), emb.weight.detach(), rtol=1e-5, atol=1e-6
    )


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_adagrad_matches_torch_adagrad(weight_decay: float) -> None:
    kw = {"eps": 1e-10, "initial_accumulator_value": 0.1, "weight_decay": weight_decay}
    _, store, w0 = _store_and_table("adagrad", 8, 50, **kw)
    sparse = weight_decay == 0.0  # torch's sparse Adagrad has no weight decay: dense then
    emb = torch.nn.Embedding.from_pretrained(w0.clone(), freeze=False, sparse=sparse)
    opt = torch.optim.Adagrad(emb.parameters(), lr=0.2, **kw)
    for keys, grads in _batches(50, 8, 6, all_rows=not sparse):
        store.apply_gradients(keys, grads, 0.2)
        opt.zero_grad()
        (emb(keys) * grads).sum().backward()
        opt.step()
    w, s = store.lookup_with_state(torch.arange(50))
    torch.testing.assert_close(w, emb.weight.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s, opt.state[emb.weight]["sum"].to_dense(), rtol=1e-5, atol=1e-6)


def test_rowwise_adagrad_matches_float64_textbook() -> None:
    rows, dim, lr, eps = 50, 8, 0.2, 1e-8
    _, store, w0 = _store_and_table("rowwise_adagrad", dim, rows, eps=eps)
    w = w0.double().numpy().copy()
    acc = np.zeros(rows)
    for keys, grads in _batches(rows, dim, 6, all_rows=False):
        store.apply_gradients(keys, grads, lr)
        g = np.zeros((rows, dim))
        np.add.at(g, keys.numpy(), grads.double().numpy())
        present = np.unique(keys.numpy())
        acc[present] += (g[present] ** 2).mean(axis=1)  # fbgemm EXACT_ROWWISE_ADAGRAD
        w[present] -= lr * g[present] / (np.sqrt(acc[present])[:, None] + eps)
    got_w, got_s = store.lookup_with_state(torch.arange(rows))
    np.testing.assert_allclose(got_w.numpy(), w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_s.numpy()[:, 0], acc, rtol=1e-5)


def test_adam_matches_torch_sparse_adam() -> None:
    rows, dim, lr, betas, eps = 50, 8, 0.05, (0.9, 0.99), 1e-8
    _, store, w0 = _store_and_table("adam", dim, rows, beta1=betas[0], beta2=betas[1], eps=eps)
    emb = torch.nn.Embedding.from_pretrained(w0.clone(), freeze=False, sparse=True)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=lr, betas=betas, eps=eps)
    for step, (keys, grads) in enumerate(_batches(rows, dim, 8, all_rows=False), start=1):
        store.apply_gradients(keys, grads, adam_step_size(lr, betas[0], betas[1], step))
        opt.zero_grad()
        (emb(keys) * grads).sum().backward()
        opt.step()
    w, s = store.lookup_with_state(torch.arange(rows))
    torch.testing.assert_close(w, emb.weight.detach(), rtol=1e-5, atol=1e-6)
    state = opt.state[emb.weight]
    torch.testing.assert_close(s[:, :dim], state["exp_avg"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(s[:, dim:], state["exp_avg_sq"], rtol=1e-5, atol=1e-7)
