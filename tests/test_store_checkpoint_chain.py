"""Chained (incremental) checkpoints of EmbeddingStore (csrc/store/embedding_store_incremental.cc).

A Hypothesis state machine extends the store machine (test_store_state_machine.py: random
inserts, assigns, updates, erases, plain saves and loads vs a dict model, pages spilling)
with chained checkpoints (incremental or forced full: a compaction), reloads of the whole
chain or of an earlier point, and a model of what each checkpoint must write: exactly the
rows changed since the previous link and the keys erased, a full base when the policy says
so. Then a ``kill -9`` during an incremental write: the directory loads as the previous
complete point.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule
from test_store_state_machine import DIM, StoreMachine, bits, keys_st

from torchrec_bagpipe.ps import EmbeddingStore


class ChainMachine(StoreMachine):
    """The store machine plus a checkpoint chain in ``<dir>/chain`` and a model of it."""

    def __init__(self) -> None:
        super().__init__()
        self.chain = f"{self.dir}/chain"
        self.full_every = 8
        self.fraction = 0.5
        self.dirty: set[int] = set()      # keys stored or changed since the last link
        self.erased: set[int] = set()     # keys erased since then, while the chain is open
        self.raw_deleted = 0              # erase events counted by the store's estimate
        self.chain_open = False           # the live store extends the chain on disk
        self.links = 0
        self.base_bytes = 0
        self.chain_bytes = 0
        self.ck_step = 0
        self.pending: tuple[Any, ...] | None = None  # begun, not yet written (see _begin)
        # What each link of the chain on disk holds: (rows, state, meta).
        self.points: list[tuple[dict[int, np.ndarray], dict[int, np.ndarray], dict[str, str]]] = []

    @initialize(full_every=st.sampled_from([1, 2, 3, 8]), fraction=st.sampled_from([0.3, 2.0]))
    def policy(self, full_every: int, fraction: float) -> None:
        self.full_every, self.fraction = full_every, fraction

    def per_row(self) -> int:
        return 8 + 4 * DIM + 4 * self.state_dim

    # ---- the store machine's writes, with their change tracking ------------------------
    @rule(keys=keys_st, insert=st.booleans(), with_state=st.booleans())
    def lookup(self, keys: list[int], insert: bool, with_state: bool) -> None:
        before = set(self.rows)
        super().lookup(keys, insert, with_state)
        self.dirty |= set(self.rows) - before

    @rule(data=st.data(), keys=keys_st, with_state=st.booleans())
    def assign(self, data: st.DataObject, keys: list[int], with_state: bool) -> None:
        super().assign(data, keys, with_state)
        self.dirty |= set(keys)

    @rule(data=st.data(), keys=keys_st, lr=st.sampled_from([0.01, 0.5, 1.0, 3.0]),
          divisor=st.integers(1, 4))
    def apply_gradients(self, data: st.DataObject, keys: list[int], lr: float,
                        divisor: int) -> None:
        super().apply_gradients(data, keys, lr, divisor)
        self.dirty |= set(keys)

    @precondition(lambda self: self.spec.kind == "sgd" and self.spec.weight_decay == 0.0)
    @rule(data=st.data(), keys=keys_st, lr=st.sampled_from([0.01, 0.5, 1.0, 3.0]),
          divisor=st.integers(1, 4))
    def apply_sgd(self, data: st.DataObject, keys: list[int], lr: float, divisor: int) -> None:
        super().apply_sgd(data, keys, lr, divisor)
        self.dirty |= set(keys)

    @rule(keys=keys_st)
    def erase(self, keys: list[int]) -> None:
        present = {k for k in keys if k in self.rows}
        super().erase(keys)
        self.dirty -= present
        if self.chain_open:
            self.erased |= present
            self.raw_deleted += len(present)

    @precondition(lambda self: self.saved is not None and self.pending is None)
    @rule(threads=st.sampled_from([1, 2]), shards=st.sampled_from([1, 8]))
    def load(self, threads: int, shards: int) -> None:
        super().load(threads, shards)
        # A plain checkpoint's store: every row was just stored, no chain to extend.
        self.dirty = set(self.rows)
        self.erased, self.raw_deleted, self.chain_open = set(), 0, False

    # ---- chained checkpoints ------------------------------------------------------------
    def _begin(self, full: bool) -> None:
        """Begins a chained checkpoint (`full`: forced, a compaction), predicted exactly:
        the snapshot is the model now, and tracking restarts from it."""
        self.ck_step += 1
        meta = {"ck": str(self.ck_step)}
        stored = set(self.rows)
        changed = self.dirty & stored
        estimate = (self.chain_bytes + len(changed) * self.per_row() + 8 * self.raw_deleted)
        incremental = (not full and self.chain_open and self.links - 1 < self.full_every
                       and float(estimate) <= self.fraction * float(self.base_bytes))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pending = self.store.begin_checkpoint(
                self.chain, self.ck_step, meta, incremental=not full,
                full_every=self.full_every, chain_fraction=self.fraction)
        assert (pending.incremental, pending.step) == (incremental, self.ck_step), estimate
        point = ({k: v.copy() for k, v in self.rows.items()},
                 {k: v.copy() for k, v in self.state.items()}, meta)
        self.pending = (pending, incremental, point, stored, changed, self.erased - stored)
        self.dirty, self.erased, self.raw_deleted, self.chain_open = set(), set(), 0, True

    def _write(self) -> None:
        assert self.pending is not None
        pending, incremental, point, stored, changed, deleted = self.pending
        self.pending = None
        r = pending.write()
        assert r["incremental"] == incremental
        if incremental:
            assert (r["rows"], r["deletions"]) == (len(changed), len(deleted))
            assert r["bytes"] == len(changed) * self.per_row() + 8 * len(deleted)
            self.links += 1
            self.chain_bytes += r["bytes"]
            self.points.append(point)
        else:
            assert (r["rows"], r["deletions"]) == (len(stored), 0)
            self.links, self.chain_bytes = 1, 0
            self.base_bytes = len(stored) * self.per_row()
            self.points = [point]
        assert (r["links"], r["base_bytes"], r["chain_bytes"]) == (
            self.links, self.base_bytes, self.chain_bytes)
        info = EmbeddingStore.checkpoint_info(self.chain)
        assert [link["meta"] for link in info["chain"]] == [p[2] for p in self.points]
        assert info["rows"] == len(stored) and info["meta"] == point[2]

    @precondition(lambda self: self.pending is None)
    @rule(full=st.booleans())
    def checkpoint(self, full: bool) -> None:
        self._begin(full)
        self._write()

    # Non-blocking checkpoints: rules run between the snapshot and its write.
    @precondition(lambda self: self.pending is None)
    @rule(full=st.booleans())
    def begin_checkpoint(self, full: bool) -> None:
        self._begin(full)

    @precondition(lambda self: self.pending is not None)
    @rule()
    def write_checkpoint(self) -> None:
        """The write holds the snapshot exactly, whatever ran since its begin."""
        self._write()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._check_point(EmbeddingStore.load(self.chain, **self._open_kwargs()),
                              self.links - 1)

    @precondition(lambda self: self.pending is not None)
    @rule()
    def drop_checkpoint(self) -> None:
        """Dropped unwritten: an increment's changes are tracked again (the next checkpoint
        extends the chain with them); after a base, the next is a full base."""
        pending, incremental, _, _, changed, deleted = self.pending
        self.pending = None
        pending.drop()
        if incremental:
            self.dirty |= changed & set(self.rows)
            self.erased |= deleted
            self.raw_deleted += len(deleted)
        else:
            self.chain_open = False

    @precondition(lambda self: self.pending is not None)
    @rule()
    def second_checkpoint_is_refused(self) -> None:
        with pytest.raises(ValueError, match="still being written"):
            self.store.checkpoint(self.chain, self.ck_step + 1, {})

    def _check_point(self, store: EmbeddingStore, link: int) -> None:
        rows, state, meta = self.points[link]
        assert store.meta == meta
        assert len(store) == len(rows)
        for k, r, x in store.export(chunk_rows=13, with_state=True):
            for key, row, s in zip(k.tolist(), r.numpy(), x.numpy()):
                assert np.array_equal(bits(row), bits(rows[key]))
                assert np.array_equal(bits(s), bits(state[key]))

    @precondition(lambda self: self.links > 0 and self.pending is None)
    @rule(data=st.data(), threads=st.sampled_from([1, 2]), shards=st.sampled_from([1, 8]))
    def reload_chain(self, data: st.DataObject, threads: int, shards: int) -> None:
        """Loads the whole chain (the machine goes on with it: it extends the chain) or an
        earlier link (checked, then dropped)."""
        link = data.draw(st.integers(0, self.links - 1), label="link")
        kwargs = {**self._open_kwargs(), "num_threads": threads, "num_shards": shards}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if link + 1 < self.links:
                self._check_point(EmbeddingStore.load(self.chain, chain_links=link + 1,
                                                      **kwargs), link)
                return
            store = EmbeddingStore.load(self.chain, **kwargs)
        self._check_point(store, link)
        self.threads, self.shards, self.store = threads, shards, store
        rows, state, _ = self.points[link]
        self.rows = {k: v.copy() for k, v in rows.items()}
        self.state = {k: v.copy() for k, v in state.items()}
        self.dirty, self.erased, self.raw_deleted, self.chain_open = set(), set(), 0, True

    @invariant()
    def dirty_rows_are_the_changed_rows(self) -> None:
        if hasattr(self, "store"):
            assert self.store.stats()["dirty_rows"] == len(self.dirty & set(self.rows))


ChainMachine.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestChainMachine = ChainMachine.TestCase


def test_checkpoint_arguments_are_checked(tmp_path: Path) -> None:
    s = EmbeddingStore(dim=4, init="zeros")
    with pytest.raises(ValueError, match="full_every"):
        s.checkpoint(tmp_path / "c", 0, full_every=0)
    with pytest.raises(ValueError, match="chain_fraction"):
        s.checkpoint(tmp_path / "c", 0, chain_fraction=0.0)
    with pytest.raises(TypeError, match="meta"):
        s.checkpoint(tmp_path / "c", 0, meta={"a": 1})  # type: ignore[dict-item]
    assert not (tmp_path / "c").exists()
    assert s.checkpoint(tmp_path / "c", 0)["links"] == 1
    with pytest.raises(ValueError, match="chain_links"):
        EmbeddingStore.load(tmp_path / "c", chain_links=2)


# ---- kill -9 during an incremental write --------------------------------------------------
_WRITER = textwrap.dedent("""
    import sys, torch
    from torchrec_bagpipe.ps import EmbeddingStore
    path, rows, dim = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    s = EmbeddingStore(dim=dim, init="zeros", optimizer="adagrad", num_shards=4)
    keys = torch.arange(rows, dtype=torch.int64)
    step = 0
    while True:
        # Every step touches every row: each increment is as large as the base.
        s.apply_gradients(keys, torch.full((rows, dim), 0.5), 0.1)
        step += 1
        r = s.checkpoint(path, step, {"step": str(step)}, full_every=1000, chain_fraction=1e9)
        print(step, r["incremental"], flush=True)
