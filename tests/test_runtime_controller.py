"""BagPipeController end to end: W simulated ranks, an in-process PS, random traces.

The PS is the real one (PSShard + PSClient over the local transport, 1-3 shards, every
partitioner) or the exact numpy reference PS (with commits applied asynchronously late); in
both cases the plain synchronous reference (`reference_run_with_state`: no cache, no PS) is
the oracle, for every optimizer (SGD, Adagrad, row-wise Adagrad, Adam) under a learning-rate
schedule that changes every few steps.

The property test checks the coherence invariants (docs/ARCHITECTURE.md §1) on every example:
  1 freshness: every row a forward reads is bitwise the PS's value after the previous step;
  final PS rows and optimizer state equal the reference (bitwise); after the last step every
  rank's cached rows and their cached optimizer state equal the PS's (bitwise);
  2 capacity: resident rows never exceed the cache;
  3 unique destinations: every scatter into the cache writes distinct slots;
  4 dependency gating: a prefetch is issued only once its dependency committed (the truth
    is read from the PS at the moment of the call) and with the true dependency steps;
  7 accounting: hits + demand + prefetch-served = accesses = sum of unique keys.
"""

from __future__ import annotations

import threading
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from runtime_ps_backends import local_backend

from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.ps.optimizer_spec import OptimizerSpec, adam_step_size
from torchrec_bagpipe.runtime import controller as controller_mod
from torchrec_bagpipe.runtime.access_plans import PlanMismatchError
from torchrec_bagpipe.runtime.collectives import ThreadGroup
from torchrec_bagpipe.runtime.controller import BagPipeController, ControllerError
from torchrec_bagpipe.runtime.device_cache import DeviceCache
from torchrec_bagpipe.testing.reference_ps import ReferencePS
from torchrec_bagpipe.testing.simulate import reference_run_with_state, simulate

DIM = 3
LR = 0.05
OPTIMIZERS = {
    "sgd": OptimizerSpec(),
    "sgd_wd": OptimizerSpec(weight_decay=0.01),
    "adagrad": OptimizerSpec(kind="adagrad", eps=1e-3, initial_accumulator_value=0.1),
    "rowwise_adagrad": OptimizerSpec(kind="rowwise_adagrad", eps=1e-8),
    "adam": OptimizerSpec(kind="adam", beta1=0.9, beta2=0.99, eps=1e-6),
}


def schedule(spec: OptimizerSpec, every: int = 3, base: float = LR):
    """An LR schedule that changes every `every` steps (a warm-up from 0, then decay), as the
    learning rate each step's commit carries: for Adam the bias-corrected step size."""
    def lr(t: int) -> float:
        phase = t // every
        value = base * (0.0 if phase == 0 else 1.0 if phase == 1 else 0.5 ** (phase - 1))
        if spec.kind == "adam":
            return adam_step_size(value, spec.beta1, spec.beta2, t + 1)
        return value
    return lr


