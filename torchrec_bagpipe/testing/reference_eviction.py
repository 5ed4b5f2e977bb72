"""The virtual tables' eviction rule in plain Python: the test oracle of the native rule.

`ReferenceEvictionRule` is the rule of docs/virtual_tables.md (and of
`torchrec_bagpipe.runtime.eviction`) written as simply as possible — a dict of live keys —
so the tests compare the native `EvictionRule` / `StepPlanner` and the PS against it. The
float64 arithmetic is the native rule's, operation for operation (``count + 1.0``,
``count * decay_rate``), so decisions agree exactly.

Thread safety: none.
"""

from __future__ import annotations

from collections.abc import Iterable

from torchrec_bagpipe.runtime.eviction import EvictionSpec

__all__ = ["ReferenceEvictionRule", "admit_coin"]

_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def admit_coin(seed: int, key: int, n: int) -> float:
    """The admission coin of `key` at its n-th read step: (splitmix64 chain >> 11) * 2^-53,
    the native `AdmitCoin`."""
    h = _mix64(_mix64(_mix64(seed) ^ (key & _M64)) ^ (n & _M64))
    return (h >> 11) * 2.0**-53


class ReferenceEvictionRule:
    """Fed each step's trained keys (any iterable of ints, duplicates ignored), returns the
    sorted keys evicted at the step's boundary."""

    def __init__(self, spec: EvictionSpec | None) -> None:
        self.spec = spec if spec is not None else EvictionSpec()
        self.rows: dict[int, list[float | int]] = {}  # key -> [count, last step]
        self.created = 0
        self.evicted = 0
        self.rounds = 0
        self._last_step = -1
        self.seen: dict[int, int] = {}  # admission: steps each not-live id was read in

    @property
    def live(self) -> int:
        return len(self.rows)

    def admit(self, key: int) -> bool:
        """Admission (call once per key per step, before `on_step`): whether `key` is
        trained at this step."""
        s = self.spec
        if not s.admits or key in self.rows:
            return True
        n = self.seen.get(key, 0) + 1
        if n < s.admit_after or (s.admit_probability < 1
                                 and not admit_coin(s.admit_seed, key, n) < s.admit_probability):
            self.seen[key] = n
            return False
        self.seen.pop(key, None)
        return True

    def on_step(self, step: int, keys: Iterable[int]) -> list[int]:
        if step <= self._last_step:
            raise ValueError(f"step {step} after step {self._last_step}")
        self._last_step = step
        s = self.spec
        if not s.tracks:
            return []
        for k in {int(k) for k in keys}:
            row = self.rows.get(k)
            if row is None:
                self.rows[k] = [1.0, step]
                self.created += 1
            else:
                row[0] = float(row[0]) + 1.0
                row[1] = step
        over_cap = s.max_rows > 0 and len(self.rows) > s.max_rows
        if not s.enabled or (s.trigger_rows > 0 and len(self.rows) <= s.trigger_rows
                             and not over_cap):
            return []
        self.rounds += 1
        out = []
        for k, row in self.rows.items():
            if s.threshold > 0:
                row[0] = float(row[0]) * float(s.decay_rate)
            if row[1] == step:
                continue
            if (s.threshold > 0 and row[0] < s.threshold) or (
                    s.ttl_steps > 0 and step - int(row[1]) >= s.ttl_steps):
                out.append(k)
        gone = set(out)
        excess = len(self.rows) - len(out) - s.max_rows
        if s.max_rows > 0 and excess > 0:
            spare = sorted((int(r[1]), float(r[0]), k) for k, r in self.rows.items()
                           if k not in gone and r[1] != step)
            out.extend(k for _, _, k in spare[:excess])
        out.sort()
        for k in out:
            del self.rows[k]
        self.evicted += len(out)
        return out
