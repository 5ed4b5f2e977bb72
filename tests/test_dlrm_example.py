"""The DLRM example end to end on 2 gloo ranks: the training-loop and optimizer flags
change what it does, BagPipe's SGD trains exactly like stock TorchRec from the same weights
(synthetic data and TorchRec-preprocessed Criteo files, with and without the learning-rate
policy), and ``--adagrad`` (with the policy) trains like the single-process model on the
global batch — the definition of Adagrad that BagPipe's PS applies; stock TorchRec's fused
CPU kernel is measured against the same reference."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
from _dist import run_world
from criteo_files import REPO, preprocess, write_days

from torchrec_bagpipe.distributed import UnsupportedOptimizerError

pytestmark = pytest.mark.slow

SMALL = ["--batch_size", "16", "--num_embeddings", "300", "--embedding_dim", "8",
         "--dense_arch_layer_sizes", "16,8", "--over_arch_layer_sizes", "16,1"]


def _main(argv: list[str], **kwargs: Any) -> tuple[dict[str, Any], str, str]:
    """dlrm_main.main on this rank: (results, stdout, stderr)."""
    import sys

    sys.path.insert(0, os.path.join(REPO, "examples", "dlrm"))
    import dlrm_main

    os.environ.setdefault("LOCAL_WORLD_SIZE", "2")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        results = dlrm_main.main(argv, **kwargs)
    return results, out.getvalue(), err.getvalue()


def _initial(argv: list[str]) -> dict[str, Any]:
    """The unsharded model's weights (tables included), the same on every rank."""
    import sys

    import torch

    sys.path.insert(0, os.path.join(REPO, "examples", "dlrm"))
    import dlrm_main

    torch.manual_seed(123)
    model = dlrm_main.build_model(dlrm_main.parse_args(argv), torch.device("cpu"),
                                  torch.device("cpu"))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- the training loop ------------------------------------------------------------------------
def _loop(rank: int, world: int, tmp: str) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    base = [*SMALL, "--sharder", "torchrec", "--limit_train_batches", "5",
            "--limit_val_batches", "2", "--limit_test_batches", "3", "--seed", "3"]
    out: dict[str, Any] = {}
    out["full"] = _main([*base, "--epochs", "2", "--validation_freq_within_epoch", "2",
                         "--print_lr", "--print_sharding_plan", "--learning_rate", "0.3",
                         "--no_progress", "--metrics_json", os.path.join(tmp, "m.json")])
    out["plain"] = _main([*base, "--epochs", "2", "--learning_rate", "0.3"])
    out["seed"] = _main([*base, "--seed", "4", "--learning_rate", "0.3", "--no_progress"])
    out["lr"] = _main([*base, "--learning_rate", "0.05", "--no_progress"])
    return out


def test_training_loop_flags(tmp_path):
    r0, r1 = run_world(_loop, 2, args=(str(tmp_path),), timeout=600)
    results, stdout, _ = r0["full"]
    # --epochs 2 x --limit_train_batches 5; a validation per epoch.
    assert results["steps"] == 10 and len(results["train_losses"]) == 10
    assert len(results["val_auroc"]) == 2
    # --validation_freq_within_epoch 2: after steps 2 and 4 of each epoch, and at its end;
    # --limit_val_batches 2 / --limit_test_batches 3 batches of 16 on each of 2 ranks.
    assert stdout.count("AUROC over val set") == 6
    assert "Number of val samples: 64" in stdout and "Number of test samples: 96" in stdout
    assert stdout.count("Total number of iterations: 5") == 2
    assert results["samples"] == 10 * 16 * 2
    # --print_lr: one line per step and param group (steps counted within the epoch).
    groups = len(results["lrs"][0])
    lines = [ln for ln in stdout.splitlines() if ln.startswith("lr: ")]
    assert len(lines) == 10 * groups and lines[0] == "lr: 0 0 0.300000"
    assert lines[5 * groups] == "lr: 0 0 0.300000" and lines[-1].startswith("lr: 4 ")
    assert r1["full"][1].count("lr: ") == 0  # rank 0 prints
    # --print_sharding_plan prints TorchRec's plan table, every table in it.
    assert "t_cat_25" in stdout and "sharding type" in stdout and "compute kernel" in stdout
    # --metrics_json: rank 0's results.
    assert json.loads((tmp_path / "m.json").read_text())["steps"] == 10
    # --no_progress hides the bars that rank 0 shows otherwise.
    assert "Epoch 1" in r0["plain"][2] and "Epoch" not in r0["full"][2]
    # --seed fixes the weights and the data: validation inside the epoch changes nothing.
    plain = r0["plain"][0]
    assert plain["train_losses"] == results["train_losses"]
    assert r0["seed"][0]["train_losses"] != results["train_losses"][:5]
    # --learning_rate: every param group's rate, and the training.
    assert all(lr == pytest.approx(0.05, rel=1e-6) for lrs in r0["lr"][0]["lrs"] for lr in lrs)
    assert r0["lr"][0]["train_losses"][1:] != results["train_losses"][1:5]


