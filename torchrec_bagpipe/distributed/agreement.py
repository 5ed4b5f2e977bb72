"""Open-time agreement: before a sharded module opens anything on the PS, its ranks compare
what they are about to open and fail together, with one message naming the differing field
and the ranks, instead of surfacing a mismatch later as one rank's error and the others'
timeouts.

What is compared is generic: every field of the module's fused table specs (types.py, whatever
fields they have: dims, rows, learning rates, init bounds, pooling, features, and any field a
later spec adds, such as an optimizer and its hyper-parameters), every BagPipeConfig field
that must be the same on every rank, and the job's PS deployment (shard count,
partitioner, gradient division). Nested dataclasses, dicts and sequences are flattened into
dotted paths (``fused[0].tables[1].num_embeddings``), so a new field is covered by adding it,
not code. A rank whose own set-up failed takes part with its error instead: every rank then
raises, naming that rank and its error.

Thread-safety: runs on the training thread during sharding; every rank calls it once per
sharded module, in the same order (it is a collective on the job's control group).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

__all__ = ["SpecMismatchError", "agree_before_open", "config_fields", "describe", "flatten",
           "redact"]

# BagPipeConfig fields that are a process's own resources and may differ between ranks.
PER_RANK_FIELDS = frozenset({"memory_budget", "spill_dir", "store_threads"})
# Fields compared by digest only: their values never appear in a message.
SECRET_FIELDS = frozenset({"job_token"})


def redact(value: object) -> object:
    """A secret as a short digest (equal secrets compare equal; the text never shows)."""
    if value is None:
        return None
    return "digest:" + hashlib.blake2b(str(value).encode(), digest_size=4).hexdigest()


def config_fields(config: Any, names: Sequence[str] | None = None) -> dict[str, Any]:
    """`config`'s fields (all but the per-rank ones, or `names`), secrets redacted."""
    picked = names if names is not None else [
        f.name for f in dataclasses.fields(config) if f.name not in PER_RANK_FIELDS]
    return {n: redact(getattr(config, n)) if n in SECRET_FIELDS else getattr(config, n)
            for n in picked}


class SpecMismatchError(ValueError):
    """The ranks of a job disagree on what to open on the PS (or one of them failed to)."""


class _GatherObjects(Protocol):
    rank: int

    def all_gather_object(self, obj: object) -> list[object]: ...


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """`value` as {dotted path: leaf}: dataclass fields and mapping keys by name, sequence
    items by index; ints, floats, strings, bools and None are leaves, enums their name,
    anything else its repr."""
    out: dict[str, Any] = {}

    def walk(v: Any, path: str) -> None:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            for f in dataclasses.fields(v):
                walk(getattr(v, f.name), f"{path}.{f.name}" if path else f.name)
        elif isinstance(v, Mapping):
            for k in v:
                walk(v[k], f"{path}.{k}" if path else str(k))
        elif isinstance(v, (list, tuple)):
            out[f"{path}.len" if path else "len"] = len(v)
            for i, item in enumerate(v):
                walk(item, f"{path}[{i}]")
        elif isinstance(v, enum.Enum):
            out[path] = v.name
        elif v is None or isinstance(v, (bool, int, float, str)):
            out[path] = v
        else:
            out[path] = repr(v)

    walk(value, prefix)
    return out


def describe(tables: Sequence[Any], fused: Sequence[Any], config: Any,
             deployment: Mapping[str, Any]) -> dict[str, Any]:
    """What every rank must agree on before opening `fused` (flattened): the module's table
    specs first (so a difference is named where it starts, e.g. ``tables[0].dim``, before
    the fused tables derived from them), the fused table specs, the shared config fields and
    the deployment."""
    return flatten({"tables": list(tables), "fused": list(fused),
                    "config": config_fields(config), "deployment": dict(deployment)})


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


_ABSENT = object()


def agree_before_open(collectives: _GatherObjects, description: Mapping[str, Any] | None, *,
                      where: str, error: BaseException | None = None) -> None:
    """Every rank's `description` (or its set-up `error`) is compared; if they differ, or a
    rank failed, every rank raises (this rank's own error re-raised as is, the others a
    SpecMismatchError naming it)."""
    mine = (None if error is not None else dict(description or {}),
            None if error is None else f"{type(error).__name__}: {error}")
    everyone = collectives.all_gather_object(mine)
    failed = [(r, e[1]) for r, e in enumerate(everyone) if e[1] is not None]  # type: ignore[index]
    if error is not None:
        raise error
    if failed:
        r, text = failed[0]
        raise SpecMismatchError(f"{where}: rank {r} could not set up its tables ({text}); "
                                "no rank opens them")
    descs: list[dict[str, Any]] = [e[0] for e in everyone]  # type: ignore[index,misc]
    paths: list[str] = []
    seen: set[str] = set()
    for d in descs:
        for p in d:
            if p not in seen:
                seen.add(p)
                paths.append(p)
    diffs: list[str] = []
    for p in paths:
        values = [d.get(p, _ABSENT) for d in descs]
        if all(_same(v, values[0]) for v in values[1:]):
            continue
        groups: list[tuple[Any, list[int]]] = []
        for r, v in enumerate(values):
            for g in groups:
                if _same(g[0], v):
                    g[1].append(r)
                    break
            else:
                groups.append((v, [r]))
        diffs.append(f"{p} is " + " but ".join(
            ("absent" if v is _ABSENT else repr(v)) + f" on rank{'s' if len(rs) > 1 else ''} "
            + ", ".join(map(str, rs)) for v, rs in groups))
    if diffs:
        more = f" (and {len(diffs) - 3} more differences)" if len(diffs) > 3 else ""
        raise SpecMismatchError(
            f"{where}: the ranks disagree before opening their tables on the PS: "
            + "; ".join(diffs[:3]) + more
            + ". Every rank must build the same model, sharding plan and BagPipeConfig."
        )