""")


def _expected(step: int, rows: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The writer's rows and state after `step` steps (the same ops on a store here)."""
    s = EmbeddingStore(dim=dim, init="zeros", optimizer="adagrad")
    keys = torch.arange(rows, dtype=torch.int64)
    for _ in range(step):
        s.apply_gradients(keys, torch.full((rows, dim), 0.5), 0.1)
    return s.lookup_with_state(keys, insert_missing=False)


@pytest.mark.slow
def test_kill_during_an_incremental_write_leaves_the_previous_point(tmp_path: Path) -> None:
    rows, dim = 60000, 16
    path = tmp_path / "chain"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(rows), str(dim)],
                            stdout=subprocess.PIPE, text=True, env=env,
                            cwd=Path(__file__).resolve().parents[1])
    killed_during_increment = False
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline().split()
        assert first == ["1", "False"], first  # the base
        second = proc.stdout.readline().split()
        assert second == ["2", "True"], second  # increments follow
        # Kill while the writer's temp directory holds a new link's files and no MANIFEST
        # yet: an increment is being written.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                for temp in tmp_path.glob(".chain.tmp-*"):
                    names = {p.name for p in temp.iterdir()}
                    if "MANIFEST" not in names and any(n.startswith("inc-") for n in names):
                        os.kill(proc.pid, signal.SIGKILL)
                        killed_during_increment = True
                        break
            except FileNotFoundError:  # the writer renamed or removed it meanwhile
                pass
            if killed_during_increment:
                break
            time.sleep(0.002)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert killed_during_increment, "the writer was never seen mid-increment"
    assert proc.stdout is not None
    printed = [int(line.split()[0]) for line in proc.stdout.read().splitlines()]
    last_done = printed[-1] if printed else 2
    info = EmbeddingStore.checkpoint_info(path)
    step = int(info["meta"]["step"])
    # The last complete point: the one printed, or (the kill landed after the commit, before
    # the print) the next.
    assert step in (last_done, last_done + 1), (step, last_done)
    assert len(info["chain"]) == step  # base + (step - 1) increments
    loaded = EmbeddingStore.load(path)
    got_rows, got_state = loaded.lookup_with_state(torch.arange(rows), insert_missing=False)
    want_rows, want_state = _expected(step, rows, dim)
    assert torch.equal(got_rows.view(torch.int32), want_rows.view(torch.int32))
    assert torch.equal(got_state.view(torch.int32), want_state.view(torch.int32))
    # The loaded store extends the chain; its save removes the dead writer's temp directory.
    assert loaded.checkpoint(path, step + 1, full_every=1000, chain_fraction=1e9)["incremental"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".chain.tmp-")]
    assert len(EmbeddingStore.load(path)) == rows


