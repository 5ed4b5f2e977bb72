"""TorchRec's virtual tables on BagPipe: placement, eviction policies, checks.

A table configured ``EmbeddingBagConfig(..., use_virtual_table=True, total_num_buckets=...,
virtual_table_eviction_policy=...)`` (or ``EmbeddingConfig``) has an id space of
``num_embeddings`` ids (up to 2^50 and beyond) and no rows until ids are trained: its rows live
on the BagPipe PS, created by the first step that trains them with the table's deterministic
initial value (the PS's lazy init: uniform in ±``weight_init_max``, TorchRec's default
``sqrt(1 / num_embeddings)``), and evicted by the table's policy at step boundaries
(docs/virtual_tables.md). TorchRec's own kernels for them (fbgemm's SSD / DRAM key-value
tables) do not run in open source, so placement sends every virtual table to BagPipe.

Policies (TorchRec's ``modules/embedding_configs.py``) map onto `EvictionSpec`:

* None, ``NoEvictionPolicy``: rows are never evicted.
* ``CountBasedEvictionPolicy(eviction_threshold, decay_rate,
  training_id_eviction_trigger_count)``: threshold -> the count rule (0: no eviction),
  decay_rate as is, the trigger per rank (TorchRec: "max number of training ids per rank")
  -> rounds while the table's live rows exceed ``trigger * world_size`` (0: every step).
* `StepTTLEvictionPolicy(ttl_steps, training_id_eviction_trigger_count)` (BagPipe's, a
  TorchRec ``VirtualTableEvictionPolicy``): rows not trained for ``ttl_steps`` steps — the
  reproducible twin of TorchRec's wall-clock TTL.
* ``TimestampBasedEvictionPolicy`` / ``CountTimestampMixedEvictionPolicy``: their TTL is in
  wall-clock minutes, which no two ranks (nor a replay) see alike; refused unless
  ``eviction_ttl_mins == 0`` (then: no eviction / the count rule).
* ``FeatureL2NormBasedEvictionPolicy``, ``FeatureScoreBasedEvictionPolicy``: refused (they
  need row values or scores at the boundary; not built) unless their threshold is 0.
* `AdmissionPolicy(admit_after, eviction)` (BagPipe's): an admission filter around one of
  the above (runtime/eviction.py).

Every refusal is a ValueError naming the table and the policy, raised while the module is
sharded (before anything opens on the PS).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torchrec.modules.embedding_configs import (
    BaseEmbeddingConfig,
    CountBasedEvictionPolicy,
    CountTimestampMixedEvictionPolicy,
    FeatureL2NormBasedEvictionPolicy,
    NoEvictionPolicy,
    TimestampBasedEvictionPolicy,
    VirtualTableEvictionPolicy,
)

from torchrec_bagpipe.runtime.eviction import VIRTUAL_AUTO_CACHE_ROWS, EvictionSpec

__all__ = [
    "AdmissionPolicy",
    "StepTTLEvictionPolicy",
    "eviction_spec_of",
    "is_virtual",
    "planned_rows",
    "virtual_placement",
]


@dataclass
class StepTTLEvictionPolicy(VirtualTableEvictionPolicy):
    """BagPipe's step-based TTL: a row not trained for `ttl_steps` steps is evicted at a step
    boundary (0: never); rounds run while the table's live rows exceed
    ``training_id_eviction_trigger_count * world_size`` (0: every step)."""

    ttl_steps: int = 0
    training_id_eviction_trigger_count: int = 0
    # A hard cap on the table's live rows (all ranks together) after each boundary: beyond the
    # TTL, the rows trained longest ago are evicted (EvictionSpec.max_rows; 0: none). A byte
    # budget B is the cap B // the PS's bytes per row (weights + optimizer state).
    max_live_rows: int = 0


@dataclass
class AdmissionPolicy(VirtualTableEvictionPolicy):
    """BagPipe's admission filter around an eviction policy (beyond TorchRec's policies;
    Monolith's occurrence threshold): an id is trained only from the step at which it has
    been read in `admit_after` steps (since it was last evicted); until then it reads as
    zeros and its gradient is dropped, deterministically on every rank and in the
    reference. `eviction`: the table's eviction policy (None: never evicts)."""

    admit_after: int = 0
    eviction: VirtualTableEvictionPolicy | None = None
    # Probabilistic admission: from its admit_after-th read step on, an id is admitted at
    # each read step with this probability, by a coin seeded with admit_seed (runtime/
    # eviction.py; 1.0: always).
    admit_probability: float = 1.0
    admit_seed: int = 0


def is_virtual(cfg: BaseEmbeddingConfig) -> bool:
    return bool(getattr(cfg, "use_virtual_table", False))


def planned_rows(cfg: BaseEmbeddingConfig) -> int:
    """The rows a table's cache is sized from: its num_embeddings, or for a virtual table (an
    id space) at most VIRTUAL_AUTO_CACHE_ROWS, as the runtime sizes it."""
    n = int(cfg.num_embeddings)
    return min(n, VIRTUAL_AUTO_CACHE_ROWS) if is_virtual(cfg) else n


