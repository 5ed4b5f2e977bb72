"""What a BagPipe table costs a step over the PS link, for the planners' perf estimates.

The link model is the benchmarks' (`benchmarks/e2e_dlrm.py`, `model_step`): a link is a
round trip, a bandwidth and a window of gets in flight; per rank and step a BagPipe table
fetches the rows it misses in the cache (prefetched: a window of gets in flight, 8 key bytes
per row plus the row) and commits one gradient row per unique id (one round trip plus the
bytes). The expected misses follow the cache's share of the table's rows (ids spread over
the rows; the online planner's hit rate is at least this).

Times are in milliseconds, the unit of TorchRec's `Perf`, so a BagPipe option's estimate
adds up with the stock options' estimates in TorchRec's planner. Pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_PS_LINK", "PS_LINKS", "Link", "StepTraffic", "step_traffic"]

_KEY_BYTES = 8
_FP32_BYTES = 4


@dataclass(frozen=True)
class Link:
    """A network between a trainer and the PS: round trip, bandwidth, window."""

    name: str
    rtt_s: float
    bytes_per_s: float
    window: int  # gets in flight before waiting for replies

    def fetch_ms(self, rows: float, row_bytes: float, gets: float) -> float:
        """Prefetching `rows` rows of `row_bytes` bytes in `gets` gets."""
        return 1e3 * (gets * self.rtt_s / self.window
                      + rows * (row_bytes + _KEY_BYTES) / self.bytes_per_s)

    def commit_ms(self, nbytes: float) -> float:
        """One commit of `nbytes` bytes."""
        return 1e3 * (self.rtt_s + nbytes / self.bytes_per_s)


# The benchmarks' presets (benchmarks/e2e_dlrm.py PRESETS).
PS_LINKS = {
    "25GbE-TCP": Link("25GbE-TCP", rtt_s=50e-6, bytes_per_s=25e9 / 8 * 0.9, window=8),
    "100Gb-RDMA": Link("100Gb-RDMA", rtt_s=5e-6, bytes_per_s=100e9 / 8 * 0.95, window=32),
}
DEFAULT_PS_LINK = PS_LINKS["25GbE-TCP"]


@dataclass(frozen=True)
class StepTraffic:
    """One rank's step of one BagPipe table over the PS link."""

    lookups: float  # ids looked up
    unique: float  # distinct rows read (at most the lookups and the table's rows)
    fetched_rows: float  # rows missed in the cache, fetched from the PS
    fetch_bytes: float  # bytes of those rows and their keys
    commit_bytes: float  # gradient rows and their keys sent to the PS

    @property
    def bytes(self) -> float:
        return self.fetch_bytes + self.commit_bytes


def step_traffic(lookups: float, rows: int, dim: int, cache_rows: float) -> StepTraffic:
    """The expected PS traffic of one rank's step: `lookups` ids into a `rows` x `dim` FP32
    table of which `cache_rows` rows fit in the rank's cache."""
    if rows < 1 or dim < 1 or lookups < 0 or cache_rows < 0:
        raise ValueError(f"step_traffic: bad table {rows} x {dim}, lookups {lookups}, "
                         f"cache rows {cache_rows}")
    unique = min(float(lookups), float(rows))
    hit = min(1.0, cache_rows / rows)
    fetched = unique * (1.0 - hit)
    row = dim * _FP32_BYTES + _KEY_BYTES
    return StepTraffic(lookups=float(lookups), unique=unique, fetched_rows=fetched,
                       fetch_bytes=fetched * row, commit_bytes=unique * row)
