"""The DRAM budget: cold pages spill to disk and come back, values never change."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from torchrec_bagpipe.ps import EmbeddingStore
from torchrec_bagpipe.ps.store import SpillWarning

DIM = 16  # 64-byte rows
PAGE = 4096


def _spilling(tmp_path: Path, pages: int = 8, **kw: object) -> EmbeddingStore:
    return EmbeddingStore(
        dim=DIM,
        init_bound=0.1,
        seed=2,
        memory_budget=pages * PAGE,
        spill_dir=tmp_path / "spill",
        page_rows=64,
        **kw,
    )


def test_spill_keeps_residency_and_values(tmp_path: Path) -> None:
    s = _spilling(tmp_path)
    ref = EmbeddingStore(dim=DIM, init_bound=0.1, seed=2, page_rows=64)
    g = torch.Generator().manual_seed(0)
    with pytest.warns(SpillWarning, match="spill") as record:
        for _ in range(40):
            keys = torch.randint(0, 5000, (512,), generator=g)
            grads = torch.randn(512, DIM, generator=g)
            s.apply_sgd(keys, grads, 0.1)
            ref.apply_sgd(keys, grads, 0.1)
            st = s.stats()
            assert st["bytes_resident"] - st["bytes_maps"] <= 8 * PAGE
    assert len([w for w in record if issubclass(w.category, SpillWarning)]) == 1
    st = s.stats()
    assert st["pages_spilled"] > 0 and st["swap_outs"] >= st["pages_spilled"]
    assert st["spill_count"] >= 1
    assert st["bytes_spilled"] == st["pages_spilled"] * PAGE
    assert st["memory_budget"] == 8 * PAGE
    keys = torch.arange(5000)
    assert torch.equal(s.lookup(keys, insert_missing=False), ref.lookup(keys, insert_missing=False))
    # The spill file is unlinked: nothing is left visible in the spill directory.
    assert os.listdir(tmp_path / "spill") == []


def test_hot_spilled_pages_come_back(tmp_path: Path) -> None:
    s = _spilling(tmp_path, pages=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpillWarning)
        s.lookup(torch.arange(64 * 20))  # 20 pages of rows; most spill
        assert s.stats()["pages_spilled"] >= 16
        first_page_keys = torch.arange(64 * 20)[:64]
        hot = None
        for _ in range(10):
            s.lookup(first_page_keys)  # the same rows, op after op
            hot = s.stats()
    assert hot is not None and hot["swap_ins"] > 0
    assert hot["bytes_resident"] - hot["bytes_maps"] <= 4 * PAGE


def test_results_identical_across_threads_and_shards_while_spilling(tmp_path: Path) -> None:
    def run(threads: int, shards: int, budget_pages: int | None) -> bytes:
        kw = {"num_threads": threads, "num_shards": shards, "page_rows": 64}
        if budget_pages is not None:
            kw.update(memory_budget=budget_pages * PAGE, spill_dir=tmp_path / f"s{threads}{shards}")
        s = EmbeddingStore(dim=DIM, init_bound=0.1, seed=2, **kw)
        g = torch.Generator().manual_seed(5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SpillWarning)
            for step in range(25):
                keys = torch.randint(0, 3000, (700,), generator=g)
                s.apply_sgd(keys, torch.randn(700, DIM, generator=g), 0.05, 2)
                if step % 5 == 0:
                    s.erase(torch.randint(0, 3000, (100,), generator=g))
            return s.lookup(torch.arange(3000), insert_missing=False).numpy().tobytes()

    ref = run(1, 16, None)
    for threads, shards, pages in [(1, 16, 6), (2, 4, 6), (2, 1, 3), (2, 64, 30)]:
        assert run(threads, shards, pages) == ref


def test_automatic_budget_is_detected() -> None:
    s = EmbeddingStore(dim=DIM, init_bound=0.1, memory_budget="auto")
    budget = s.stats()["memory_budget"]
    assert budget > 0 and s.options()["memory_budget"] == budget
    # Half of min(cgroup limit, RAM): at most half the physical memory.
    phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert budget <= phys // 2 + 1
    s.lookup(torch.arange(100))
    assert len(s) == 100


def test_string_budgets() -> None:
    s = EmbeddingStore(dim=DIM, init_bound=0.1, memory_budget="1M")
    assert s.stats()["memory_budget"] == 1 << 20
    s = EmbeddingStore(dim=DIM, init_bound=0.1, memory_budget="0.5G")
    assert s.stats()["memory_budget"] == 1 << 29


def test_checkpoint_of_a_spilled_store(tmp_path: Path) -> None:
    s = _spilling(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpillWarning)
        s.assign(
            torch.arange(3000),
            torch.from_numpy(np.arange(3000 * DIM, dtype=np.float32).reshape(-1, DIM)),
        )
        assert s.stats()["pages_spilled"] > 0
        s.save(tmp_path / "ck")
    t = EmbeddingStore.load(tmp_path / "ck")
    assert torch.equal(t.lookup(torch.arange(3000)), s.lookup(torch.arange(3000)))
