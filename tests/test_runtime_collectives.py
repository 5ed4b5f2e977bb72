"""ThreadCollectives (W ranks as threads) and the DeviceCache's bitwise optimizer updates."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrec_bagpipe.ps import EmbeddingStore
from torchrec_bagpipe.ps.optimizer_spec import OptimizerSpec
from torchrec_bagpipe.runtime.collectives import (
    CollectiveAborted,
    Collectives,
    ThreadCollectives,
    ThreadGroup,
)
from torchrec_bagpipe.runtime.device_cache import DeviceCache
from torchrec_bagpipe.testing.reference_ps import reference_optimizer_step, reference_sgd_step

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def run_ranks(world: int, fn, timeout: float = 5.0):
    group = ThreadGroup(world, timeout=timeout)
    results: list = [None] * world
    errors: list = [None] * world

    def main(r: int) -> None:
        try:
            results[r] = fn(group.collectives(r))
        except BaseException as e:
            errors[r] = e
            group.abort(e)

    threads = [threading.Thread(target=main, args=(r,)) for r in range(world)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout * 3)
    return results, errors


def test_thread_collectives_satisfy_the_protocol() -> None:
    assert isinstance(ThreadGroup(2).collectives(1), Collectives)


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 4), st.integers(0, 2**31))
def test_all_gather_and_rank_order_all_reduce(world: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    payloads = [torch.from_numpy(rng.integers(0, 100, int(rng.integers(0, 6)))) for _ in
                range(world)]
    values = [torch.from_numpy(rng.standard_normal((3, 2)).astype(np.float32)) for _ in
              range(world)]

    def fn(c: ThreadCollectives):
        got = c.all_gather(payloads[c.rank])
        t = values[c.rank].clone()
        c.all_reduce_sum_(t)
        c.barrier()
        return got, t

    results, errors = run_ranks(world, fn)
    assert errors == [None] * world
    want = values[0].clone()
    for v in values[1:]:
        want += v  # rank order, rank 0 copied
    for got, t in results:
        assert [g.tolist() for g in got] == [p.tolist() for p in payloads]
        assert torch.equal(t.view(torch.int32), want.view(torch.int32))


def test_mismatched_calls_and_shapes_fail_every_rank() -> None:
    def fn(c: ThreadCollectives):
        if c.rank == 0:
            c.barrier()
        else:
            c.all_gather(torch.zeros(1, dtype=torch.int64))

    _, errors = run_ranks(2, fn)
    assert all(isinstance(e, RuntimeError) for e in errors)
    assert any("mismatch" in str(e) for e in errors)

    def shapes(c: ThreadCollectives):
        c.all_reduce_sum_(torch.zeros(c.rank + 1))

    _, errors = run_ranks(2, shapes)
    assert all(isinstance(e, ValueError) and "rank 1 sent (2,)" in str(e) for e in errors)


def test_dead_peer_times_out_naming_the_missing_rank() -> None:
    group = ThreadGroup(3, timeout=0.3)
    errors = []

    def main(r: int) -> None:
        try:
            group.collectives(r).barrier()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=main, args=(r,)) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(5)
    assert len(errors) == 2
    assert all(isinstance(e, TimeoutError) and "ranks [2]" in str(e) for e in errors)


def test_abort_wakes_waiting_ranks() -> None:
    group = ThreadGroup(2, timeout=30)
    box: list[BaseException] = []

    def wait() -> None:
        try:
            group.collectives(0).barrier()
        except CollectiveAborted as e:
            box.append(e)

    th = threading.Thread(target=wait)
    th.start()
    group.abort("rank 1 crashed")
    th.join(5)
    assert not th.is_alive() and box
    with pytest.raises(CollectiveAborted, match="rank 1 crashed"):
        group.collectives(1).barrier()
    with pytest.raises(ValueError, match="rank must lie"):
        group.collectives(2)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), world=st.integers(1, 5), divide=st.booleans(),
       lr=st.sampled_from([0.1, 0.01, 1.0 / 3.0, 2.5e-3]))
def test_device_cache_sgd_is_bitwise_the_ps_arithmetic(device, seed, world, divide, lr) -> None:
    """DeviceCache.apply_gradients_ == the numpy reference == EmbeddingStore.apply_sgd,
    bit for bit."""
    rng = np.random.default_rng(seed)
    n, dim = 37, 5
    w = (rng.standard_normal((n, dim)) * 10.0 ** rng.integers(-3, 3)).astype(np.float32)
    g = (rng.standard_normal((n, dim)) * 10.0 ** rng.integers(-4, 4)).astype(np.float32)
    cache = DeviceCache(64, dim, device, world_size=world, divide=divide)
    slots = rng.permutation(64)[:n]
    cache.fill(slots, torch.from_numpy(w))
    cache.apply_gradients_(slots, torch.from_numpy(g), lr=lr)
    ref = w.copy()
    reference_sgd_step(ref, [np.arange(n)], [g], lr, world, divide)
    got = cache.gather(slots).cpu().numpy()
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    # The same update from rows picked out of a larger buffer (collective aggregation's
    # path: `grad_rows`, updated in a gathered copy).
    perm = rng.permutation(n + 3)
    big = rng.standard_normal((n + 3, dim)).astype(np.float32)
    big[perm[:n]] = g
    picked = DeviceCache(64, dim, device, world_size=world, divide=divide)
    picked.fill(slots, torch.from_numpy(w))
    picked.apply_gradients_(slots, torch.from_numpy(big), perm[:n], lr=lr)
    assert np.array_equal(picked.gather(slots).cpu().numpy().view(np.uint32),
                          ref.view(np.uint32))
    # ... and what the PS's native store computes.
    store = EmbeddingStore(dim=dim, init="zeros")
    keys = torch.arange(n)
    store.assign(keys, torch.from_numpy(w))
    store.apply_sgd(keys, torch.from_numpy(g), lr, world if divide else 1)
    ps_rows = store.lookup(keys).numpy()
    assert np.array_equal(got.view(np.uint32), ps_rows.view(np.uint32))


def test_device_cache_gather_fill_and_errors() -> None:
    cache = DeviceCache(64, 2, "cpu", world_size=2, divide=True)
    rows = torch.arange(6, dtype=torch.float32).view(3, 2)
    cache.fill(np.array([5, 1, 9]), rows)
    assert torch.equal(cache.gather(np.array([9, 5])), rows[[2, 0]])
    out = torch.empty(2, 2)
    assert cache.gather(np.array([1, 9]), out=out) is out and torch.equal(out, rows[[1, 2]])
    assert cache.resident_bytes == 64 * 2 * 4
    # apply_gradients_ never writes into the caller's gradient (no division when W == 1 or
    # when it is off).
    for world, divide in ((1, True), (2, False), (2, True)):
        c = DeviceCache(4, 2, "cpu", world_size=world, divide=divide)
        g = torch.ones(1, 2)
        c.apply_gradients_(np.array([3]), g, lr=0.5)
        assert torch.equal(g, torch.ones(1, 2))
        assert torch.equal(c.gather(np.array([3])), torch.full((1, 2), -0.25 if world == 2 and
                                                                divide else -0.5))
    with pytest.raises(ValueError, match="dim must be >= 1"):
        DeviceCache(64, 0, "cpu", world_size=1, divide=True)


@st.composite
def optimizer_specs(draw) -> OptimizerSpec:
    kind = draw(st.sampled_from(["sgd", "adagrad", "rowwise_adagrad", "adam"]))
    return OptimizerSpec(
        kind=kind,
        eps=draw(st.sampled_from([1e-8, 1e-3, 0.5])),
        beta1=draw(st.sampled_from([0.9, 0.0, 0.5])),
        beta2=draw(st.sampled_from([0.999, 0.9])),
        weight_decay=draw(st.sampled_from([0.0, 0.0, 1e-2])),
        initial_accumulator_value=draw(st.sampled_from([0.0, 0.1])),
    )


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), world=st.integers(1, 4), divide=st.booleans(),
       dim=st.sampled_from([1, 3, 8, 13]), spec=optimizer_specs(),
       lr=st.sampled_from([0.0, 0.1, 1.0 / 3.0, 2.5e-3, 7.0]))
def test_device_cache_optimizers_are_bitwise_the_store(device, seed, world, divide, dim, spec,
                                                       lr) -> None:
    """Weights and optimizer state after DeviceCache.apply_gradients_ == EmbeddingStore's
    apply_gradients == the numpy reference, bit for bit, from stored (not initial) state."""
    rng = np.random.default_rng(seed)
    n = 29
    sd = spec.state_dim(dim)
    w = (rng.standard_normal((n, dim)) * 10.0 ** rng.integers(-3, 3)).astype(np.float32)
    g = (rng.standard_normal((n, dim)) * 10.0 ** rng.integers(-4, 4)).astype(np.float32)
    g[rng.random((n, dim)) < 0.1] = 0.0  # zero gradients too
    state = (rng.random((n, sd)) * 10.0 ** rng.integers(-4, 1)).astype(np.float32)
    if spec.kind == "adam":  # first moments may be negative
        state[:, :dim] -= np.float32(0.5) * state[:, :dim].max(initial=0)
    cache = DeviceCache(64, dim, device, world_size=world, divide=divide, optimizer=spec)
    assert cache.width == dim + sd
    slots = rng.permutation(64)[:n]
    cache.fill(slots, torch.from_numpy(np.concatenate([w, state], axis=1)))
    cache.apply_gradients_(slots, torch.from_numpy(g), lr=lr)
    got = cache.gather(slots).cpu().numpy()
    # The numpy reference.
    ref_w, ref_s = w.copy(), state.copy()
    reference_optimizer_step(ref_w, ref_s, [np.arange(n)], [g], lr, world, divide, spec)
    assert np.array_equal(got.view(np.uint32),
                          np.concatenate([ref_w, ref_s], axis=1).view(np.uint32))
    # The PS's native store.
    store = EmbeddingStore(dim=dim, init="zeros", optimizer=spec)
    keys = torch.arange(n)
    store.assign(keys, torch.from_numpy(w), torch.from_numpy(state))
    store.apply_gradients(keys, torch.from_numpy(g), lr, world if divide else 1)
    ps_w, ps_s = store.lookup_with_state(keys)
    assert np.array_equal(got.view(np.uint32),
                          torch.cat([ps_w, ps_s], dim=1).numpy().view(np.uint32))


def test_device_cache_counts_its_optimizer_state() -> None:
    for kind, width in (("sgd", 4), ("adagrad", 8), ("rowwise_adagrad", 5), ("adam", 12)):
        cache = DeviceCache(64, 4, "cpu", world_size=2, divide=True,
                            optimizer=OptimizerSpec(kind=kind))
        assert cache.width == width and cache.gather(np.array([1])).shape == (1, width)
        assert cache.resident_bytes == 64 * width * 4
    with pytest.raises(TypeError, match="OptimizerSpec"):
        DeviceCache(64, 4, "cpu", world_size=1, divide=True, optimizer="adam")  # type: ignore
