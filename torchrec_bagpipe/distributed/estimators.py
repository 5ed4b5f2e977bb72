"""Storage and perf estimates of BagPipe sharding options, for both planners.

* Storage: a BagPipe table costs a trainer only its bounded cache (rows with their optimizer
  state, plus `METADATA_BYTES_PER_ROW`) and its batch tensors; its rows count against the
  PS. `BagPipeStorageEstimator` (BagPipeShardingPlanner's) charges that.
* Perf: from the bytes a step moves over the PS link (perf_model.py, the benchmarks' link
  model), in TorchRec's unit (ms), so the estimates add up with the stock options'.
  `BagPipePerfEstimator` is BagPipeShardingPlanner's.
* TorchRec's own planner (`EmbeddingShardingPlanner`, also the one DMP builds without a
  plan) reaches BagPipe tables through TorchRec's hardware-config registry:
  `BagPipeAwarePerfConfig` is registered as TorchRec's default perf config
  (`EmbeddingPerfEstimatorFactory.register(DEFAULT_PERF_ESTIMATOR)`, the extension point
  TorchRec documents for hardware configs). For a stock sharding option it returns exactly
  what TorchRec's `EmbeddingPerfEstimatorConfig` returns (it calls TorchRec's evaluators
  with TorchRec's config); for a BagPipe option (`customized_kernel`, which TorchRec's
  kernel-bandwidth lookup does not know: "Unrecognized or unsupported compute kernel") it
  returns the PS-link estimate. For the tables a BagPipe sharder registered
  (`register_tables`, from the sharder's `shardable_parameters`), the option on the side the
  placement rule (placement.py `place_table`) did not choose carries `PENALTY_MS`, so
  TorchRec's planner picks the rule's side whenever it fits, and chooses among that side's
  options as it always does. TorchRec's planner does not pass its `ParameterConstraints` to
  a perf config: it applies them itself by dropping the options they exclude, so a table
  whose constraints exclude one side gets the other. Nothing of TorchRec's is replaced.
  TorchRec 1.9.2's storage estimator has no extension point (it does not call the
  sharder's `storage_usage`): it charges a BagPipe option as a data-parallel table.
"""

from __future__ import annotations

import abc
import contextlib
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn
from torchrec.distributed.planner.constants import DDR_CAP, DEFAULT_PERF_ESTIMATOR, HBM_CAP
from torchrec.distributed.planner.estimator import (
    EmbeddingPerfEstimatorConfig,
    EmbeddingPerfEstimatorFactory,
    ShardPerfContext,
    backward_compute,
    forward_compute,
)
from torchrec.distributed.planner.estimator.annotations import bwd_comms, fwd_comms
from torchrec.distributed.planner.estimator.estimator import (
    get_embedding_perf_sharding_evaluator,
)
from torchrec.distributed.planner.shard_estimators import (
    EmbeddingPerfEstimator,
    EmbeddingStorageEstimator,
)
from torchrec.distributed.planner.types import (
    ParameterConstraints,
    Perf,
    ShardEstimator,
    ShardingOption,
    Storage,
    Topology,
)
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.distributed.perf_model import DEFAULT_PS_LINK, Link, step_traffic
from torchrec_bagpipe.distributed.placement import module_table_facts, place_table, table_configs
from torchrec_bagpipe.distributed.table_optimizer import state_floats
from torchrec_bagpipe.distributed.types import BAGPIPE_KERNEL
from torchrec_bagpipe.distributed.virtual_tables import planned_rows

__all__ = [
    "METADATA_BYTES_PER_ROW",
    "PENALTY_MS",
    "BagPipeAwarePerfConfig",
    "BagPipePerfEstimator",
    "BagPipeStorageEstimator",
    "bagpipe_perf",
    "register_tables",
]

# Key -> slot map entry, LRU/oracle bookkeeping and the previous-update step of a cached row.
METADATA_BYTES_PER_ROW = 32
# Added to the perf of the option the placement rule did not choose (ms: about 3 hours a
# batch, beyond any real option's estimate).
PENALTY_MS = 1e7
_ID_BYTES = 8
_FP32_BYTES = 4