# ---- the PS shard's periodic checkpoints ----------------------------------------------------
def _contents(store: EmbeddingStore) -> dict[int, tuple[bytes, bytes]]:
    out = {}
    for k, r, x in store.export(with_state=True):
        for key, row, s in zip(k.tolist(), r.numpy(), x.numpy()):
            out[key] = (row.tobytes(), s.tobytes())
    return out


def test_periodic_shard_checkpoints_chain_and_restore_bitwise(tmp_path: Path) -> None:
    from torchrec_bagpipe.ps import PSClient, PSShard, ShardSpec

    spec = ShardSpec(checkpoint_dir=tmp_path / "ck", checkpoint_every=1,
                     checkpoint_full_every=3, checkpoint_chain_fraction=10.0)
    shard = PSShard(spec)
    rng = np.random.default_rng(0)
    with PSClient([shard], table="emb", dim=8, lr=0.1, init="uniform", init_bound=0.5,
                  seed=3, optimizer="adagrad", timeout=20.0) as c:
        for step in range(8):
            keys = torch.from_numpy(rng.zipf(1.2, 300).astype(np.int64) % 5000)
            c.commit(step, keys, torch.from_numpy(rng.standard_normal((300, 8), np.float32)))
    stats = shard.table_stats("emb")
    # Links 1, 2, 3, 4, then a full base (compaction) and 2, 3, 4 again.
    assert (stats["checkpoints"], stats["incremental_checkpoints"]) == (8, 6), stats
    assert stats["checkpoint_links"] == 4
    table = tmp_path / "ck" / "table-emb"
    info = EmbeddingStore.checkpoint_info(table)
    assert [link["step"] for link in info["chain"]] == [4, 5, 6, 7]
    assert info["meta"]["committed_step"] == "7"
    # Another directory gets a full checkpoint; both load as the same table.
    assert shard.checkpoint(tmp_path / "full") == {"emb": 7}
    full = EmbeddingStore.checkpoint_info(tmp_path / "full" / "table-emb")
    assert len(full["chain"]) == 1
    assert _contents(EmbeddingStore.load(table)) == _contents(
        EmbeddingStore.load(tmp_path / "full" / "table-emb"))
    restored = PSShard(spec, restore=True)
    assert restored.restored == {"emb": 7}
    keys = torch.arange(5000)
    assert torch.equal(restored.lookup("emb", keys, with_state=True).view(torch.int32),
                       shard.lookup("emb", keys, with_state=True).view(torch.int32))
    shard.close()
    restored.close()