# ---- optimizers and the learning-rate policy with stock tables -----------------------------------
def _policy(t: int, base: float, warmup: int, start: int, steps: int, last: float) -> float:
    if t < warmup:
        return base * (1.0 - (warmup - t) / warmup)
    if start <= t < start + steps:
        return max(1e-7, base * ((steps - (t - start)) / steps) ** 2)
    return last if steps > 0 else base


def _optimizers(rank: int, world: int) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    base = [*SMALL, "--sharder", "torchrec", "--limit_train_batches", "10",
            "--limit_val_batches", "1", "--limit_test_batches", "1", "--seed", "5",
            "--learning_rate", "0.4", "--no_progress"]
    init = _initial(base)
    runs = {
        "sgd": base,
        "schedule": [*base, "--lr_warmup_steps", "3", "--lr_decay_start", "5",
                     "--lr_decay_steps", "4"],
        "adagrad": [*base, "--adagrad"],
        "eps": [*base, "--adagrad", "--eps", "1.0"],
    }
    return {k: _main(v, initial_state=init)[0] for k, v in runs.items()}


def test_optimizer_flags_with_stock_tables():
    r0, _ = run_world(_optimizers, 2, timeout=600)
    lrs = r0["schedule"]["lrs"]
    # The fused tables' groups and the dense optimizer's groups follow the policy alike.
    assert len(lrs[0]) >= 2
    last = 0.0
    for step, groups in enumerate(lrs):
        want = _policy(step + 1, 0.4, 3, 5, 4, last)
        if step + 1 < 3 or 5 <= step + 1 < 9:
            last = want
        # (the fused tables keep their rate in float32)
        assert groups == pytest.approx([want] * len(groups), rel=1e-6), step
    assert lrs[0][0] == pytest.approx(0.4 / 3) and lrs[-1][0] == pytest.approx(0.4 / 16)
    losses = {k: v["train_losses"] for k, v in r0.items()}
    assert losses["sgd"][0] == losses["schedule"][0]  # same weights, same first batch
    assert losses["schedule"][1:] != losses["sgd"][1:]
    assert losses["adagrad"][1:] != losses["sgd"][1:]
    assert losses["eps"][1:] != losses["adagrad"][1:]
    assert all(lr == pytest.approx(0.4, rel=1e-6) for g in r0["adagrad"]["lrs"] for lr in g)


# ---- BagPipe against stock TorchRec --------------------------------------------------------------
@pytest.fixture(scope="module")
def criteo_npy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dlrm_criteo")
    write_days(root / "tsv", [23] * 23 + [40], seed=2)
    preprocess(root / "tsv", root / "npy")
    return root / "npy"


def _both(argv: list[str], extra: list[str] | None = None) -> dict[str, Any]:
    """Stock TorchRec and BagPipe from the same initial weights: their results, or the
    message of BagPipe's UnsupportedOptimizerError."""
    init = _initial(argv)
    out: dict[str, Any] = {"torchrec": _main([*argv, "--sharder", "torchrec"],
                                             initial_state=init)[0]}
    try:
        out["bagpipe"] = _main([*argv, "--sharder", "bagpipe", *(extra or [])],
                               initial_state=init)[0]
    except UnsupportedOptimizerError as e:
        out["bagpipe"] = {"unsupported": str(e)}
    return out


# Every table on BagPipe (the example's default places these small tables by size: stock).
ALL_BAGPIPE = ["--placement-min-rows", "0"]
# 3 tables of 300 rows among 23 of 40: the 3 go to BagPipe by --placement-min-rows.
MIXED_SIZES = ["--num_embeddings_per_feature", ",".join(["300"] * 3 + ["40"] * 23),
               "--placement-min-rows", "300"]


def _sgd(rank: int, world: int, npy: str) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    common = [*SMALL, "--learning_rate", "0.5", "--seed", "9", "--no_progress",
              "--limit_val_batches", "2", "--limit_test_batches", "2"]
    sized = [a for a in common if a not in ("--num_embeddings", "300")]
    return {
        "synthetic": _both([*common, "--limit_train_batches", "12"],
                           [*ALL_BAGPIPE, "--optimization-cache-capacity", "1"]),
        "prescan": _both([*common, "--limit_train_batches", "8"],
                         [*ALL_BAGPIPE, "--optimization-prescan",
                          "--bagpipe-aggregation", "collective"]),
        # Multi-hot bags (int32 ids) and undersampled batches of varying sizes.
        "multi_hot": _both([*common, "--limit_train_batches", "8", "--multi_hot_sizes",
                            ",".join(["3", "1"] * 13), "--undersampling_rate", "0.5"],
                           [*ALL_BAGPIPE, "--optimization-prescan"]),
        # 529 training rows: batches of 16 on 2 ranks end with a partial round.
        "criteo": _both([*SMALL, "--learning_rate", "0.5", "--seed", "9", "--no_progress",
                         "--in_memory_binary_criteo_path", npy, "--num_embeddings", "50"],
                        ALL_BAGPIPE),
        # Size-based placement: the large tables on BagPipe, the others stock, in one EBC.
        "mixed": _both([*sized, "--limit_train_batches", "10", *MIXED_SIZES[:2]],
                       MIXED_SIZES[2:]),
    }