def bagpipe_perf(lookups: float, rows: int, dim: int, cache_rows: float, device_bw: float,
                 bwd_compute_multiplier: float, link: Link = DEFAULT_PS_LINK) -> Perf:
    """One rank's batch of a BagPipe table: pooling the rows on the device (`device_bw`,
    bytes/ms), the misses' prefetch over the PS link (forward comms) and the gradient commit
    (backward comms)."""
    traffic = step_traffic(lookups, rows, dim, cache_rows)
    compute = lookups * dim * _FP32_BYTES / device_bw
    return Perf(
        fwd_compute=compute,
        fwd_comms=link.fetch_ms(traffic.fetched_rows, dim * _FP32_BYTES,
                                1.0 if traffic.fetched_rows else 0.0),
        bwd_compute=compute * bwd_compute_multiplier,
        bwd_comms=link.commit_ms(traffic.commit_bytes),
    )


# ---- BagPipeShardingPlanner's estimators --------------------------------------------------------


class _SplitEstimator(ShardEstimator):
    """Runs TorchRec's `_STOCK` estimator on stock sharding options and `_estimate` on
    BagPipe ones."""

    _STOCK: type[ShardEstimator]

    def __init__(
        self,
        topology: Topology,
        constraints: dict[str, ParameterConstraints] | None = None,
        config: BagPipeConfig | None = None,
        bagpipe_tables: set[str] | None = None,
    ) -> None:
        self._topology = topology
        self._config = config if config is not None else BagPipeConfig()
        self._stock = self._STOCK(topology, constraints)
        # The tables placed on BagPipe (None: every table), which fuse by dim.
        self._bagpipe_tables = bagpipe_tables

    @abc.abstractmethod
    def _estimate(self, so: ShardingOption, sharder_data_map=None) -> None:
        """Fills `so`'s shards' estimate (storage or perf) for a BagPipe table."""

    def estimate(self, sharding_options: list[ShardingOption], sharder_data_map=None) -> None:  # type: ignore[override]
        rest = [so for so in sharding_options if so.compute_kernel != BAGPIPE_KERNEL]
        if rest:
            self._stock.estimate(rest, sharder_data_map=sharder_data_map)
        for so in sharding_options:
            if so.compute_kernel == BAGPIPE_KERNEL:
                self._estimate(so, sharder_data_map)


def _fused_rows(so: ShardingOption, bagpipe_tables: set[str] | None) -> int:
    """Rows of the fused table `so`'s table joins (its module's same-dim BagPipe tables)."""
    dim = int(so.tensor.shape[1])
    try:
        configs = table_configs(so.module[1])
    except AssertionError:  # not a collection: the table alone
        return int(so.tensor.shape[0])
    return sum(
        planned_rows(c) for c in configs  # (a virtual table: a bounded row count)
        if int(c.embedding_dim) == dim
        and (bagpipe_tables is None or c.name in bagpipe_tables or c.name == so.name)
    )


def _cache_rows(so: ShardingOption, config: BagPipeConfig,
                bagpipe_tables: set[str] | None) -> float:
    """This table's share of its fused table's cache rows."""
    fused = max(1, _fused_rows(so, bagpipe_tables))
    rows = min(fused, config.cache_rows(fused))
    own = int(so.tensor.shape[0])
    with contextlib.suppress(AssertionError):  # (not a collection: the table alone)
        own = next((planned_rows(c) for c in table_configs(so.module[1]) if c.name == so.name),
                   own)
    return rows * own / fused


def _lookups(so: ShardingOption) -> float:
    """Ids one rank looks up per batch for this table."""
    return float(so.batch_size) * float(sum(so.input_lengths))


class BagPipeStorageEstimator(_SplitEstimator):
    """Device memory of a BagPipe table: its cache share, metadata and batch tensors."""

    _STOCK = EmbeddingStorageEstimator

    def _estimate(self, so: ShardingOption, sharder_data_map=None) -> None:
        dim = int(so.tensor.shape[1])
        # A cached row holds its optimizer state too (the sharder's fused_params or the
        # table's in-backward optimizer say which).
        sharder_data = (sharder_data_map or {}).get(so.module_type_key)
        fused_params = getattr(sharder_data, "fused_params", None)
        state = state_floats(so.tensor, fused_params, dim, f"BagPipe table {so.name!r}")
        cache = (_cache_rows(so, self._config, self._bagpipe_tables)
                 * ((dim + state) * _FP32_BYTES + METADATA_BYTES_PER_ROW))
        lookups = _lookups(so)
        # Ids in, the gathered unique rows (at most one per id) and the pooled output.
        batch = lookups * (_ID_BYTES + dim * _FP32_BYTES) + so.batch_size * dim * _FP32_BYTES
        # The prepared-batch queue holds that many batches' gathered rows.
        total = int(cache + batch * (1 + self._config.prepared_batches))
        on_hbm = self._topology.compute_device == "cuda"
        for shard in so.shards:
            shard.storage = Storage(hbm=total if on_hbm else 0, ddr=0 if on_hbm else total)