def make_trace(seed: int, world: int, steps: int, universe: int, max_batch: int, skew: float):
    """Skewed ids over a small universe, hot ids scattered by a permutation."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(universe)
    trace = []
    for _ in range(steps):
        per_rank = []
        for _ in range(world):
            n = int(rng.integers(0, max_batch + 1))
            ranks = np.floor(universe * rng.random(n) ** skew).astype(np.int64)
            per_rank.append(perm[ranks].astype(np.int64))
        trace.append(per_rank)
    return trace


def true_deps(trace, t: int, keys: np.ndarray) -> np.ndarray:
    out = np.full(keys.size, -1, dtype=np.int64)
    for i, k in enumerate(keys.tolist()):
        for s in range(t - 1, -1, -1):
            if any(k in set(per.tolist()) for per in trace[s]):
                out[i] = s
                break
    return out


class CheckingDeviceCache(DeviceCache):
    """DeviceCache that asserts unique, in-range scatter destinations (invariant 3)."""

    def fill(self, slots, rows):
        _check_slots(self, slots)
        super().fill(slots, rows)

    def apply_gradients_(self, slots, grads, grad_rows=None, *, lr):
        _check_slots(self, slots)
        super().apply_gradients_(slots, grads, grad_rows, lr=lr)


def _check_slots(cache: DeviceCache, slots) -> None:
    s = np.asarray(slots)
    assert np.unique(s).size == s.size, "a scatter wrote one slot twice"
    assert s.size == 0 or (s.min() >= 0 and s.max() < cache.capacity_rows)


@st.composite
def scenarios(draw):
    world = draw(st.integers(1, 4))
    universe = draw(st.sampled_from([12, 40, 150, 400]))
    steps = draw(st.integers(1, 14))
    max_batch = draw(st.sampled_from([6, 30, 90]))  # 90 ids > a one-unit (64-row) cache
    skew = draw(st.sampled_from([1.0, 2.0, 4.0]))
    seed = draw(st.integers(0, 2**32 - 1))
    read_mode = draw(st.sampled_from(["bagpipe"] * 5 + ["ps"]))
    policy = draw(st.sampled_from(["oracle", "lru"]))
    lookahead = draw(st.integers(0, 8))
    # The adaptive window (oracle only): up to 10 batches past the fixed part.
    adaptive = policy == "oracle" and draw(st.integers(0, 2)) == 0
    lookahead_max = lookahead + draw(st.integers(1, 10)) if adaptive else 0
    cfg = BagPipeConfig(
        read_mode=read_mode,
        optimization_prescan=draw(st.booleans()),
        optimization_cache_capacity=draw(st.sampled_from([1, 1, 2, 4, 16])),
        bagpipe_aggregation=draw(st.sampled_from(
            ["ps", "collective"] + (["writeback"] if read_mode == "bagpipe" else []))),
        lookahead=lookahead,
        lookahead_max=lookahead_max,
        eviction_policy=policy,
        prepared_batches=draw(st.integers(1, 3)),
        prepare_ahead=draw(st.booleans()),
        gradient_division=draw(st.booleans()),
        ps_timeout=30.0,
    )
    if draw(st.integers(0, 3)) == 0:
        backend = ("reference", draw(st.sampled_from([0.0, 0.001])))
    else:
        backend = ("local", draw(st.integers(1, 3)),
                   draw(st.sampled_from(["modulo", "hash", "fast_range"])))
    spec = OPTIMIZERS[draw(st.sampled_from(sorted(OPTIMIZERS)))]
    every = draw(st.integers(1, 4))
    trace = make_trace(seed, world, steps, universe, max_batch, skew)
    return cfg, trace, universe, backend, spec, schedule(spec, every)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(np.ascontiguousarray(a).view(np.uint32),
                                                 np.ascontiguousarray(b).view(np.uint32))


def run_checked(cfg: BagPipeConfig, trace, universe: int, backend=("reference", 0.0),
                optimizer: OptimizerSpec = OPTIMIZERS["sgd"], lr=LR, submit_ahead: int = 0):
    init = np.random.default_rng(5).uniform(-1, 1, (universe, DIM)).astype(np.float32)
    violations: list[str] = []
    lock = threading.Lock()
    box: dict = {}
    cap_rows = cfg.cache_rows(universe)
    writeback = cfg.bagpipe_aggregation == "writeback"

    def observer(rank, kind, keys, deps, uses, at_step):
        committed = box["ps"].committed_step() if "ps" in box else -1
        with lock:
            if kind == "prefetch" and at_step > committed:
                violations.append(f"prefetch at step {at_step} while committed {committed}")
            for u in np.unique(uses):
                m = uses == u
                want = true_deps(trace, int(u), keys[m])
                # writeback: a row written back is read after its write-back's step, later
                # than its last training step; never earlier.
                ok = (np.all(deps[m] >= want) if writeback
                      else np.array_equal(want, deps[m]))
                if not ok:
                    violations.append(f"{kind} of step {u} with wrong deps")
            if deps.size and at_step != deps.max():
                violations.append("at_step is not the largest dependency")

    def step_hook(rank, ctl):
        # The adaptive window keeps probed plans only for steps past its end.
        kept = [s for s in ctl._prefetch._probed if s <= ctl._prefetch.entered]
        if kept:
            with lock:
                violations.append(f"probed plans of entered steps kept: {kept[:5]}")
        if ctl._meta is not None:
            st_ = ctl._meta.stats()
            if st_["resident"] > cap_rows or st_["stale"] != 0:
                with lock:
                    violations.append(f"capacity/stale violated: {st_}")

    orig_init = ReferencePS.__init__

    def capture_init(self, *a, **k):
        orig_init(self, *a, **k)
        box["ps"] = self

    factory = None
    delay = 0.0
    if backend[0] == "local":
        make = local_backend(backend[1], backend[2])

        def factory(*a, **k):
            box["ps"] = make(*a, **k)
            return box["ps"]
    else:
        delay = backend[1]
    with mock.patch.object(controller_mod, "DeviceCache", CheckingDeviceCache), \
            mock.patch.object(ReferencePS, "__init__", capture_init):
        res = simulate(cfg, trace, num_keys=universe, dim=DIM, lr=lr, init=init,
                       record_reads=True, timeout=30.0, ps_apply_delay=delay,
                       observer=observer, step_hook=step_hook, backend=factory,
                       optimizer=optimizer, submit_ahead=submit_ahead)
    assert not violations, violations[:5]
    divide = cfg.resolved_gradient_division()
    ref, ref_state = reference_run_with_state(trace, init=init, lr=lr, divide=divide,
                                              reads=res.reads, optimizer=optimizer)
    assert same_bits(ref, res.final), "final PS rows != reference"
    assert same_bits(ref_state, res.final_state), "final PS optimizer state != reference"
    # Every rank's cache: each resident row, weights and state, is bitwise the PS's.
    ps_rows = np.concatenate([res.final, res.final_state], axis=1)
    for r, (keys, cached) in enumerate(res.cached):
        assert keys.size == res.metrics[r]["resident_rows"]
        assert same_bits(cached, ps_rows[keys]), f"rank {r}: cached rows/state != the PS's"
    for r, m in enumerate(res.metrics):
        # writeback: every rank's step reads the union of the ranks' keys.
        accesses = sum(np.unique(np.concatenate(trace[t]) if writeback else trace[t][r]).size
                       for t in range(len(trace)))
        assert m["accesses"] == accesses
        assert m["hits"] + m["demand_fetched"] + m["prefetch_served"] == m["accesses"]
        assert m["stale"] == 0
        assert m["resident_rows"] <= m["capacity_rows"]
        assert m["committed_step"] == len(trace) - 1
        assert m["steps"] == len(trace)
        if cfg.read_mode == "ps":
            assert m["hits"] == 0 and m["prefetch_served"] == 0
    return res


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_controller_invariants_on_random_traces(scenario) -> None:
    cfg, trace, universe, backend, spec, lr = scenario
    run_checked(cfg, trace, universe, backend, spec, lr)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_cache_decisions_are_deterministic_across_runs_and_modes(scenario) -> None:
    cfg, trace, universe, backend, spec, lr = scenario
    a = run_checked(cfg, trace, universe, backend, spec, lr)
    b = run_checked(cfg.replace(optimization_prescan=not cfg.optimization_prescan), trace,
                    universe, ("reference", 0.001), spec, lr)
    for ma, mb in zip(a.metrics, b.metrics):
        for key in ("accesses", "hits", "evictions", "invalidations", "local_updates",
                    "bypassed", "resident_rows"):
            assert ma[key] == mb[key], key
        assert ma["demand_fetched"] + ma["prefetch_served"] == (
            mb["demand_fetched"] + mb["prefetch_served"]
        )
    assert np.array_equal(a.final.view(np.uint32), b.final.view(np.uint32))
    assert np.array_equal(a.final_state.view(np.uint32), b.final_state.view(np.uint32))


# The matrix of issue 11: every optimizer x {ps, collective} x {prescan, online} x {one-unit
# cache, large cache}, under an LR schedule changing every 3 steps, 24 steps, two ranks, on
# the exact reference PS and on the real PS (two in-process shards).
@pytest.mark.parametrize("backend", [("reference", 0.0), ("local", 2, "hash")],
                         ids=["reference_ps", "real_ps"])
@pytest.mark.parametrize("units", [1, 16], ids=["one_unit", "large"])
@pytest.mark.parametrize("prescan", [True, False], ids=["prescan", "online"])
@pytest.mark.parametrize("aggregation", ["ps", "collective"])
@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_optimizer_matrix_equals_the_single_process_reference(
    name: str, aggregation: str, prescan: bool, units: int, backend
) -> None:
    spec = OPTIMIZERS[name]
    trace = make_trace(7, 2, 24, 120, 70, 2.0)  # 70 ids > a one-unit (64-row) cache
    cfg = BagPipeConfig(bagpipe_aggregation=aggregation, optimization_prescan=prescan,
                        optimization_cache_capacity=units, lookahead=3, ps_timeout=30.0)
    res = run_checked(cfg, trace, 120, backend, spec, schedule(spec, every=3))
    m = res.metrics[0]
    assert m["local_updates"] > 0 and m["hits"] > 0  # the cache's own updates were exercised
    if spec.kind != "sgd":
        assert res.final_state.any()  # and the state moved


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_steps_prepared_while_the_previous_runs_make_the_same_decisions(scenario) -> None:
    """With one more batch submitted (as TorchRec's pipeline does), step t + 1 is prepared on
    the preparer's thread while step t runs: coherent, and every cache decision is the one
    made when each step is prepared at its own next_step."""
    cfg, trace, universe, backend, spec, lr = scenario
    a = run_checked(cfg, trace, universe, backend, spec, lr, submit_ahead=1)
    b = run_checked(cfg, trace, universe, ("reference", 0.001), spec, lr)
    for ma, mb in zip(a.metrics, b.metrics):
        for key in ("accesses", "hits", "evictions", "invalidations", "local_updates",
                    "bypassed", "resident_rows"):
            assert ma[key] == mb[key], key
    assert np.array_equal(a.final.view(np.uint32), b.final.view(np.uint32))
    assert np.array_equal(a.final_state.view(np.uint32), b.final_state.view(np.uint32))


def test_large_skewed_run_prefetches_and_hits() -> None:
    """A longer run where lookahead visibly pays: prefetches serve most misses."""
    trace = make_trace(11, 2, 40, 300, 60, 3.0)
    cfg = BagPipeConfig(optimization_cache_capacity=2, lookahead=4, ps_timeout=30.0)
    res = run_checked(cfg, trace, 300, ("local", 2, "modulo"))
    m = res.metrics[0]
    assert m["prefetched"] > 0 and m["prefetch_served"] > 0 and m["hits"] > 0
    assert m["evictions"] > 0 and m["invalidations"] > 0 and m["local_updates"] > 0
    base = run_checked(cfg.replace(eviction_policy="lru", lookahead=0), trace, 300)
    assert base.metrics[0]["prefetch_served"] == 0
    assert base.metrics[0]["demand_fetched"] > m["demand_fetched"]


def test_collective_mode_splits_s_now_and_s_later() -> None:
    trace = make_trace(3, 3, 12, 80, 20, 2.0)
    cfg = BagPipeConfig(bagpipe_aggregation="collective", optimization_cache_capacity=1,
                        lookahead=3, ps_timeout=30.0)
    res = run_checked(cfg, trace, 80, ("local", 3, "hash"))
    m = res.metrics[0]
    assert m["invalidations"] == 0  # every affected resident row is updated locally
    unions = [np.unique(np.concatenate(per)) for per in trace]
    reduced = sum(u.size for u in unions) * DIM * 4
    assert m["allreduce_payload_bytes"] == reduced
    # Two all-reduces per step where both S_now and S_later are non-empty.
    both = sum(
        1 for t in range(len(trace) - 1)
        if 0 < np.intersect1d(unions[t], unions[t + 1]).size < unions[t].size
    )
    assert both > 0
    # Online exchange: per step a header (the id count) and the distinct ids, as int32.
    ids_sent = sum(np.unique(per[0]).size + 1 for per in trace) * 4
    assert m["id_exchange_bytes"] == ids_sent


# ---- API behaviour and errors ---------------------------------------------------------------
def _single(cfg: BagPipeConfig | None = None, universe: int = 50, world: int = 1, rank: int = 0,
            group: ThreadGroup | None = None, ps: ReferencePS | None = None):
    cfg = cfg or BagPipeConfig(optimization_cache_capacity=1, lookahead=2, ps_timeout=5.0)
    ps = ps or ReferencePS(universe, DIM, world, LR, timeout=5.0)
    group = group or ThreadGroup(world, timeout=2.0)
    ctl = BagPipeController(cfg, rank=rank, world_size=world, dim=DIM, num_keys=universe, lr=LR,
                            ps=ps.client(rank), collectives=group.collectives(rank))
    return ctl, ps


def test_submit_and_step_errors_are_clear() -> None:
    ctl, _ = _single()
    with pytest.raises(ValueError, match=r"key 50 at position 1 is outside \[0, 50\)"):
        ctl.submit(torch.tensor([1, 50]))
    with pytest.raises(TypeError, match=r"torch\.int64"):
        ctl.submit(torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="1-D"):
        ctl.submit(torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="batch 0 has not been submitted"):
        ctl.next_step()
    ctl.submit(torch.tensor([3, 4, 3]))
    step = ctl.next_step()
    assert step.rows.shape == (2, DIM) and step.rows.requires_grad and step.rows.is_leaf
    assert step.unique_keys.tolist() == [3, 4] and step.inverse.tolist() == [0, 1, 0]
    with pytest.raises(ValueError, match="still running"):
        ctl.next_step()
    with pytest.raises(ValueError, match=r"grad must have shape \(2, 3\)"):
        ctl.finish_step(step, torch.zeros(3, DIM))
    with pytest.raises(TypeError, match="float32"):
        ctl.finish_step(step, torch.zeros(2, DIM, dtype=torch.float64))
    ctl.finish_step(step, torch.ones(2, DIM))
    with pytest.raises(ValueError, match="not the step returned by next_step"):
        ctl.finish_step(step, torch.ones(2, DIM))
    ctl.close()
    with pytest.raises(ControllerError, match="closed"):
        ctl.submit(torch.tensor([1]))


def test_constructor_rejects_mismatched_arguments() -> None:
    ps = ReferencePS(10, DIM, 2, LR)
    group = ThreadGroup(2)
    cfg = BagPipeConfig()
    with pytest.raises(ValueError, match="collectives is rank 1 of 2, the controller rank 0"):
        BagPipeController(cfg, rank=0, world_size=2, dim=DIM, num_keys=10, lr=LR,
                          ps=ps.client(0), collectives=group.collectives(1))
    with pytest.raises(ValueError, match="the PS client has dim 3, the controller dim 4"):
        BagPipeController(cfg, rank=0, world_size=2, dim=4, num_keys=10, lr=LR,
                          ps=ps.client(0), collectives=group.collectives(0))
    with pytest.raises(TypeError, match="BagPipeConfig"):
        BagPipeController({}, rank=0, world_size=2, dim=DIM, num_keys=10, lr=LR,  # type: ignore
                          ps=ps.client(0), collectives=group.collectives(0))
    with pytest.raises(ValueError, match="lr must be finite and >= 0"):
        BagPipeController(cfg, rank=0, world_size=2, dim=DIM, num_keys=10, lr=float("nan"),
                          ps=ps.client(0), collectives=group.collectives(0))
    with pytest.raises(ValueError, match="optimizer"):
        BagPipeController(cfg, rank=0, world_size=2, dim=DIM, num_keys=10, lr=LR,
                          ps=ps.client(0), collectives=group.collectives(0), optimizer="adam")


def test_steps_follow_the_start_step_of_the_ps_table() -> None:
    """A session that opens on a table the PS committed up to step k (a resumed job) numbers
    its PS steps after k: controller step t is PS step t + k + 1, reads of step t wait for PS
    step t + k, and the controller reports its own steps (the same run as from step -1)."""
    from torchrec_bagpipe.ps import PSClient, PSShard

    trace = [torch.tensor([1, 2, 1]), torch.tensor([2, 3]), torch.tensor([1, 3])]
    cfg = BagPipeConfig(optimization_cache_capacity=1, lookahead=1, ps_timeout=5.0)
    finals = []
    for start in (-1, 2):
        shard = PSShard()
        spec = {"table": "t", "dim": DIM, "lr": LR, "init": "zeros", "key_bound": 10}
        with PSClient([shard], **spec) as warm:  # the PS already committed steps 0..start
            for t in range(start + 1):
                warm.commit(t, torch.zeros(0, dtype=torch.int64), torch.zeros(0, DIM))
        client = PSClient([shard], **spec, expected_step=start)  # the shard checks it
        assert client.opened_steps == [start]
        group = ThreadGroup(1, timeout=2.0)
        ctl = BagPipeController(cfg, rank=0, world_size=1, dim=DIM, num_keys=10, lr=LR,
                                ps=client, collectives=group.collectives(0), start_step=start)
        seen: list[int] = []
        ctl.fetch_observer = lambda *get, seen=seen: seen.append(get[-1])  # at_step
        for keys in trace[:2]:
            ctl.submit(keys)
        for t in range(len(trace)):
            if t + 1 < len(trace):
                ctl.submit(trace[t + 1])
            step = ctl.next_step()
            ctl.finish_step(step, step.rows.detach() + 1.0)
        ctl.flush()
        assert ctl.metrics()["committed_step"] == len(trace) - 1
        assert shard.committed_step("t") == start + len(trace)
        assert min(seen) == -1  # the observer sees the controller's own steps
        ctl.close()
        finals.append(shard.lookup("t", torch.arange(10)))
        shard.close()
    assert torch.equal(finals[0], finals[1])
    with pytest.raises(ValueError, match="start_step"):
        BagPipeController(cfg, rank=0, world_size=1, dim=DIM, num_keys=10, lr=LR,
                          ps=ReferencePS(10, DIM, 1, LR).client(0),
                          collectives=ThreadGroup(1).collectives(0), start_step=-2)


def test_prescan_mismatch_names_step_and_rank() -> None:
    cfg = BagPipeConfig(optimization_prescan=True, optimization_cache_capacity=1, lookahead=1,
                        ps_timeout=5.0)
    ctl, _ = _single(cfg)
    ctl.prescan([torch.tensor([1, 2]), torch.tensor([2, 3])], progress=False)
    assert ctl.metrics()["prescan_startup_s"] > 0
    ctl.submit(torch.tensor([1, 2]))
    with pytest.raises(PlanMismatchError, match=r"step 1 on rank 0: position 1: id 4"):
        ctl.submit(torch.tensor([2, 4]))
    with pytest.raises(ValueError, match="prescan must be called once"):
        ctl.prescan([torch.tensor([1])])
    ctl.close()


def test_dead_peer_times_out_and_fails_the_controller() -> None:
    group = ThreadGroup(2, timeout=0.5)
    ps = ReferencePS(20, DIM, 2, LR, timeout=1.0)
    cfg = BagPipeConfig(optimization_cache_capacity=1, lookahead=1, ps_timeout=1.0)
    ctl, _ = _single(cfg, universe=20, world=2, group=group, ps=ps)
    ctl.submit(torch.tensor([1, 2]))  # rank 1 never joins the exchange
    with pytest.raises(TimeoutError):
        ctl.next_step()
    with pytest.raises(ControllerError, match="failed earlier"):
        ctl.next_step()
    ctl.close(close_ps=False)


def test_invalidate_all_rereads_external_writes_and_close_drains() -> None:
    ctl, ps = _single(BagPipeConfig(optimization_cache_capacity=1, lookahead=2, ps_timeout=5.0))
    for keys in ([1, 2], [1, 2], [1, 2], [1, 2]):
        ctl.submit(torch.tensor(keys))
    for _ in range(2):
        step = ctl.next_step()
        ctl.finish_step(step, torch.ones(2, DIM))
    assert ctl.metrics()["hits"] == 2
    ctl.flush()
    new = np.full((2, DIM), 7.0, dtype=np.float32)
    ps.assign(np.array([1, 2]), new)
    ctl.invalidate_all()
    step = ctl.next_step()
    assert np.array_equal(step.rows.detach().numpy(), new)
    ctl.finish_step(step, torch.ones(2, DIM))
    step = ctl.next_step()
    ctl.finish_step(step, torch.ones(2, DIM))
    ctl.close()
    assert ps.committed_step() == 3
    assert ps.closed_ranks == {0}
    m = ctl.metrics()
    assert m["shutdown_s"] > 0 and m["committed_step"] == 3
    assert all(isinstance(v, (int, float)) for v in m.values())


def test_invalidate_all_forgets_a_step_prepared_ahead() -> None:
    """Step 2 is prepared ahead (its window is full) with rows 1, 2 as hits; the external
    write and invalidate_all make it prepared again, so it reads the new values."""
    ctl, ps = _single(BagPipeConfig(optimization_cache_capacity=1, lookahead=1, ps_timeout=5.0))
    for _ in range(5):
        ctl.submit(torch.tensor([1, 2]))
    for _ in range(2):
        step = ctl.next_step()
        ctl.finish_step(step, torch.ones(2, DIM))
    assert ctl._preparer.ahead == 2
    with pytest.raises(ValueError, match="step 2 is prepared ahead"):
        ctl.cached_rows()  # its admitted slots are claimed, not yet filled
    ctl.flush()
    new = np.full((2, DIM), 7.0, dtype=np.float32)
    ps.assign(np.array([1, 2]), new)
    ctl.invalidate_all()
    step = ctl.next_step()
    assert np.array_equal(step.rows.detach().numpy(), new)
    ctl.finish_step(step, torch.ones(2, DIM))
    for _ in range(2):
        step = ctl.next_step()
        ctl.finish_step(step, torch.ones(2, DIM))
    ctl.close()
    assert ps.committed_step() == 4
    m = ctl.metrics()
    assert m["hits"] + m["prefetch_served"] + m["demand_fetched"] == m["accesses"] == 10
    assert m["demand_fetched"] >= 4  # steps 0 and 2 read from the PS


def test_metrics_report_every_counter() -> None:
    trace = make_trace(2, 2, 6, 100, 30, 2.0)
    res = simulate(BagPipeConfig(optimization_cache_capacity=1, lookahead=2), trace,
                   num_keys=100, dim=DIM)
    m = res.metrics[1]
    # Time in the runtime: the training thread's and the worker's, per step.
    assert m["runtime_critical_s"] > 0 and m["runtime_worker_s"] >= 0
    assert m["runtime_critical_ms"] == pytest.approx(1e3 * m["runtime_critical_s"] / m["steps"])
    assert m["runtime_worker_ms"] == pytest.approx(1e3 * m["runtime_worker_s"] / m["steps"])
    # The worker threads' CPU time in their tasks is part of those tasks' run time.
    assert 0 <= m["runtime_worker_cpu_s"] <= m["runtime_worker_s"] + 1e-3
    assert 0 < m["runtime_critical_cpu_s"] <= m["runtime_critical_s"] + 1e-3
    assert m["runtime_worker_cpu_ms"] == pytest.approx(
        1e3 * m["runtime_worker_cpu_s"] / m["steps"])
    for key in ("hits", "demand_fetched", "prefetched", "prefetch_served", "evictions",
                "invalidations", "resident_bytes", "skipped_dependency_waits", "commit_wait_s",
                "gradient_payload_bytes", "prescan_startup_s", "shutdown_s", "hit_rate",
                "fetched_bytes", "plan_memory_bytes", "window_steps", "window_mean"):
        assert key in m
    # A fixed window of 2 batches, shorter only where the trace ends (steps 4 and 5).
    assert m["window_steps"] == 2 * 4 + 1 + 0
    assert m["window_mean"] == pytest.approx(m["window_steps"] / m["steps"])
    assert m["resident_bytes"] == 64 * DIM * 4
    sent = sum(np.unique(per[1]).size for per in trace)
    assert m["gradient_payload_bytes"] == sent * (8 + DIM * 4)


def test_oracle_without_lookahead_is_exactly_lru() -> None:
    """Belady where the window knows the future, LRU where it does not: with no window the
    oracle policy makes LRU's decisions, row for row."""
    trace = make_trace(21, 1, 30, 500, 120, 2.0)
    base = BagPipeConfig(optimization_cache_capacity=1, lookahead=0, ps_timeout=30.0)
    lru = run_checked(base.replace(eviction_policy="lru"), trace, 500).metrics[0]
    orc = run_checked(base.replace(eviction_policy="oracle"), trace, 500).metrics[0]
    for key in ("hits", "evictions", "bypassed", "demand_fetched", "resident_rows"):
        assert lru[key] == orc[key], key
    assert lru["evictions"] > 0


def test_adaptive_window_grows_only_under_pressure_and_never_lowers_the_hit_rate() -> None:
    """lookahead_max: with the table in the cache the window stays the fixed one; with a
    one-unit cache under a skewed trace it grows (within its bound) and the cache hits at
    least as often as the fixed window's, with the same PS rows (exact)."""
    trace = make_trace(31, 1, 40, 600, 120, 2.0)
    fixed = BagPipeConfig(optimization_cache_capacity=1, lookahead=2, ps_timeout=30.0)
    adaptive = fixed.replace(lookahead_max=12)
    a = run_checked(adaptive, trace, 600).metrics[0]
    f = run_checked(fixed, trace, 600).metrics[0]
    assert a["window_mean"] > f["window_mean"] + 1
    assert a["window_steps"] <= 12 * a["steps"]
    assert a["hits"] >= f["hits"]
    roomy = run_checked(adaptive.replace(optimization_cache_capacity=16), trace, 600)
    assert roomy.metrics[0]["window_steps"] == f["window_steps"]  # never under pressure


def test_adaptive_window_settings_are_checked() -> None:
    with pytest.raises(ValueError, match=r"lookahead_max \(4\) must be 0 or >= lookahead"):
        BagPipeConfig(lookahead=8, lookahead_max=4)
    with pytest.raises(ValueError, match="needs eviction_policy 'oracle'"):
        BagPipeConfig(eviction_policy="lru", lookahead_max=16)
    with pytest.raises(ValueError, match="lookahead_max must be >= 0"):
        BagPipeConfig(lookahead_max=-1)
    assert BagPipeConfig(lookahead=4, lookahead_max=32).window_batches == 32
    assert BagPipeConfig(lookahead=4).window_batches == 4
    assert BagPipeConfig(read_mode="ps", lookahead=4, lookahead_max=32).window_batches == 0


def test_an_adaptive_window_keeps_collective_splits_the_same_on_every_rank() -> None:
    """Each rank's window grows with its own cache; collective aggregation's S_now split (the
    all-reduces' shapes) follows only the fixed part, which every rank shares (a window of
    0 batches that grows to 1 on some ranks used to split differently and mismatch)."""
    cfg = BagPipeConfig(bagpipe_aggregation="collective", optimization_cache_capacity=1,
                        lookahead=0, lookahead_max=1, ps_timeout=30.0)
    for seed in range(6):
        run_checked(cfg, make_trace(seed, 4, 8, 150, 40, 1.0), 150)