def test_bagpipe_sgd_trains_like_stock_torchrec(criteo_npy):
    per_rank = run_world(_sgd, 2, args=(str(criteo_npy),), timeout=600)
    for case in ("synthetic", "prescan", "multi_hot", "criteo", "mixed"):
        for r in per_rank:
            stock, ours = r[case]["torchrec"], r[case]["bagpipe"]
            assert "unsupported" not in ours, ours
            assert ours["steps"] == stock["steps"] > 0
            assert ours["train_losses"] == pytest.approx(stock["train_losses"], rel=1e-5,
                                                         abs=1e-6), case
            assert ours["test_auroc"] == pytest.approx(stock["test_auroc"], abs=1e-4), case
            placed = ours["placement"]
            if case == "mixed":
                assert placed["bagpipe"] == ["t_cat_0", "t_cat_1", "t_cat_2"], placed
                assert len(placed["stock"]) == 23
            else:
                assert len(placed["bagpipe"]) == 26 and not placed["stock"], placed
            assert not stock["placement"]["bagpipe"]
    # Criteo files: 529 training rows in batches of 16 on 2 ranks end with a partial round.
    criteo = per_rank[0]["criteo"]["bagpipe"]
    assert criteo["steps"] == 17 and criteo["samples"] == 529


def _reference(argv: list[str], init: dict[str, Any]) -> list[float]:
    """examples/dlrm/single_process.py: the model on the global batch, per-step loss."""
    import sys

    sys.path.insert(0, os.path.join(REPO, "examples", "dlrm"))
    import single_process

    return single_process.reference_losses(argv, init)


def _optimizer_cases(rank: int, world: int) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    common = [*SMALL, "--learning_rate", "0.2", "--seed", "9", "--no_progress",
              "--limit_train_batches", "10", "--limit_val_batches", "1",
              "--limit_test_batches", "1"]
    schedule = ["--lr_warmup_steps", "2", "--lr_decay_start", "4", "--lr_decay_steps", "4"]
    cases = {
        "schedule": [*common, *schedule],
        "adagrad": [*common, "--adagrad", *schedule],
        "adagrad_eps": [*common, "--adagrad", "--eps", "1e-3"],
    }
    out = {}
    for name, argv in cases.items():
        out[name] = _both(argv, [*ALL_BAGPIPE, "--optimization-cache-capacity", "1"])
        if rank == 0:
            out[name]["reference"] = _reference(argv, _initial(argv))
    return out


def _global(per_rank: list[dict[str, Any]], case: str, sharder: str) -> list[float]:
    """A run's loss per step: the mean of the ranks' batch losses."""
    runs = [r[case][sharder]["train_losses"] for r in per_rank]
    return [sum(v) / len(v) for v in zip(*runs)]


def test_bagpipe_lr_schedule_and_adagrad_train_like_the_reference():
    per_rank = run_world(_optimizer_cases, 2, timeout=900)
    r0 = per_rank[0]
    deviations = {}
    for name, case in r0.items():
        ours, stock, ref = case["bagpipe"], case["torchrec"], case["reference"]
        assert "unsupported" not in ours, ours
        assert ours["steps"] == stock["steps"] == len(ref) == 10
        # Every metric of an SGD run is reported with Adagrad and the policy too.
        assert set(ours) == set(stock) and "test_auroc" in ours
        ours_g, stock_g = _global(per_rank, name, "bagpipe"), _global(per_rank, name, "torchrec")
        assert ours_g == pytest.approx(ref, rel=1e-5, abs=1e-6), name
        deviations[name] = max(abs(a - b) for a, b in zip(stock_g, ref))
        if name == "schedule":  # SGD: stock TorchRec is exact too
            assert stock_g == pytest.approx(ours_g, rel=1e-5, abs=1e-6)
    # The learning rates the policy set (warm-up 1/2, 2/2, then the decay) reached the
    # tables: the first step ran at half the base rate.
    assert r0["adagrad"]["bagpipe"]["lrs"][0][0] == pytest.approx(0.1)
    # Stock TorchRec's fused CPU Adagrad against the same reference (reported, not a bound).
    print(f"stock TorchRec vs single-process reference, max |loss diff|: {deviations}")


def test_convergence_benchmark_runs(tmp_path):
    """benchmarks/convergence.py end to end, briefly: both data sets, both sharders."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "convergence.py"), "--steps", "5",
         "--batch-size", "16", "--num-embeddings", "200", "--eval-batches", "1",
         "--no-control", "--png", str(tmp_path / "c.png")],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-4000:]
    lines = [json.loads(ln) for ln in out.stdout.splitlines()]
    by = {(d.get("dataset"), d["metric"]): d for d in lines}
    for dataset in ("synthetic", "criteo"):
        assert by[(dataset, "max_abs_loss_diff")]["value"] < 1e-6
        auroc = by[(dataset, "test_auroc")]
        assert auroc["value"] == pytest.approx(auroc["baseline"], abs=1e-4)
    assert (tmp_path / "c.png").stat().st_size > 0
