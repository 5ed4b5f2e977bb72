"""Every bad input to EmbeddingStore raises TypeError / ValueError naming the argument (or
MemoryError for an exhausted memory-only budget), before anything is written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from torchrec_bagpipe.ps import EmbeddingStore

INIT = {"init_bound": 0.1, "seed": 1}


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"dim": "4"}, TypeError, "dim"),
        ({"dim": 4.0}, TypeError, "dim"),
        ({"dim": True}, TypeError, "dim"),
        ({"dim": 0}, ValueError, "dim"),
        ({"num_shards": 3}, ValueError, "num_shards"),
        ({"num_shards": 8192}, ValueError, "num_shards"),
        ({"num_shards": 0}, ValueError, "num_shards"),
        ({"num_threads": 0}, ValueError, "num_threads"),
        ({"num_threads": 1.5}, TypeError, "num_threads"),
        ({"init": "normal"}, ValueError, "init"),
        ({"init_bound": -0.1}, ValueError, "init_bound"),
        ({"init_bound": float("nan")}, ValueError, "init_bound"),
        ({"init_bound": "0.1"}, TypeError, "init_bound"),
        ({"init_bound": []}, ValueError, "init_bound"),
        ({"init_bound": [(0, 0.1), (0, 0.2)]}, ValueError, "init_bound"),
        ({"init_bound": [(0, 0.1, 3)]}, TypeError, "init_bound"),
        ({"init_bound": [(0, -1.0)]}, ValueError, "init_bound"),
        ({"init_bound": None}, ValueError, "init_bound"),
        ({"init": "constant", "init_value": float("inf")}, ValueError, "init_value"),
        ({"seed": -1}, ValueError, "seed"),
        ({"seed": 2**64}, ValueError, "seed"),
        ({"seed": 1.0}, TypeError, "seed"),
        ({"key_bound": 0}, ValueError, "key_bound"),
        ({"memory_budget": "lots"}, ValueError, "memory_budget"),
        ({"memory_budget": -5}, ValueError, "memory_budget"),
        ({"memory_budget": 0}, ValueError, "memory_budget"),
        ({"memory_budget": 1.5}, TypeError, "memory_budget"),
        ({"spill_dir": 5, "memory_budget": 4096}, TypeError, "spill_dir"),
        ({"high_watermark": 0.5, "low_watermark": 0.7}, ValueError, "watermark"),
        ({"high_watermark": 1.5}, ValueError, "watermark"),
        ({"low_watermark": 0.0}, ValueError, "watermark"),
        ({"page_rows": 2**24 + 1}, ValueError, "page_rows"),
        ({"page_rows": 0}, ValueError, "page_rows"),
        ({"optimizer": "lamb"}, ValueError, r"optimizer\.kind must be one of"),
        ({"optimizer": "momentum_sgd"}, ValueError, "'sgd', 'adagrad', 'rowwise_adagrad', 'adam'"),
        ({"optimizer": 5}, TypeError, "optimizer must be"),
        ({"optimizer": {"kind": "adam", "lr": 0.1}}, ValueError, "unknown field"),
        ({"optimizer": {"kind": "adam", "beta1": 1.0}}, ValueError, r"optimizer\.beta1"),
        ({"optimizer": {"kind": "adam", "beta2": -0.1}}, ValueError, r"optimizer\.beta2"),
        ({"optimizer": {"kind": "adam", "eps": float("nan")}}, ValueError, r"optimizer\.eps"),
        ({"optimizer": {"kind": "adam", "eps": 1e39}}, ValueError, r"optimizer\.eps"),
        ({"optimizer": {"kind": "adagrad", "eps": "1e-8"}}, TypeError, r"optimizer\.eps"),
        ({"optimizer": {"kind": "sgd", "weight_decay": -1.0}}, ValueError, "weight_decay"),
        (
            {"optimizer": {"kind": "adagrad", "initial_accumulator_value": float("inf")}},
            ValueError,
            "initial_accumulator_value",
        ),
    ],
)
def test_constructor_errors(kwargs: dict[str, Any], exc: type, match: str) -> None:
    args = {"dim": 4, **INIT}
    args.update(kwargs)
    dim = args.pop("dim")
    with pytest.raises(exc, match=match):
        EmbeddingStore(dim=dim, **args)


def test_spill_dir_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="spill_dir"):
        EmbeddingStore(dim=4, **INIT, memory_budget=4096, spill_dir=tmp_path / "f")


def _store(**kw: Any) -> EmbeddingStore:
    s = EmbeddingStore(dim=4, **INIT, **kw)
    s.assign(torch.tensor([1, 2, 3]), torch.arange(12, dtype=torch.float32).view(3, 4))
    return s


def _state(s: EmbeddingStore) -> tuple[int, bytes]:
    return len(s), s.lookup(torch.arange(-5, 20), insert_missing=False).numpy().tobytes()


GOOD_KEYS = torch.tensor([1, 5])
GOOD_ROWS = torch.ones(2, 4)
BAD_KEYS = [
    ([1, 5], TypeError, "keys must be a torch.Tensor"),
    (np.array([1, 5]), TypeError, "keys must be a torch.Tensor"),
    (torch.tensor([1, 5], dtype=torch.int32), TypeError, "keys must have dtype torch.int64"),
    (torch.tensor([1.0, 5.0]), TypeError, "keys must have dtype"),
    (torch.tensor([[1, 5]]), ValueError, "keys must be 1-D"),
    (torch.tensor(3), ValueError, "keys must be 1-D"),
    (torch.arange(8)[::2], TypeError, "keys must be contiguous"),
    (torch.tensor([1, 5]).to_sparse(), TypeError, "keys must be a dense"),
]


@pytest.mark.parametrize("keys,exc,match", BAD_KEYS)
def test_bad_keys_everywhere(keys: Any, exc: type, match: str) -> None:
    s = _store()
    before = _state(s)
    calls = [
        lambda: s.lookup(keys),
        lambda: s.assign(keys, GOOD_ROWS),
        lambda: s.apply_sgd(keys, GOOD_ROWS, 0.1),
        lambda: s.contains(keys),
        lambda: s.erase(keys),
        lambda: EmbeddingStore.initial_rows(keys, dim=4, init_bound=0.1),
    ]
    for call in calls:
        with pytest.raises(exc, match=match):
            call()
    assert _state(s) == before


@pytest.mark.parametrize(
    "rows,exc,match",
    [
        (torch.ones(2, 4, dtype=torch.float64), TypeError, "float32"),
        (torch.ones(2, 5), ValueError, r"\(2, 4\)"),
        (torch.ones(3, 4), ValueError, r"\(2, 4\)"),
        (torch.ones(8), ValueError, r"\(2, 4\)"),
        (torch.ones(4, 2).t(), TypeError, "must be contiguous"),
        ("rows", TypeError, "must be a torch.Tensor"),
    ],
)
def test_bad_rows_and_grads(rows: Any, exc: type, match: str) -> None:
    s = _store()
    before = _state(s)
    with pytest.raises(exc, match=match):
        s.assign(GOOD_KEYS, rows)
    with pytest.raises(exc, match=match):
        s.apply_sgd(GOOD_KEYS, rows, 0.1)
    if exc is ValueError:  # the message names the argument
        with pytest.raises(ValueError, match=r"^rows "):
            s.assign(GOOD_KEYS, rows)
        with pytest.raises(ValueError, match=r"^grads "):
            s.apply_sgd(GOOD_KEYS, rows, 0.1)
    assert _state(s) == before


@pytest.mark.parametrize(
    "out,exc,match",
    [
        (torch.empty(2, 5), ValueError, "out must have shape"),
        (torch.empty(3, 4), ValueError, "out must have shape"),
        (torch.empty(2, 4, dtype=torch.float16), TypeError, "out must have dtype"),
        (torch.empty(4, 2).t(), TypeError, "out must be contiguous"),
        (torch.empty(2, 4, requires_grad=True), ValueError, "out must not require grad"),
        (np.empty((2, 4), dtype=np.float32), TypeError, "out must be a torch.Tensor"),
    ],
)
def test_bad_out(out: Any, exc: type, match: str) -> None:
    s = _store()
    before = _state(s)
    with pytest.raises(exc, match=match):
        s.lookup(GOOD_KEYS, out=out)
    assert _state(s) == before


@pytest.mark.parametrize(
    "lr,div,exc,match",
    [
        (float("nan"), 1, ValueError, "lr"),
        (float("inf"), 1, ValueError, "lr"),
        ("0.1", 1, TypeError, "lr"),
        (0.1, 0, ValueError, "grad_divisor"),
        (0.1, -2, ValueError, "grad_divisor"),
        (0.1, 2.0, TypeError, "grad_divisor"),
        (0.1, 2**31, ValueError, "grad_divisor"),
    ],
)
def test_bad_sgd_scalars(lr: Any, div: Any, exc: type, match: str) -> None:
    s = _store()
    before = _state(s)
    with pytest.raises(exc, match=match):
        s.apply_sgd(GOOD_KEYS, GOOD_ROWS, lr, div)
    assert _state(s) == before


def test_keys_outside_key_bound_change_nothing() -> None:
    s = _store(key_bound=10)
    before = _state_bounded(s)
    for bad in ([1, 10], [-1, 2], [2**62]):
        keys = torch.tensor(bad)
        with pytest.raises(ValueError, match=r"keys: key .* outside \[0, key_bound=10\)"):
            s.lookup(keys)
        with pytest.raises(ValueError, match="key_bound"):
            s.assign(keys, torch.ones(len(bad), 4))
        with pytest.raises(ValueError, match="key_bound"):
            s.apply_sgd(keys, torch.ones(len(bad), 4), 1.0)
        with pytest.raises(ValueError, match="key_bound"):
            s.erase(keys)
        with pytest.raises(ValueError, match="key_bound"):
            s.contains(keys)
    assert _state_bounded(s) == before


def _state_bounded(s: EmbeddingStore) -> tuple[int, bytes]:
    return len(s), s.lookup(torch.arange(0, 10), insert_missing=False).numpy().tobytes()


def test_memory_only_budget_raises_memory_error_before_writing() -> None:
    s = EmbeddingStore(dim=16, **INIT, memory_budget=2 * 4096, page_rows=64)  # two 4 KiB pages
    s.assign(torch.arange(128), torch.ones(128, 16))
    before = (len(s), s.lookup(torch.arange(200), insert_missing=False).numpy().tobytes())
    keys = torch.tensor([0, 500, 1])
    with pytest.raises(MemoryError, match="memory_budget"):
        s.apply_sgd(keys, torch.ones(3, 16), 1.0)
    with pytest.raises(MemoryError):
        s.assign(keys, torch.ones(3, 16))
    with pytest.raises(MemoryError):
        s.lookup(keys)
    assert (len(s), s.lookup(torch.arange(200), insert_missing=False).numpy().tobytes()) == before
    s.lookup(keys, insert_missing=False)  # a pure read needs no memory


def test_misc_argument_errors(tmp_path: Path) -> None:
    s = _store()
    with pytest.raises(ValueError, match="n must be >= 0"):
        s.reserve(-1)
    with pytest.raises(TypeError, match="n must be an int"):
        s.reserve(1.5)
    with pytest.raises(ValueError, match="chunk_rows"):
        next(s.export(chunk_rows=0))
    it = s.export(chunk_rows=1)
    next(it)
    s.apply_sgd(GOOD_KEYS, GOOD_ROWS, 0.1)
    with pytest.raises(ValueError, match="changed since this export started"):
        list(it)
    with pytest.raises(TypeError, match="meta"):
        s.save(tmp_path / "ck", meta={"step": 3})
    with pytest.raises(TypeError, match="meta"):
        s.save(tmp_path / "ck", meta=[("a", "b")])
    with pytest.raises(TypeError, match="path"):
        s.save(3)
    with pytest.raises(ValueError, match="path"):
        s.save("")
    s.save(tmp_path / "ck")
    with pytest.raises(TypeError, match="num_threads"):
        EmbeddingStore.load(tmp_path / "ck", num_threads="2")
    with pytest.raises(ValueError, match="num_shards"):
        EmbeddingStore.load(tmp_path / "ck", num_shards=6)
    with pytest.raises(ValueError, match="dim"):
        EmbeddingStore.initial_rows(GOOD_KEYS, dim=0, init_bound=0.1)


def _adagrad_store() -> EmbeddingStore:
    s = EmbeddingStore(dim=4, **INIT, optimizer="adagrad")
    s.apply_gradients(torch.tensor([1, 2, 3]), torch.ones(3, 4), 0.1)
    return s


def _full_state(s: EmbeddingStore) -> tuple[int, bytes, bytes]:
    w, st = s.lookup_with_state(torch.arange(-5, 20), insert_missing=False)
    return len(s), w.numpy().tobytes(), st.numpy().tobytes()


@pytest.mark.parametrize(
    "state,exc,match",
    [
        (torch.ones(2, 5), ValueError, r"state must have shape \(2, 4\)"),
        (torch.ones(3, 4), ValueError, r"state must have shape \(2, 4\)"),
        (torch.ones(2, 4, dtype=torch.float64), TypeError, "state must have dtype"),
        (torch.ones(4, 2).t(), TypeError, "state must be contiguous"),
        ([[1.0] * 4] * 2, TypeError, "state must be a torch.Tensor"),
    ],
)
def test_bad_state_changes_nothing(state: Any, exc: type, match: str) -> None:
    s = _adagrad_store()
    before = _full_state(s)
    with pytest.raises(exc, match=match):
        s.assign(GOOD_KEYS, GOOD_ROWS, state)
    out_match = match.replace("state must", "state_out must")
    with pytest.raises(exc, match=out_match):
        s.lookup_with_state(GOOD_KEYS, state_out=state)
    assert _full_state(s) == before


def test_apply_sgd_refuses_a_stateful_store_and_apply_gradients_checks_scalars() -> None:
    s = _adagrad_store()
    before = _full_state(s)
    with pytest.raises(ValueError, match="optimizer: apply_sgd needs an SGD store"):
        s.apply_sgd(GOOD_KEYS, GOOD_ROWS, 0.1)
    with pytest.raises(ValueError, match="lr"):
        s.apply_gradients(GOOD_KEYS, GOOD_ROWS, float("nan"))
    with pytest.raises(ValueError, match="grad_divisor"):
        s.apply_gradients(GOOD_KEYS, GOOD_ROWS, 0.1, 0)
    with pytest.raises(ValueError, match=r"^grads "):
        s.apply_gradients(GOOD_KEYS, torch.ones(2, 5), 0.1)
    with pytest.raises(ValueError, match="key_bound"):
        EmbeddingStore(dim=4, **INIT, key_bound=2, optimizer="adam").apply_gradients(
            GOOD_KEYS, GOOD_ROWS, 0.1
        )
    assert _full_state(s) == before


def test_optimizer_errors_at_load(tmp_path: Path) -> None:
    s = _adagrad_store()
    s.save(tmp_path / "ck")
    before = _full_state(s)
    with pytest.raises(ValueError, match=r"^optimizer\.kind: .*'adagrad'.*'adam'"):
        EmbeddingStore.load(tmp_path / "ck", optimizer="adam")
    with pytest.raises(ValueError, match=r"^optimizer\.eps"):
        EmbeddingStore.load(tmp_path / "ck", optimizer={"kind": "adagrad", "eps": 1e-3})
    with pytest.raises(ValueError, match=r"^optimizer\.weight_decay"):
        EmbeddingStore.load(tmp_path / "ck", optimizer={"kind": "adagrad", "weight_decay": 0.1})
    with pytest.raises(ValueError, match=r"optimizer\.beta1"):
        EmbeddingStore.load(tmp_path / "ck", optimizer={"kind": "adam", "beta1": 2.0})
    with pytest.raises(TypeError, match="optimizer must be"):
        EmbeddingStore.load(tmp_path / "ck", optimizer=1)
    assert _full_state(EmbeddingStore.load(tmp_path / "ck")) == before
