"""benchmarks/link_shaping.py without tc: the commands it plans, the recipe fallback, the
refusal to replace someone else's qdisc, and removal on every way out (a fake tc runner
records the calls; nothing here needs root or touches a real qdisc); and e2e_dlrm.py's
shaped-link section with fake runs: the link's rate, the model's prediction and error against
the measurement, and the fallback to the model when shaping is unavailable."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "link_shaping", os.path.join(REPO, "benchmarks", "link_shaping.py"))
assert _spec is not None and _spec.loader is not None
ls = importlib.util.module_from_spec(_spec)
sys.modules["link_shaping"] = ls  # its dataclass looks its module up
_spec.loader.exec_module(ls)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import e2e_dlrm  # noqa: E402  (needs benchmarks/ on sys.path)


class FakeTc:
    """A tc that knows `kinds` of qdisc and starts with `root` on lo."""

    def __init__(self, kinds: Sequence[str] = ("prio", "htb", "tbf"), root: str = "noqueue"):
        self.kinds = set(kinds)
        self.root = root
        self.calls: list[list[str]] = []

    def __call__(self, args: Sequence[str]) -> subprocess.CompletedProcess[str]:
        args = list(args)
        self.calls.append(args)
        ok = subprocess.CompletedProcess(args, 0, "", "")
        if args[:2] == ["qdisc", "show"]:
            return subprocess.CompletedProcess(args, 0, f"qdisc {self.root} 0: root refcnt 2\n",
                                               "")
        if args[:2] == ["qdisc", "del"]:
            self.root = "noqueue"
            return ok
        if args[:2] == ["qdisc", "add"]:
            kind = next(a for a in args if a in {"prio", "htb", "tbf", "fq"})
            if kind not in self.kinds:
                return subprocess.CompletedProcess(args, 2, "",
                                                   "Error: Specified qdisc kind is unknown.")
            if "root" in args:
                self.root = kind
        return ok


def test_plan_prio_shapes_both_directions_of_every_port() -> None:
    cmds = ls.plan_commands("prio", [7001, 7002], 50e6)
    root = cmds[0]
    assert root[:7] == ["qdisc", "add", "dev", "lo", "root", "handle", "1:"]
    assert "prio" in root and root[root.index("bands") + 1] == "5"
    # Every priority goes to band 1:1, which has no tbf: unmatched traffic is not shaped.
    assert root[root.index("priomap") + 1:] == ["0"] * 16
    tbfs = [c for c in cmds if "tbf" in c]
    assert [c[c.index("parent") + 1] for c in tbfs] == ["1:2", "1:3", "1:4", "1:5"]
    assert all(c[c.index("rate") + 1] == "400000000bit" for c in tbfs)
    filters = [c for c in cmds if c[0] == "filter"]
    matched = [(c[c.index("ip", c.index("match")) + 1], c[c.index("ip", c.index("match")) + 2],
                c[-1]) for c in filters]
    assert matched == [("dport", "7001", "1:2"), ("sport", "7001", "1:3"),
                       ("dport", "7002", "1:4"), ("sport", "7002", "1:5")]


def test_plan_htb_has_an_unshaped_default_class() -> None:
    cmds = ls.plan_commands("htb", [7001], 10e6)
    assert cmds[0][-2:] == ["default", "1"]
    assert ["class", "add", "dev", "lo", "parent", "1:", "classid", "1:1", "htb", "rate",
            "100gbit"] in cmds
    assert sum("tbf" in c for c in cmds) == 2


def test_plan_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="no ports"):
        ls.plan_commands("prio", [], 1e6)
    with pytest.raises(ValueError, match="rate"):
        ls.plan_commands("prio", [1], 0)
    with pytest.raises(ValueError, match="16 bands"):
        ls.plan_commands("prio", list(range(8)), 1e6)
    with pytest.raises(ValueError, match="recipe"):
        ls.plan_commands("cake", [1], 1e6)


def test_burst_holds_two_lo_packets_and_a_millisecond() -> None:
    assert ls.tbf_burst(1e6) >= 2 * 65536
    assert ls.tbf_burst(1e9) == int(1e9 / 1000)


def test_falls_back_to_htb_and_removes_the_shaping_on_exit() -> None:
    tc = FakeTc(kinds=("htb", "tbf"))
    with ls.ShapedLink([7001], 50e6, runner=tc) as link:
        assert link.recipe == "htb"
        assert tc.root == "htb"
    assert tc.root == "noqueue"
    assert tc.calls[-1] == ["qdisc", "del", "dev", "lo", "root"]


def test_removes_the_shaping_when_the_body_raises() -> None:
    tc = FakeTc()
    with pytest.raises(RuntimeError, match="boom"), ls.ShapedLink([7001], 5e6, runner=tc):
        assert tc.root == "prio"
        raise RuntimeError("boom")
    assert tc.root == "noqueue"


def test_never_replaces_an_existing_root_qdisc() -> None:
    tc = FakeTc(root="htb")
    with pytest.raises(ls.ShapingUnavailable, match="already has a root qdisc"), \
            ls.ShapedLink([7001], 5e6, runner=tc):
        pass
    assert tc.root == "htb"
    assert not any(c[:2] == ["qdisc", "del"] for c in tc.calls)


def test_unavailable_when_the_kernel_refuses_every_recipe() -> None:
    tc = FakeTc(kinds=("tbf",))
    with pytest.raises(ls.ShapingUnavailable, match="refused every recipe"), \
            ls.ShapedLink([7001], 5e6, runner=tc):
        pass
    assert tc.root == "noqueue"


def test_a_partial_recipe_is_taken_out_before_the_next_is_tried() -> None:
    tc = FakeTc(kinds=("prio", "htb"))  # root qdiscs go in, tbf does not
    with pytest.raises(ls.ShapingUnavailable), ls.ShapedLink([7001], 5e6, runner=tc):
        pass
    dels = [c for c in tc.calls if c[:2] == ["qdisc", "del"]]
    assert len(dels) == 2  # after prio's tbf failed, after htb's tbf failed
    assert tc.root == "noqueue"


def test_link_rate_keeps_bandwidth_per_step() -> None:
    # 25 Gb/s under a 2 ms step moves 6.25 MB per step; over a 50 ms step that is 125 MB/s.
    assert ls.link_rate(25.0, 2.0, 0.05) == pytest.approx(125e6)
    assert ls.link_rate(25.0, 2.0, 0.002) == pytest.approx(25e9 / 8)
    with pytest.raises(ValueError, match="positive"):
        ls.link_rate(25.0, 2.0, float("nan"))
    with pytest.raises(ValueError, match="positive"):
        ls.link_rate(0.0, 2.0, 0.05)


def test_unavailable_without_tc_or_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ls.shutil, "which", lambda name: None)
    with pytest.raises(ls.ShapingUnavailable, match="no tc binary"), ls.ShapedLink([7001], 5e6):
        pass
    monkeypatch.setattr(ls.shutil, "which", lambda name: "/bin/" + name)
    monkeypatch.setattr(ls.os, "geteuid", lambda: 1000)
    with pytest.raises(ls.ShapingUnavailable, match="needs root"), ls.ShapedLink([7001], 5e6):
        pass


# ---- e2e_dlrm.shaped_section with fake runs -------------------------------------------------

COUNTERS = {  # per run of 10 steps x 2 ranks
    "ps_nocache": {"fetched_bytes": 2e7, "demand_fetched": 8e4, "demand_gets": 1040.0,
                   "gradient_payload_bytes": 2e7, "dependency_waits": 10.0, "steps": 10.0},
    "bagpipe_prescan": {"fetched_bytes": 4e6, "demand_fetched": 0.0, "prefetched": 1.6e4,
                        "prefetch_gets": 520.0, "gradient_payload_bytes": 4e6,
                        "dependency_waits": 0.0, "steps": 10.0},
}


def _fake_run(step_s: float, name: str) -> dict[str, Any]:
    return {"samples_per_s": 2 * 256 / step_s, "step_times": [step_s] * 10, "steps": 10,
            "bagpipe": {"counters": dict(COUNTERS[name])}}


class _FakeServers:
    def __init__(self, ports: list[int], token: str) -> None:
        self.addresses = [f"127.0.0.1:{p}" for p in ports]

    def __enter__(self) -> _FakeServers:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _shaped_section(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                    shaped_link: Any) -> list[dict[str, Any]]:
    state = {"shaped": False}
    ran: list[list[str]] = []
    unshaped_step = {"ps_nocache": 0.040, "bagpipe_prescan": 0.044}
    shaped_step = {"ps_nocache": 0.100, "bagpipe_prescan": 0.050}

    def run_config(argv: list[str], world: int, timeout: float) -> dict[str, Any]:
        ran.append(argv)
        name = "ps_nocache" if "ps" in argv else "bagpipe_prescan"
        return _fake_run((shaped_step if state["shaped"] else unshaped_step)[name], name)

    class Shaped:
        def __init__(self, ports: list[int], rate: float) -> None:
            self.recipe = "prio"
            self.rate = rate

        def __enter__(self) -> Shaped:
            shaped_link(self.rate)
            state["shaped"] = True
            return self

        def __exit__(self, *exc: object) -> None:
            state["shaped"] = False

    monkeypatch.setattr(e2e_dlrm, "run_config", run_config)
    monkeypatch.setattr(e2e_dlrm, "PSServers", _FakeServers)
    monkeypatch.setattr(e2e_dlrm, "ShapedLink", Shaped)
    monkeypatch.setattr(e2e_dlrm, "measure_link", lambda port, nbytes: (130e6, 120e6, 1e-4))
    args = argparse.Namespace(link_gbps=25.0, link_step_ms=2.0, timeout=60.0)
    configs = {"ps_nocache": ["--read-mode", "ps"], "bagpipe_prescan": ["--optimization-prescan"]}
    capsys.readouterr()
    e2e_dlrm.shaped_section(args, ["--batch_size", "256"], configs, list(configs), 2, 256, 1,
                            0.05, extra={"dim": 64})
    for argv in ran:  # every run goes to the servers over TCP with the job's token
        assert argv[argv.index("--ps-type") + 1] == "tcp"
        assert argv[argv.index("--ps-addresses") + 1].startswith("127.0.0.1:")
        assert "--job-token" in argv
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_shaped_section_checks_the_model_against_the_measurement(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    rates: list[float] = []
    lines = _shaped_section(monkeypatch, capsys, rates.append)
    assert rates == [pytest.approx(125e6)]  # 25 Gb/s x 2 ms / 50 ms stock step
    by = {(d["metric"], d["config"]): d for d in lines}
    link_line = by[("shaped_link", "all")]
    assert link_line["shaping"] == "tc prio" and link_line["measured_rtt_us"] == pytest.approx(100)
    measured = by[("shaped_samples_per_s", "ps_nocache")]["value"]
    assert measured == pytest.approx(512 / 0.100)
    prescan = by[("shaped_samples_per_s", "bagpipe_prescan")]
    assert prescan["ratio"] == pytest.approx(0.100 / 0.050)
    assert by[("shaped_prescan_vs_nocache", "bagpipe_prescan")]["value"] == pytest.approx(2.0)
    # The model: the configuration's unshaped step as compute, the shaped run's counters, the
    # measured link (the slower direction's bytes/s, the measured round trip).
    link = e2e_dlrm.Link("shaped", rtt_s=1e-4, bytes_per_s=120e6, window=8)
    for name, compute in (("ps_nocache", 0.040), ("bagpipe_prescan", 0.044)):
        _, t = e2e_dlrm.model_step(compute, COUNTERS[name], 10, 2, link)
        model = by[("shaped_model_step_ms", name)]
        assert model["model_samples_per_s"] == pytest.approx(512 / t)
        # Checked against the shaped runs' median step: |modelled - measured| / measured.
        assert model["value"] == pytest.approx(1e3 * t)
        measured_step = {"ps_nocache": 0.100, "bagpipe_prescan": 0.050}[name]
        assert model["baseline"] == pytest.approx(1e3 * measured_step)
        assert model["model_error"] == pytest.approx(abs(t - measured_step) / measured_step)
        assert model["compute_ms"] == pytest.approx(1e3 * compute)


def test_shaped_section_falls_back_to_the_model(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def refuse(rate: float) -> None:
        raise ls.ShapingUnavailable("shaping lo needs root")

    lines = _shaped_section(monkeypatch, capsys, refuse)
    by = {(d["metric"], d["config"]): d for d in lines}
    assert by[("shaped_link", "all")]["shaping"] == \
        "unavailable, link model only: shaping lo needs root"
    assert not any(d["metric"] == "shaped_samples_per_s" for d in lines)
    assert ("shaped_prescan_vs_nocache", "bagpipe_prescan") not in by
    # The model's prediction at the link's nominal rate, from the unshaped runs.
    link = e2e_dlrm.Link("x", rtt_s=e2e_dlrm.PRESETS[0].rtt_s, bytes_per_s=125e6, window=8)
    _, t = e2e_dlrm.model_step(0.040, COUNTERS["ps_nocache"], 10, 2, link)
    assert by[("shaped_model_samples_per_s", "ps_nocache")]["value"] == pytest.approx(512 / t)


def test_ps_servers_listen_and_stop() -> None:
    """dlrm_ranks.PSServers: real shard servers on the given ports; all stopped on exit."""
    import socket

    import dlrm_ranks

    ports = [dlrm_ranks.free_port(), dlrm_ranks.free_port()]
    with dlrm_ranks.PSServers(ports, "a-token") as servers:
        assert servers.addresses == [f"127.0.0.1:{p}" for p in ports]
        procs = list(servers.procs)
        for p in ports:
            socket.create_connection(("127.0.0.1", p), timeout=10).close()
    assert all(proc.poll() is not None for proc in procs)