def test_background_shard_checkpoints_hold_exactly_their_step(tmp_path: Path) -> None:
    """With checkpoint_background the periodic checkpoint of step s is written while steps
    s+1, ... commit: it still loads bitwise as the blocking checkpoint of step s."""
    from torchrec_bagpipe.ps import PSClient, PSShard, ShardSpec

    def spec(name: str, background: bool) -> ShardSpec:
        return ShardSpec(checkpoint_dir=tmp_path / name, checkpoint_every=4,
                         checkpoint_full_every=3, checkpoint_chain_fraction=10.0,
                         checkpoint_background=background)

    shards = {"bg": PSShard(spec("bg", True)), "sync": PSShard(spec("sync", False))}
    clients = {n: PSClient([s], table="emb", dim=8, lr=0.1, init="uniform", init_bound=0.5,
                           seed=3, optimizer="adam", timeout=20.0) for n, s in shards.items()}
    rng = np.random.default_rng(1)
    table = {n: tmp_path / n / "table-emb" for n in shards}
    for step in range(10):
        keys = torch.from_numpy(rng.zipf(1.1, 4000).astype(np.int64) % 50000)
        grads = torch.from_numpy(rng.standard_normal((4000, 8), np.float32))
        for c in clients.values():
            c.commit(step, keys, grads)
        if step in (5, 9):
            # An explicit checkpoint waits for the background write of step 3 (then 7).
            assert shards["bg"].checkpoint(tmp_path / f"bg-{step}") == {"emb": step}
            info = EmbeddingStore.checkpoint_info(table["bg"])
            assert info["meta"]["committed_step"] == str(step - 2)
            assert len(info["chain"]) == (1 if step == 5 else 2)
            assert _contents(EmbeddingStore.load(table["bg"])) == _contents(
                EmbeddingStore.load(table["sync"]))
    for c in clients.values():
        c.close()
    stats = shards["bg"].table_stats("emb")
    assert (stats["checkpoints"], stats["incremental_checkpoints"]) == (4, 1), stats
    # The live table moved on; the full checkpoint of step 9 is the live one.
    assert _contents(EmbeddingStore.load(tmp_path / "bg-9" / "table-emb")) != _contents(
        EmbeddingStore.load(table["bg"]))
    restored = PSShard(spec("bg", True), restore=True)
    assert restored.restored == {"emb": 7}
    for s in (*shards.values(), restored):
        s.close()


def test_a_chain_in_a_new_relative_directory_extends(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A first checkpoint into a relative path that does not exist yet starts a chain the
    next checkpoint extends ("ck", "./ck" and the absolute path are one directory)."""
    monkeypatch.chdir(tmp_path)
    s = EmbeddingStore(dim=4, init="uniform", init_bound=0.1, optimizer="adagrad")
    s.apply_gradients(torch.arange(50), torch.ones(50, 4), 0.1)
    assert not s.checkpoint("ck", 0)["incremental"]
    for step, path in enumerate(["ck", "./ck", str(tmp_path / "ck")], start=1):
        s.apply_gradients(torch.arange(step), torch.ones(step, 4), 0.1)
        pending = s.begin_checkpoint(path, step)
        assert pending.incremental, path
        assert pending.write()["links"] == step + 1
    assert _contents(EmbeddingStore.load("ck")) == _contents(s)