class BagPipePerfEstimator(_SplitEstimator):
    """Per-batch time of a BagPipe table (`bagpipe_perf`); TorchRec's own estimates for the
    stock options (TorchRec's default config: the placement was decided before)."""

    _STOCK = EmbeddingPerfEstimator

    def __init__(self, topology: Topology, constraints: dict[str, ParameterConstraints] | None
                 = None, config: BagPipeConfig | None = None,
                 bagpipe_tables: set[str] | None = None) -> None:
        super().__init__(topology, constraints, config, bagpipe_tables)
        self._stock = EmbeddingPerfEstimatorFactory.create_with_config(  # type: ignore[assignment]
            EmbeddingPerfEstimatorConfig(), topology=topology, constraints=constraints)

    def _estimate(self, so: ShardingOption, sharder_data_map=None) -> None:
        bw = (self._topology.hbm_mem_bw if self._topology.compute_device == "cuda"
              else self._topology.ddr_mem_bw)
        perf = bagpipe_perf(_lookups(so), int(so.tensor.shape[0]), int(so.tensor.shape[1]),
                            _cache_rows(so, self._config, self._bagpipe_tables), bw,
                            self._topology.bwd_compute_multiplier)
        for shard in so.shards:
            shard.perf = perf


# ---- TorchRec's own planner ------------------------------------------------------------------


@dataclass(frozen=True)
class _Registered:
    """What the placement rule needs of a table a BagPipe sharder serves."""

    cfg: BaseEmbeddingConfig
    optimizer: str | None  # the stock kernels' EmbOptimType name
    optimizer_error: str | None  # why BagPipe cannot apply it
    config: BagPipeConfig


_registry: dict[str, _Registered] = {}
_registry_lock = threading.Lock()


def register_tables(module: nn.Module, fused_params: Mapping[str, Any] | None,
                    config: BagPipeConfig) -> None:
    """Records the tables of `module` (served by a BagPipe sharder with `fused_params` and
    `config`) for TorchRec's planner, by table name (TorchRec's planner keys tables by
    name). Called by the BagPipe sharders' `shardable_parameters`, which TorchRec's
    enumerator calls before it builds the module's sharding options."""
    facts = module_table_facts(module, fused_params)
    with _registry_lock:
        for name, (cfg, optimizer, error) in facts.items():
            _registry[name] = _Registered(cfg, optimizer, error, config)


def registered_placement(table: str, device: str) -> tuple[bool, str] | None:
    """(on BagPipe, reason) by the placement rule for a registered table on `device` (no
    constraints: TorchRec's planner applies them itself), or None for a table no BagPipe
    sharder registered."""
    with _registry_lock:
        r = _registry.get(table)
    if r is None:
        return None
    budget = HBM_CAP if device == "cuda" else DDR_CAP  # the capacity DMP's planner assumes
    placed, _, reason = place_table(r.cfg, None, r.config, device, budget, r.optimizer,
                                    r.optimizer_error, f"table {table!r}")
    return placed, reason


