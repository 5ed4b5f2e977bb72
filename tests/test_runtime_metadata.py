"""BagPipeCacheMetadata against a plain-Python model (RuleBasedStateMachine), plus argument errors.

The model is written from the contract in csrc/cache/cache_metadata.h: slots handed out from
a LIFO free stack (0, 1, 2, ... first), eviction queues per next use (oracle) or one LRU
queue, pins through a step, stale detection by version. Every call's outputs and the whole
slot table are compared after every rule.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from torchrec_bagpipe._native import C

NEVER = 2**63 - 1


class ModelMetadata:
    def __init__(self, units: int, policy: str) -> None:
        self.cap = units * 64
        self.policy = policy
        self.step = -1
        self.seq = 0
        self.stats = dict(evictions=0, bypassed=0, stale=0, invalidations=0, admitted=0)
        self.clear()

    def clear(self) -> None:
        self.s = [self._blank() for _ in range(self.cap)]
        self.map: dict[int, int] = {}
        self.free = list(range(self.cap - 1, -1, -1))
        self.buckets: dict[int, list[int]] = {}
        self.pinned: list[tuple[int, int]] = []

    @staticmethod
    def _blank() -> dict:
        return dict(key=-1, state="free", version=-1, next_use=NEVER, pin_step=-1,
                    pinned=False, pin_seq=0, queued=False, bucket=0)

    def _bucket_of(self, nu: int) -> int:
        return 0 if self.policy == "lru" else nu

    def _enqueue(self, slot: int) -> None:
        s = self.s[slot]
        s["bucket"] = self._bucket_of(s["next_use"])
        self.buckets.setdefault(s["bucket"], []).append(slot)
        s["queued"] = True

    def _dequeue(self, slot: int) -> None:
        s = self.s[slot]
        lst = self.buckets[s["bucket"]]
        lst.remove(slot)
        if not lst:
            del self.buckets[s["bucket"]]
        s["queued"] = False

    def _is_pinned(self, s: dict) -> bool:
        return s["pinned"] and s["pin_step"] >= self.step

    def _pin(self, slot: int, pin_step: int) -> None:
        s = self.s[slot]
        if s["queued"]:
            self._dequeue(slot)
        s["pin_step"] = max(s["pin_step"], pin_step) if self._is_pinned(s) else pin_step
        s["pinned"] = True
        self.seq += 1
        s["pin_seq"] = self.seq
        self.pinned.append((slot, self.seq))

    def _free(self, slot: int) -> None:
        s = self.s[slot]
        if s["queued"]:
            self._dequeue(slot)
        del self.map[s["key"]]
        self.s[slot] = self._blank()
        self.free.append(slot)

    def _pick(self, nu: int) -> int:
        if self.free:
            return self.free.pop()
        if not self.buckets:
            return -1
        b = min(self.buckets) if self.policy == "lru" else max(self.buckets)
        victim = self.buckets[b][0]
        v = self.s[victim]["next_use"]
        if self.policy == "oracle" and (v < nu or (v == nu and nu != NEVER)):
            return -1
        return victim

    def _place(self, slot, key, version, nu, pin_step, state) -> None:
        s = self.s[slot]
        s.update(key=key, version=version, next_use=nu, state=state)
        self.map[key] = slot
        self._pin(slot, pin_step)

    def victim_order(self) -> list[int]:
        keys = sorted(self.buckets) if self.policy == "lru" else sorted(self.buckets, reverse=True)
        return [slot for b in keys for slot in self.buckets[b]]

    # ---- operations ----------------------------------------------------------------------
    def advance(self, step: int) -> None:
        self.step = step
        keep = []
        for slot, seq in self.pinned:
            s = self.s[slot]
            if not s["pinned"] or s["pin_seq"] != seq:
                continue
            if s["pin_step"] >= step:
                keep.append((slot, seq))
                continue
            s["pinned"] = False
            if s["next_use"] <= step:
                s["next_use"] = NEVER
            self._enqueue(slot)
        self.pinned = keep
        if self.policy == "oracle":
            while self.buckets and min(self.buckets) <= step:
                b = min(self.buckets)
                lst = self.buckets.pop(b)
                for slot in lst:
                    self.s[slot]["queued"] = False
                    self.s[slot]["next_use"] = NEVER
                    self._enqueue(slot)

    def query(self, keys, versions, nus):
        hit_pos, hit_slots, miss_pos, stale = [], [], [], 0
        for i, k in enumerate(keys):
            slot = self.map.get(k)
            if slot is None:
                miss_pos.append(i)
                continue
            s = self.s[slot]
            if s["version"] != versions[i]:
                stale += 1
                self.stats["stale"] += 1
                self._free(slot)
                miss_pos.append(i)
                continue
            s["next_use"] = NEVER if nus[i] < 0 else nus[i]
            if s["queued"]:
                self._dequeue(slot)
                self._enqueue(slot)
            hit_pos.append(i)
            hit_slots.append(slot)
        return hit_pos, hit_slots, miss_pos, stale

    def _evict_into(self, slot, evicted) -> None:
        if self.s[slot]["state"] != "free":
            evicted.append(self.s[slot]["key"])
            self.stats["evictions"] += 1
            self._free(slot)
            self.free.pop()

    def admit(self, keys, versions, nus):
        pos, slots, evicted, bypassed = [], [], [], []
        for i, k in enumerate(keys):
            nu = NEVER if nus[i] < 0 else nus[i]
            slot = self._pick(nu)
            if slot < 0:
                self.stats["bypassed"] += 1
                bypassed.append(i)
                continue
            self._evict_into(slot, evicted)
            self._place(slot, k, versions[i], nu, self.step, "ready")
            self.stats["admitted"] += 1
            pos.append(i)
            slots.append(slot)
        return pos, slots, evicted, bypassed

    def lookup(self, keys):
        return [self.map.get(k, -1) for k in keys]

    def resident(self, keys, versions):
        out = []
        for k, v in zip(keys, versions):
            slot = self.map.get(k)
            out.append(slot if slot is not None and self.s[slot]["version"] == v else -1)
        return out

    def set_version(self, slots, version) -> None:
        for slot in slots:
            self.s[slot]["version"] = version

    def pin(self, slots, pin_step) -> None:
        for slot in slots:
            self._pin(slot, pin_step)

    def note_uses(self, keys, step) -> None:
        if self.policy != "oracle":
            return
        for k in keys:
            slot = self.map.get(k)
            if slot is None:
                continue
            s = self.s[slot]
            if s["next_use"] <= step:
                continue
            s["next_use"] = step
            if s["queued"]:
                self._dequeue(slot)
                self._enqueue(slot)

    def invalidate(self, keys):
        freed = []
        for k in keys:
            slot = self.map.get(k)
            if slot is None:
                continue
            self._free(slot)
            freed.append(slot)
            self.stats["invalidations"] += 1
        return freed


def a64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.int64)


UNIVERSE = 160


class MetadataMachine(RuleBasedStateMachine):
    @initialize(units=st.sampled_from([1, 2]), policy=st.sampled_from(["lru", "oracle"]),
                direct=st.booleans())
    def setup(self, units: int, policy: str, direct: bool) -> None:
        # direct: key_bound = the universe (the direct key index); else the hash index.
        bound = UNIVERSE if direct else -1
        self.native = C.BagPipeCacheMetadata(units, policy, key_bound=bound)
        assert self.native.direct_index == direct
        self.model = ModelMetadata(units, policy)
        self.step = 0
        self.native.advance(0)
        self.model.advance(0)

    def _keys(self, data, max_n: int, min_n: int = 0) -> list[int]:
        # Large batches (up to ~1.7x the smallest cache) over a small universe: the cache
        # fills, evicts and bypasses; skewed so that hot keys hit.
        n = data.draw(st.integers(min_n, max_n))
        seed = data.draw(st.integers(0, 2**16))
        rng = np.random.default_rng(seed)
        weights = 1.0 / np.arange(1, UNIVERSE + 1) ** 0.7
        picked = rng.choice(UNIVERSE, size=n, replace=False, p=weights / weights.sum())
        return [int(k) for k in picked]

    def _versions(self, data, keys) -> list[int]:
        out = []
        for k in keys:
            slot = self.model.map.get(k)
            current = self.model.s[slot]["version"] if slot is not None else -1
            out.append(data.draw(st.sampled_from([current, current, current, current + 1])))
        return out

    def _nus(self, data, n: int) -> list[int]:
        return [data.draw(st.sampled_from([-1, *range(self.step + 1, self.step + 7)]))
                for _ in range(n)]

    @rule(gap=st.integers(1, 2))
    def advance(self, gap: int) -> None:
        self.step += gap
        self.native.advance(self.step)
        self.model.advance(self.step)

    @rule(data=st.data())
    def query_and_admit(self, data) -> None:
        keys = self._keys(data, 110, 40)
        vers = self._versions(data, keys)
        nus = self._nus(data, len(keys))
        got = self.native.query(a64(keys), a64(vers), a64(nus))
        want = self.model.query(keys, vers, nus)
        for g, w in zip(got[:3], want[:3]):
            assert g.tolist() == w
        assert got[3] == want[3]
        miss = [keys[i] for i in want[2]]
        # The controller admits soonest next use first; any order must keep the contract.
        if data.draw(st.booleans()):
            miss.sort(key=lambda k: (nus[keys.index(k)] < 0, nus[keys.index(k)]))
        mv = [vers[keys.index(k)] for k in miss]
        mn = [nus[keys.index(k)] for k in miss]
        got_a = self.native.admit(a64(miss), a64(mv), a64(mn))
        want_a = self.model.admit(miss, mv, mn)
        for g, w in zip(got_a, want_a):
            assert g.tolist() == w
        assert len(set(want_a[1])) == len(want_a[1])  # unique destinations

    @rule(data=st.data())
    def resident(self, data) -> None:
        keys = self._keys(data, 60)
        vers = self._versions(data, keys)
        assert self.native.resident(a64(keys), a64(vers)).tolist() == self.model.resident(
            keys, vers)

    @rule(data=st.data())
    def invalidate(self, data) -> None:
        keys = self._keys(data, 60)
        assert self.native.invalidate(a64(keys)).tolist() == self.model.invalidate(keys)

    @rule(data=st.data())
    def update_and_pin(self, data) -> None:
        keys = self._keys(data, 40)
        slots = [s for s in self.model.lookup(keys) if s >= 0]
        assert self.native.lookup(a64(keys)).tolist() == self.model.lookup(keys)
        self.native.set_version(a64(slots), self.step)
        self.model.set_version(slots, self.step)
        if data.draw(st.booleans()):
            self.native.pin(a64(slots), self.step + 1)
            self.model.pin(slots, self.step + 1)

    @rule(data=st.data(), ahead=st.integers(1, 6))
    def note_uses(self, data, ahead: int) -> None:
        keys = self._keys(data, 60)
        self.native.note_uses(a64(keys), self.step + ahead)
        self.model.note_uses(keys, self.step + ahead)

    @rule(really=st.integers(0, 9))
    def clear_rarely(self, really: int) -> None:
        if really == 0:
            self.native.clear()
            self.model.clear()

    @invariant()
    def same_state(self) -> None:
        if not hasattr(self, "native"):
            return
        for slot in range(self.model.cap):
            key, state, version, nu, pin = self.native.slot(slot)
            s = self.model.s[slot]
            assert (key, state) == (s["key"], s["state"]), slot
            if state != "free":
                assert version == s["version"]
                assert pin == s["pin_step"]
                assert nu == (-1 if s["next_use"] == NEVER else s["next_use"])
        assert self.native.victim_order().tolist() == self.model.victim_order()
        st_ = self.native.stats()
        assert st_["resident"] == len(self.model.map) <= self.native.capacity_rows
        for k, v in self.model.stats.items():
            assert st_[k] == v, k


TestMetadataMachine = MetadataMachine.TestCase
TestMetadataMachine.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def test_metadata_argument_errors_name_the_argument() -> None:
    m = C.BagPipeCacheMetadata(1, "lru")
    m.advance(0)
    with pytest.raises(TypeError, match="keys must have dtype int64"):
        m.query(np.zeros(2, dtype=np.int32), a64([0, 0]), a64([0, 0]))
    with pytest.raises(TypeError, match="versions must have dtype int64"):
        m.resident(a64([1]), np.zeros(1, dtype=np.float32))
    with pytest.raises(ValueError, match="versions must have the length of keys"):
        m.query(a64([1, 2]), a64([0]), a64([0, 0]))
    with pytest.raises(ValueError, match="must be 1-D"):
        m.admit(np.zeros((2, 2), dtype=np.int64), a64([0, 0]), a64([0, 0]))
    with pytest.raises(ValueError, match="keys must be unique"):
        m.query(a64([3, 3]), a64([0, 0]), a64([0, 0]))
    with pytest.raises(ValueError, match="capacity_units must be >= 1"):
        C.BagPipeCacheMetadata(0, "lru")
    with pytest.raises(ValueError, match="eviction policy"):
        C.BagPipeCacheMetadata(1, "fifo")
    with pytest.raises(ValueError, match="outside"):
        m.set_version(a64([64]), 0)
    with pytest.raises(ValueError, match="is free"):
        m.pin(a64([3]), 1)
    assert len(m) == 0  # nothing changed


@pytest.mark.parametrize("bound", [1000, 1 << 40])  # the direct index, then the hash index
def test_metadata_key_bound_rejects_keys_outside_the_table(bound: int) -> None:
    m = C.BagPipeCacheMetadata(1, "oracle", key_bound=bound)
    assert m.key_bound == bound
    assert m.direct_index == (bound == 1000)
    assert not C.BagPipeCacheMetadata(1, "oracle").direct_index  # no bound: hash index
    m.advance(0)
    m.admit(a64([3, bound - 1]), a64([-1, -1]), a64([-1, -1]))
    for call in (lambda k: m.query(k, a64([-1, -1]), a64([-1, -1])),
                 lambda k: m.admit(k, a64([-1, -1]), a64([-1, -1])),
                 m.lookup, lambda k: m.resident(k, a64([-1, -1])),
                 lambda k: m.note_uses(k, 2), m.invalidate):
        with pytest.raises(ValueError, match=rf"keys\[1\] = {bound} is outside the key bound"):
            call(a64([5, bound]))
    assert len(m) == 2  # nothing changed
    hit_pos, _, miss_pos, _ = m.query(a64([3, 5]), a64([-1, -1]), a64([-1, -1]))
    assert hit_pos.tolist() == [0] and miss_pos.tolist() == [1]
