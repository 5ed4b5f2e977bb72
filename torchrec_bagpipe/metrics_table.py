"""Turns the runtime's per-rank, per-fused-table metrics into one summary and a table.

Input: for each rank, `bagpipe_metrics(model)` — {fused table: controller.metrics()}. Every
numeric counter is summed over ranks and fused tables; times are reported per rank (mean).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["format_table", "summarize"]

# Summary name -> the runtime's counter (docs/ARCHITECTURE.md §4.1, controller.metrics()).
_COUNTERS: dict[str, str] = {
    "accesses": "accesses",
    "hits": "hits",
    "prefetch_served": "prefetch_served",
    "demand_rows": "demand_fetched",
    "prefetch_rows": "prefetched",
    "commit_wait_s": "commit_wait_s",
    "fetched_bytes": "fetched_bytes",
    "gradient_bytes": "gradient_payload_bytes",
    "allreduce_bytes": "allreduce_payload_bytes",
    "evictions": "evictions",
    "invalidations": "invalidations",
    "runtime_critical_s": "runtime_critical_s",
    "runtime_worker_s": "runtime_worker_s",
    "runtime_worker_cpu_s": "runtime_worker_cpu_s",
    "runtime_critical_cpu_s": "runtime_critical_cpu_s",
}


def _sum_numeric(dicts: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for d in dicts:
        for k, v in d.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            totals[k] = totals.get(k, 0.0) + float(v)
    return totals


def _pick(totals: Mapping[str, float], name: str) -> float | None:
    return totals.get(_COUNTERS[name])


def summarize(per_rank: Sequence[Mapping[str, Mapping[str, Any]] | None],
              steps: int) -> dict[str, Any]:
    """Summed counters plus derived rates; {} when there is no BagPipe table."""
    ranks = [r for r in per_rank if r]
    if not ranks:
        return {}
    totals = _sum_numeric([m for r in ranks for m in r.values()])
    out: dict[str, Any] = {"counters": totals, "ranks": len(ranks)}
    accesses = _pick(totals, "accesses")
    hits = _pick(totals, "hits") or 0.0
    served = _pick(totals, "prefetch_served") or 0.0
    demand = _pick(totals, "demand_rows")
    prefetch = _pick(totals, "prefetch_rows")
    if accesses:
        out["hit_rate"] = hits / accesses
        out["served_rate"] = (hits + served) / accesses
        out["accesses"] = accesses
    fetched = (demand or 0.0) + (prefetch or 0.0)
    if demand is not None or prefetch is not None:
        out["fetched_rows"] = fetched
        out["fetched_rows_per_step"] = fetched / max(1, steps)
        out["demand_rows"] = demand or 0.0
        out["prefetch_rows"] = prefetch or 0.0
    wait = _pick(totals, "commit_wait_s")
    if wait is not None:
        out["commit_wait_s_per_rank"] = wait / len(ranks)
        out["commit_wait_ms_per_step"] = 1000.0 * wait / len(ranks) / max(1, steps)
    # Time inside the runtime per rank and step, summed over the rank's fused tables: on the
    # training thread (submit, next_step, finish_step) and on its worker threads.
    for name in ("runtime_critical", "runtime_critical_cpu", "runtime_worker",
                 "runtime_worker_cpu"):
        v = _pick(totals, f"{name}_s")
        if v is not None:
            out[f"{name}_ms"] = 1000.0 * v / len(ranks) / max(1, steps)
    for name in ("fetched_bytes", "gradient_bytes", "allreduce_bytes", "evictions",
                 "invalidations"):
        v = _pick(totals, name)
        if v is not None:
            out[name] = v
    return out


def format_table(results: Mapping[str, Any], summary: Mapping[str, Any]) -> str:
    rows: list[tuple[str, str]] = []
    if "hit_rate" in summary:
        rows.append(("cache hit rate", f"{100.0 * summary['hit_rate']:.1f} % of row accesses "
                                       f"({100.0 * summary['served_rate']:.1f} % with "
                                       "prefetched rows)"))
    if "fetched_rows" in summary:
        rows.append(("fetched rows (all ranks)",
                     f"{summary['fetched_rows']:.0f} (demand {summary['demand_rows']:.0f}, "
                     f"prefetch {summary['prefetch_rows']:.0f}; "
                     f"{summary['fetched_rows_per_step']:.1f}/step)"))
    if "commit_wait_s_per_rank" in summary:
        rows.append(("commit wait", f"{summary['commit_wait_s_per_rank']:.3f} s/rank "
                                    f"({summary['commit_wait_ms_per_step']:.2f} ms/step)"))
    if "runtime_critical_ms" in summary:
        rows.append(("runtime time per step", f"{summary['runtime_critical_ms']:.2f} ms on the "
                                              f"training thread, "
                                              f"{summary.get('runtime_worker_ms', 0.0):.2f} ms "
                                              "on workers (per rank)"))
    if "fetched_bytes" in summary:
        rows.append(("PS bytes fetched", f"{summary['fetched_bytes']:.0f}"))
    if "gradient_bytes" in summary:
        rows.append(("gradient bytes sent", f"{summary['gradient_bytes']:.0f}"))
    if summary.get("allreduce_bytes"):
        rows.append(("gradient bytes all-reduced", f"{summary['allreduce_bytes']:.0f}"))
    if results.get("prescan_seconds"):
        rows.append(("prescan", f"{results['prescan_seconds']:.3f} s"))
    rows.append(("train steps", f"{results.get('steps', 0)}"))
    rows.append(("samples/s", f"{results.get('samples_per_s', 0.0):.1f}"))
    if results.get("test_auroc") is not None:
        rows.append(("test AUROC", f"{results['test_auroc']:.4f}"))
    width = max(len(k) for k, _ in rows)
    lines = ["", "BagPipe metrics", "-" * (width + 30)]
    lines += [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines.append("-" * (width + 30))
    return "\n".join(lines)