class BagPipeAwarePerfConfig(EmbeddingPerfEstimatorConfig):
    """TorchRec's default perf config, plus BagPipe options (module docstring).

    The penalty is order-free: a table's options are estimated one after another, in any
    order, within one `estimate` of TorchRec's perf estimator; each option's shard perfs
    pass through `post_process_perfs`, which keeps them by table. An option of the side the
    rule did not choose carries `PENALTY_MS` as soon as the table has an option of the
    chosen side too (seen before or after it), so a table whose constraints leave only one
    side keeps TorchRec's own estimates."""

    def __init__(self) -> None:
        super().__init__()
        self._torchrec = EmbeddingPerfEstimatorConfig()
        # The planned device: TorchRec asks `get_device_bw` for every sharding option before
        # it estimates any of the option's shards.
        self._device = "cuda"
        # The option being estimated: (table, its rows, dim, on BagPipe), from its contexts.
        self._current: tuple[str, int, int, bool] | None = None
        # Per (table, rows, dim): its options' shard perfs by side (True: BagPipe) and
        # whether each is penalized.
        self._seen: dict[tuple[str, int, int], dict[bool, list[list[Perf]]]] = {}
        self._penalized: set[int] = set()

    def get_device_bw(self, compute_device: str, compute_kernel: str, hbm_mem_bw: float,
                      ddr_mem_bw: float, ssd_mem_bw: float, hbm_to_ddr_mem_bw: float,
                      caching_ratio: float | None = None, prefetch_pipeline: bool = False,
                      ) -> float | None:
        self._device = compute_device.lower()
        if compute_kernel == BAGPIPE_KERNEL:  # pooling rows cached in device memory
            return hbm_mem_bw if self._device in ("cuda", "mtia") else ddr_mem_bw
        return super().get_device_bw(compute_device, compute_kernel, hbm_mem_bw, ddr_mem_bw,
                                     ssd_mem_bw, hbm_to_ddr_mem_bw, caching_ratio,
                                     prefetch_pipeline)

    def _bagpipe(self, ctx: ShardPerfContext) -> Perf:
        r = _registry.get(ctx.table_name)
        config = r.config if r is not None else BagPipeConfig()
        rows = max(1, int(ctx.hash_size))
        return bagpipe_perf(ctx.batch_inputs, rows, max(1, int(ctx.emb_dim)),
                            min(rows, config.cache_rows(rows)), ctx.device_bw,
                            ctx.bwd_compute_multiplier)

    def _stock(self, ctx: ShardPerfContext):  # TorchRec's evaluator for the option
        return get_embedding_perf_sharding_evaluator(ctx.sharding_type, ctx.is_inference)

    def _note(self, ctx: ShardPerfContext) -> bool:
        on_bagpipe = ctx.compute_kernel == BAGPIPE_KERNEL
        self._current = (ctx.table_name, int(ctx.hash_size_for_clamping), int(ctx.emb_dim),
                         on_bagpipe)
        return on_bagpipe

    @forward_compute
    def bagpipe_fwd_compute(self, ctx: ShardPerfContext) -> float:
        if self._note(ctx):
            return self._bagpipe(ctx).fwd_compute
        return self._stock(ctx).compute_fwd_comp(ctx, self._torchrec)

    @backward_compute
    def bagpipe_bwd_compute(self, ctx: ShardPerfContext) -> float:
        if self._note(ctx):
            return 0.0 if ctx.is_inference else self._bagpipe(ctx).bwd_compute
        return self._stock(ctx).compute_bwd_comp(ctx, self._torchrec)

    @fwd_comms
    def bagpipe_fwd_comms(self, ctx: ShardPerfContext) -> float:
        if self._note(ctx):
            return self._bagpipe(ctx).fwd_comms
        return self._stock(ctx).compute_fwd_comms(ctx, self._torchrec)

    @bwd_comms
    def bagpipe_bwd_comms(self, ctx: ShardPerfContext) -> float:
        if self._note(ctx):
            return 0.0 if ctx.is_inference else self._bagpipe(ctx).bwd_comms
        return self._stock(ctx).compute_bwd_comms(ctx, self._torchrec)

    def post_process_perfs(self, shard_perfs: list[Perf], shard_sizes: list[list[int]],
                           sharding_type: str, uneven_sharding_perf_multiplier: float = 1.0,
                           ) -> list[Perf]:
        perfs = self._torchrec.post_process_perfs(shard_perfs, shard_sizes, sharding_type,
                                                  uneven_sharding_perf_multiplier)
        current, self._current = self._current, None
        if current is None:
            return perfs
        table, rows, dim, on_bagpipe = current
        placed = registered_placement(table, self._device)
        if placed is None:
            return perfs
        sides = self._seen.setdefault((table, rows, dim), {True: [], False: []})
        sides[on_bagpipe].append(perfs)
        chosen = placed[0]
        if sides[chosen]:  # the chosen side exists: penalize every option of the other
            for option in sides[not chosen]:
                for perf in option:
                    if id(perf) not in self._penalized:
                        self._penalized.add(id(perf))
                        perf.fwd_compute += PENALTY_MS
        return perfs


EmbeddingPerfEstimatorFactory.register(DEFAULT_PERF_ESTIMATOR)(BagPipeAwarePerfConfig)
