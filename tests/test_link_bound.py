"""benchmarks/link_bound.py at tiny size: the bound arithmetic against hand-computed counters,
the JSON lines' schema (fake runs through `report`), the shaped-host commands it asks tc for,
and the example's flags it relies on (``--zipf_drift``, ``--emulated_compute_ms``), the
latter end to end on one stock rank. No wall-clock asserts, nothing needs root."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from collections.abc import Iterator
from contextlib import redirect_stdout
from typing import Any

import pytest
import torch
from criteo_files import loader

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import link_bound as lb  # noqa: E402  (needs benchmarks/ on sys.path)
import link_shaping as ls  # noqa: E402

# test_link_shaping loads its own link_shaping and patches it into e2e_dlrm: leave it a
# fresh import of the benchmark modules (ours keep the objects bound above).
for _name in ("link_bound", "link_shaping", "e2e_dlrm", "dlrm_ranks"):
    sys.modules.pop(_name, None)

from torchrec_bagpipe.datasets import PowerLawCriteoDataset  # noqa: E402


def test_gpu_step_and_link_rate_follow_the_anchor():
    assert lb.gpu_step_s(7000) == pytest.approx(3.9e-3)
    assert lb.gpu_step_s(2048) == pytest.approx(3.9e-3 * 2048 / 7000)
    # A step here 100x the GPU's: the link is 100x slower than 25 GbE.
    rate = ls.link_rate(25.0, 1e3 * lb.gpu_step_s(2048), 100 * lb.gpu_step_s(2048))
    assert rate == pytest.approx(25e9 / 8 / 100)
    with pytest.raises(ValueError):
        lb.gpu_step_s(0)


def test_dense_params_count_both_arches():
    # 13 -> 4 -> 2 dense; 3 tables + dense = 4 features: 2 + 6 pairs = 8 -> 3 -> 1 over.
    assert lb.dense_params(2, [4, 2], [3, 1], tables=3) == (13 * 4 + 4) + (4 * 2 + 2) + \
        (8 * 3 + 3) + (3 * 1 + 1)


def test_stock_trainer_bytes_by_sharding_type():
    b, d, w = 10, 4, 2
    # table-wise: half the global batch's ids (8 + 4 bytes) and pooled rows leave, twice.
    tw = lb.stock_trainer_bytes({"t": "ShardingType.TABLE_WISE"}, {"t": 100}, b, d, w)
    assert tw == w * b * 0.5 * 12 + 2 * (w * b * 0.5 * d * 4)
    rw = lb.stock_trainer_bytes({"t": "row_wise"}, {"t": 100}, b, d, w)
    assert rw == w * b * 0.5 * 12 + 2 * w * (w * b * 0.5 * d * 4)
    dp = lb.stock_trainer_bytes({"t": "data_parallel"}, {"t": 100}, b, d, w)
    assert dp == w * 2 * 0.5 * 100 * d * 4
    assert lb.stock_trainer_bytes({"t": "table_wise"}, {"t": 100}, b, d, 1) == 0.0


def _result(steps: int = 10, **counters: float) -> dict[str, Any]:
    return {"steps": steps, "samples": 2 * steps * 8, "samples_per_s": 160.0,
            "world_size": 2, "step_times": [0.1] * steps,
            "placement": {"bagpipe": ["t_cat_0"], "stock": []},
            "sharding_types": {"t_cat_0": "data_parallel"},
            "bagpipe": {"counters": {"steps": 2 * steps, **counters}} if counters else {}}


def test_counters_bound_cap_and_model_by_hand():
    r = _result(steps=10, demand_fetched=200, prefetched=800, fetched_bytes=1_000_000,
                gradient_payload_bytes=600_000, allreduce_payload_bytes=400_000,
                id_exchange_bytes=8_000, demand_gets=20, dependency_waits=5,
                runtime_critical_s=0.5, runtime_critical_cpu_s=0.1)
    c = lb.counters_of(r, world=2, batch=8, dim=4, dense=10, sizes={"t_cat_0": 100})
    assert c.ps_down == 100_000                       # bytes per step, all ranks
    assert c.ps_up == (600_000 + 8 * 1000) / 10       # gradients + keys of the gets
    assert c.trainer_background == (1.0 * 400_000 + 1 * 8_000) / 10  # ring 2(W-1)/W = 1
    assert c.trainer_critical == 2 * 1.0 * 10 * 4     # the dense all-reduce, every rank
    assert c.demand_gets == 1.0 and c.demand_down == 1_000_000 * 0.2 / 20
    assert c.dependency_waits == 0.25 and c.commit_up == 30_000
    assert c.wait_s == pytest.approx(0.4 / 20)
    link = lb.Link(ps_rate=1e6, trainer_rate=1e5, rtt_s=1e-3, shards=2, world=2)
    b = lb.bound_model(0.05, c, link)
    assert b["ps_link_s"] == pytest.approx(max(100_000, 60_800) / 2e6)
    assert b["trainer_link_s"] == pytest.approx((40_800 + 80) / 2e5)
    assert b["bound_by"] == "trainer_link" and b["bound_s"] == b["trainer_link_s"]
    unshaped = lb.Link(ps_rate=1e6, trainer_rate=None, rtt_s=1e-3, shards=2, world=2)
    assert lb.bound_model(0.01, c, unshaped)["bound_by"] == "ps_link"
    assert lb.bound_model(0.2, c, unshaped)["bound_by"] == "compute"
    exposed = 1.0 * 1e-3 + 10_000 / 1e6 + 0.25 * (1e-3 + 30_000 / 1e6)
    assert lb.link_model_step(0.2, c, unshaped) == pytest.approx(0.2 + exposed)
    assert lb.link_model_step(0.0, c, unshaped) == pytest.approx(0.05)  # link occupancy
    assert lb.cap(0.5, 1.0) == 2.0
    # compute: the step less the waits; stock (no runtime): its unshaped step.
    assert lb.compute_of(0.1, c, 0.3, True) == pytest.approx(0.1 - 0.02)
    assert lb.compute_of(0.1, c, 0.3, False) == 0.3
    # shaped trainer link: the dense all-reduce (80 bytes over 2 x 1e5 B/s) is not compute
    assert lb.compute_of(0.1, c, 0.3, True, link) == pytest.approx(0.1 - 0.02 - 80 / 2e5)
    assert lb.compute_of(0.1, c, 0.3, True, unshaped) == pytest.approx(0.1 - 0.02)


def _args() -> Any:
    return lb.parse(["--steps", "10", "--batch-size", "8", "--dim", "4", "--dense-arch", "4"])


def test_report_lines_carry_the_issue_metrics():
    args = _args()
    nocache = _result(fetched_bytes=4e6, gradient_payload_bytes=4e6, prefetched=1000)
    online = _result(fetched_bytes=1e6, gradient_payload_bytes=4e6, prefetched=250)
    online["samples_per_s"] = 320.0
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for t in ("unshaped", "shaped"):
        runs[("stock", t)] = [_result()]
        runs[("ps_nocache", t)] = [nocache, nocache, nocache]
        runs[("online", t)] = [online]
        runs[("prescan", t)] = [online]
    for k in ("lru", "collective", "writeback", "mixed"):
        args.configs.remove(k)
    out = io.StringIO()
    with redirect_stdout(out):
        lb.report(args, runs, 0.1, 1e6, 1e6, 1e-4, 2, 10, {"t_cat_0": 100}, lb.run_info(args),
                  True)
    lines = [json.loads(ln) for ln in out.getvalue().splitlines()]
    for ln in lines:
        assert {"bench", "metric", "value", "unit", "baseline", "ratio", "config",
                "trainer_link"} <= set(ln) and ln["bench"] == "link_bound"
    by = {(ln["metric"], ln["config"], ln["trainer_link"]): ln for ln in lines}
    for t in ("unshaped", "shaped"):
        for c in ("stock", "ps_nocache", "online", "prescan"):
            for m in ("samples_per_s", "bound_samples_per_s", "bound_fraction", "cap",
                      "cap_fraction", "model_error"):
                assert (m, c, t) in by, (m, c, t)
        sps = by[("samples_per_s", "online", t)]
        assert sps["baseline_config"] == "ps_nocache" and sps["ratio"] == 2.0
        # ps_nocache: 8e5 bytes/step up over 2 links of 1e6 B/s = 0.4 s; online 0.2 s
        # (its 4e5 gradient bytes, the larger direction): a cap of 2, reached.
        assert by[("cap", "online", t)]["value"] == pytest.approx(
            (4e5 + 800) / (4e5 + 200))
        nc = by[("bound_samples_per_s", "ps_nocache", t)]
        assert nc["bound_by"] == "ps_link" and nc["ps_link_ms"] == pytest.approx(
            1e3 * (4e5 + 800) / 2e6)
        assert by[("cap_fraction", "ps_nocache", t)]["value"] == pytest.approx(1.0)
        assert ("online_vs_prescan", "online", t) in by


def test_shaped_hosts_get_their_own_bucket():
    cmds = ls.plan_commands("prio", [5000], 1e6, hosts=["127.0.0.11"], host_rate=2e6)
    assert cmds[0][cmds[0].index("bands") + 1] == "4"
    tbfs = [c for c in cmds if "tbf" in c]
    assert [c[c.index("rate") + 1] for c in tbfs] == ["8000000bit", "8000000bit",
                                                      "16000000bit"]
    host = [c for c in cmds if "dst" in c]
    assert host == [["filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio",
                     "1", "u32", "match", "ip", "dst", "127.0.0.11/32", "flowid", "1:4"]]
    # Without hosts, the commands are e2e_dlrm's.
    assert ls.plan_commands("htb", [1, 2], 1e6) == ls.plan_commands("htb", [1, 2], 1e6, ())
    with pytest.raises(ValueError):
        ls.plan_commands("prio", [1], 1e6, hosts=["127.0.0.11"])


def test_drift_moves_the_hot_set():
    base = ["--num_embeddings", "100", "--batch_size", "512", "--limit_train_batches", "4",
            "--zipf_alpha", "1.5"]
    still = list(loader(base, "train", 0, 1))
    moving = list(loader([*base, "--zipf_drift", "0.5"], "train", 0, 1))

    def top(b: Any) -> int:
        return int(torch.bincount(b.sparse_features["cat_0"].values()).argmax())
    assert torch.equal(still[0].sparse_features.values(), moving[0].sparse_features.values())
    assert top(still[3]) == top(still[0]) and top(moving[3]) != top(moving[0])
    # validation and test stay stationary
    val = [list(loader(a, "val", 0, 1)) for a in (base, [*base, "--zipf_drift", "0.5"])]
    assert torch.equal(val[0][-1].sparse_features.values(), val[1][-1].sparse_features.values())
    ds = PowerLawCriteoDataset([50] * 26, 64, 4, drift=1.0)
    assert [ds.shift(j, 50) for j in range(4)] == [0, 12, 25, 37]
    b = ds.batch(3)
    assert torch.equal(ds.label_logits(b), ds.label_logits(b))
    with pytest.raises(ValueError):
        PowerLawCriteoDataset([50] * 26, 64, 4, drift=1.5)


def test_emulated_compute_sleeps_in_every_step():
    from dlrm_ranks import run_dlrm
    argv = ["--sharder", "torchrec", "--num_embeddings", "64", "--batch_size", "8",
            "--limit_train_batches", "3", "--limit_val_batches", "1",
            "--limit_test_batches", "1", "--dense_arch_layer_sizes", "8,64",
            "--over_arch_layer_sizes", "8,1", "--no_progress", "--emulated_compute_ms", "2.5"]
    r = run_dlrm(argv, 1, 300)[0]
    assert r["steps"] == 3 and r["emulated_compute_s"] == pytest.approx(3 * 2.5e-3)
    assert set(r["sharding_types"]) == {f"t_cat_{i}" for i in range(26)}


def test_report_from_a_saved_run(tmp_path):
    nocache = _result(fetched_bytes=4e6, gradient_payload_bytes=4e6, prefetched=1000)
    saved = {"runs": {"stock|unshaped": [_result()], "ps_nocache|unshaped": [nocache]},
             "info": lb.run_info(_args()), "compute_s": 0.1, "rate": 1e6, "measured_rate": 1e6,
             "rtt_s": 1e-4, "shaped_ok": False}
    path = tmp_path / "runs.json"
    path.write_text(json.dumps(saved))
    out = io.StringIO()
    with redirect_stdout(out):
        assert lb.main(["--report-from", str(path), "--configs", "stock,ps_nocache",
                        "--trainer-links", "unshaped", "--batch-size", "8", "--dim", "4",
                        "--dense-arch", "4"]) == 0
    lines = [json.loads(ln) for ln in out.getvalue().splitlines()]
    assert {(ln["metric"], ln["config"]) for ln in lines} >= {
        ("bound_fraction", "stock"), ("bound_fraction", "ps_nocache")}
    assert all(ln["trainer_link"] == "unshaped" for ln in lines)


def test_plan_steps_fits_the_budget_between_the_bounds():
    assert lb.plan_steps(20, 0.5, 8.0, 4) == 16          # 8 s at 0.5 s a step
    assert lb.plan_steps(20, 0.1, 8.0, 4) == 20          # never over --steps
    assert lb.plan_steps(20, 5.0, 8.0, 4) == 4           # never under --min-steps
    assert lb.plan_steps(3, 5.0, 8.0, 4) == 3            # --steps wins over --min-steps
    assert lb.plan_steps(100, 5.0, 0.0, 100) == 100      # full mode: no budget
    assert lb.plan_steps(20, None, 8.0, 4) == 20         # nothing to predict from


def test_quick_and_full_defaults():
    quick, full = lb.parse(["--quick"]), lb.parse([])
    assert (quick.steps, quick.step_budget, quick.min_steps) == (12, 6.0, 4)
    assert (full.steps, full.step_budget, full.min_steps) == (100, 0.0, 100)
    assert lb.run_info(quick)["step_budget_s"] == 6.0
    assert "--limit_val_batches" in (argv := lb.common_argv(quick, [10], 7))
    assert argv[argv.index("--limit_train_batches") + 1] == "7"
    assert argv[argv.index("--limit_val_batches") + 1] == "1"
    with pytest.raises(SystemExit):
        lb.parse(["--min-steps", "1"])


def _timed(step_s: float, steps: int, **counters: float) -> dict[str, Any]:
    """A fake run of 2 ranks x batch 8 whose mean step is `step_s`."""
    r = _result(steps=steps, **counters)
    r["samples_per_s"] = r["samples"] / (steps * step_s)
    return r


def test_predict_step_from_what_was_measured():
    link = lb.Link(ps_rate=1e6, trainer_rate=1e3, rtt_s=1e-3, shards=2, world=2)
    args = (link, 8, 4, 10, {"t_cat_0": 100})
    stock = _timed(0.2, 10)
    stock["placement"] = {"bagpipe": [], "stock": ["t_cat_0"]}
    stock["sharding_types"] = {"t_cat_0": "table_wise"}
    nocache = _timed(1.5, 10, fetched_bytes=1e5, gradient_payload_bytes=1e5)
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {("stock", "unshaped"): [stock]}
    assert lb.predict_step("stock", "unshaped", runs, 0.2, *args) == pytest.approx(0.2)
    # shaped: the stock all-to-alls and the dense all-reduce over 2 x 1e3 B/s, exposed
    c = lb.counters_of(stock, 2, 8, 4, 10, {"t_cat_0": 100})
    assert lb.predict_step("stock", "shaped", runs, 0.2, *args) == pytest.approx(
        0.2 + c.trainer_critical / 2e3)
    assert lb.predict_step("online", "unshaped", runs, 0.2, *args) is None
    runs[("ps_nocache", "unshaped")] = [nocache]
    assert lb.predict_step("online", "unshaped", runs, 0.2, *args) == pytest.approx(1.5)
    assert lb.predict_step("mixed", "unshaped", runs, 0.2, *args) is None
    # a shaped trainer link never predicts a shorter step than the unshaped run's
    assert lb.predict_step("ps_nocache", "shaped", runs, 0.2, *args) >= 1.5


class _Fake:
    """Stands in for PSServers / ShapedLink / the trainer address: a context manager."""

    recipe = "prio"
    addresses = ["127.0.0.1:1"]

    def __init__(self, *_a: Any, **_k: Any) -> None:
        pass

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *_exc: Any) -> None:
        pass


def test_main_reuses_the_calibration_and_plans_steps_per_case(monkeypatch):
    """The round robin with fake ranks: the calibration is round 1's stock run, a long-step
    case runs fewer steps, every later round the same steps, each line its own `steps`."""
    calls: list[tuple[str, str, int]] = []
    slow = {("stock", "shaped"): 5.0, ("ps_nocache", "unshaped"): 1.0,
            ("ps_nocache", "shaped"): 1.0}

    def fake_run(argv: list[str], world: int, timeout: float, env: Any = None) -> list[Any]:
        steps = int(argv[argv.index("--limit_train_batches") + 1])
        name = "stock" if "--sharder" in argv else "ps_nocache"
        t = "shaped" if env else "unshaped"
        calls.append((name, t, steps))
        r = _timed(slow.get((name, t), 0.1), steps,
                   **({} if name == "stock" else {"fetched_bytes": 1e3}))
        return [r, r]

    monkeypatch.setattr(lb, "run_dlrm", fake_run)
    monkeypatch.setattr(lb, "PSServers", _Fake)
    monkeypatch.setattr(lb, "ShapedLink", _Fake)
    monkeypatch.setattr(lb, "measure_link", lambda *_a, **_k: (1e6, 1e6, 1e-4))
    monkeypatch.setattr(lb, "trainer_address", lambda: _env_cm({"GLOO_SOCKET_IFNAME": "x"}))
    out = io.StringIO()
    with redirect_stdout(out):
        assert lb.main(["--quick", "--repeats", "2", "--configs", "stock,ps_nocache",
                        "--link-gbps", "1e9",  # the fake ranks' trainer traffic: ~no time
                        "--batch-size", "8", "--dim", "4", "--dense-arch", "4"]) == 0
    # calibration, then round 1 without stock|unshaped, then round 2 with it
    assert [(n, t) for n, t, _ in calls] == [
        ("stock", "unshaped"), ("ps_nocache", "unshaped"), ("stock", "shaped"),
        ("ps_nocache", "shaped"), ("stock", "unshaped"), ("ps_nocache", "unshaped"),
        ("stock", "shaped"), ("ps_nocache", "shaped")]
    steps = {}
    for n, t, s in calls:
        assert steps.setdefault((n, t), s) == s        # the same in every round
    assert steps[("stock", "unshaped")] == 12
    assert steps[("ps_nocache", "unshaped")] == 12     # nothing to predict it from
    # 6 s at its unshaped run's 1 s step (and the little the model adds on the shaped link)
    assert steps[("ps_nocache", "shaped")] in (5, 6)
    lines = [json.loads(ln) for ln in out.getvalue().splitlines()]
    by = {(ln["metric"], ln["config"], ln["trainer_link"]): ln for ln in lines}
    for (n, t), s in steps.items():
        assert by[("samples_per_s", n, t)]["steps"] == s
    assert by[("shaped_link", "all", "all")]["steps"] == 12


@contextlib.contextmanager
def _env_cm(env: dict[str, str]) -> Iterator[dict[str, str]]:
    yield env


def test_trainer_address_is_removed_on_every_exit_path(monkeypatch):
    ops: list[str] = []

    def fake_ip(op: str, stderr: str = "", rc: int = 0) -> Any:
        ops.append(op)
        return lb.subprocess.CompletedProcess([], rc, "", stderr)

    monkeypatch.setattr(lb, "_ip_addr", fake_ip)
    with lb.trainer_address() as env:
        assert env == {"GLOO_SOCKET_IFNAME": lb.TRAINER_IFACE}
    assert ops == ["add", "del"]
    ops.clear()
    with pytest.raises(RuntimeError), lb.trainer_address():
        raise RuntimeError("a rank failed")
    assert ops == ["add", "del"]
    ops.clear()
    # SIGTERM inside signals_exit: SystemExit, which unwinds the address too
    import signal
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as e, lb.signals_exit(), lb.trainer_address():
        os.kill(os.getpid(), signal.SIGTERM)
    assert e.value.code == 128 + signal.SIGTERM and ops == ["add", "del"]
    assert signal.getsignal(signal.SIGTERM) is before  # the old handler is back
    ops.clear()
    # left by a run killed with SIGKILL: taken over and removed
    monkeypatch.setattr(lb, "_ip_addr", lambda op: fake_ip(
        op, "RTNETLINK answers: File exists" if op == "add" else "", 2 if op == "add" else 0))
    with lb.trainer_address() as env:
        assert env is not None
    assert ops == ["add", "del"]
    ops.clear()
    # cannot add (not root): unshaped, nothing to remove
    monkeypatch.setattr(lb, "_ip_addr", lambda op: fake_ip(op, "Operation not permitted", 2))
    with lb.trainer_address() as env:
        assert env is None
    assert ops == ["add"]