def virtual_placement(cfg: BaseEmbeddingConfig, where: str, bagpipe_ok: bool,
                      unsupported: str | None) -> tuple[bool, bool, str] | None:
    """Placement's rule for a virtual table: (placed, forced, reason) = BagPipe, forced; None
    for an ordinary table. ValueError naming the table when its constraints keep it off
    BagPipe or BagPipe cannot serve it (no other open-source kernel can)."""
    if not is_virtual(cfg):
        return None
    if not bagpipe_ok or unsupported is not None:
        why = unsupported or "its ParameterConstraints exclude the BagPipe kernel"
        raise ValueError(
            f"{where}: use_virtual_table=True tables are served by BagPipe (TorchRec's "
            f"key-value kernels do not run in open source), but {why}"
        )
    return True, True, "use_virtual_table"


def _trigger(policy: object, world_size: int) -> int:
    t = int(getattr(policy, "training_id_eviction_trigger_count", 0) or 0)
    if t < 0:
        raise ValueError(f"training_id_eviction_trigger_count must be >= 0, got {t}")
    return t * world_size


def eviction_spec_of(cfg: BaseEmbeddingConfig, world_size: int,
                     where: str = "BagPipe module") -> EvictionSpec | None:
    """The `EvictionSpec` of a table (None: not a virtual table), after its checks:
    ``num_embeddings >= 1``, ``total_num_buckets`` (when set) >= 1 dividing
    ``num_embeddings``, and a policy BagPipe honours (module docstring); ValueError naming the
    table and the policy otherwise."""
    if not is_virtual(cfg):
        return None
    name = f"{where}: virtual table {cfg.name!r}"
    buckets = getattr(cfg, "total_num_buckets", None)
    if buckets is not None and (int(buckets) < 1 or int(cfg.num_embeddings) % int(buckets)):
        raise ValueError(
            f"{name}: total_num_buckets {buckets} must be >= 1 and divide num_embeddings "
            f"{cfg.num_embeddings} (TorchRec's buckets are equal id ranges)"
        )
    p = getattr(cfg, "virtual_table_eviction_policy", None)
    if isinstance(p, AdmissionPolicy):
        n = p.admit_after
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name}: AdmissionPolicy.admit_after must be an int >= 0, "
                             f"got {n!r}")
        inner = dataclasses.replace(cfg, virtual_table_eviction_policy=p.eviction)
        spec = eviction_spec_of(inner, world_size, where)
        try:
            return dataclasses.replace(  # type: ignore[arg-type]
                spec, admit_after=n, admit_probability=p.admit_probability,
                admit_seed=p.admit_seed)
        except ValueError as e:
            raise ValueError(f"{name}: AdmissionPolicy: {e}") from None
    kind = type(p).__name__
    if p is None or type(p) in (NoEvictionPolicy, VirtualTableEvictionPolicy):
        return EvictionSpec()
    if isinstance(p, StepTTLEvictionPolicy):
        cap = p.max_live_rows
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
            raise ValueError(f"{name}: StepTTLEvictionPolicy.max_live_rows must be an int >= 0, "
                             f"got {cap!r}")
        return EvictionSpec(ttl_steps=int(p.ttl_steps), trigger_rows=_trigger(p, world_size),
                            max_rows=cap)
    if isinstance(p, CountBasedEvictionPolicy):
        return EvictionSpec(threshold=float(p.eviction_threshold),
                            decay_rate=float(p.decay_rate),
                            trigger_rows=_trigger(p, world_size))
    if isinstance(p, CountTimestampMixedEvictionPolicy) and int(p.eviction_ttl_mins) == 0:
        return EvictionSpec(threshold=float(p.eviction_threshold),
                            decay_rate=float(p.decay_rate),
                            trigger_rows=_trigger(p, world_size))
    if isinstance(p, TimestampBasedEvictionPolicy) and int(p.eviction_ttl_mins) == 0:
        return EvictionSpec()
    if isinstance(p, FeatureL2NormBasedEvictionPolicy) and float(p.eviction_threshold) == 0.0:
        return EvictionSpec()
    if isinstance(p, (TimestampBasedEvictionPolicy, CountTimestampMixedEvictionPolicy)):
        raise ValueError(
            f"{name}: {kind} evicts by wall-clock minutes (eviction_ttl_mins="
            f"{p.eviction_ttl_mins}), which ranks and replays do not see alike; BagPipe "
            "decides eviction at step boundaries: use StepTTLEvictionPolicy(ttl_steps=...) "
            "(torchrec_bagpipe.distributed) or set eviction_ttl_mins=0"
        )
    raise ValueError(
        f"{name}: BagPipe cannot honour {kind} (it supports NoEvictionPolicy, "
        "CountBasedEvictionPolicy and StepTTLEvictionPolicy)"
    )
