"""`BagPipeShardedModule`: what the BagPipe-sharded EBC and EC share.

A sharded module holds up to two parts, as TorchRec's own sharded modules hold one
"sharding" per sharding type:

* the **BagPipe part** (`BagPipeTables`, bagpipe_tables.py): the tables the plan places on
  the BagPipe kernel, their rows in the PS;
* the **stock part** (`StockPart`, stock_part.py): the other tables, served by TorchRec's
  own sharded module (`_stock`, a child module) with their part of the plan.

The module is one TorchRec `ShardedModule` over both (ARCHITECTURE §5):

* `input_dist` feeds one input KJT to both parts and returns one `KJTListSplitsAwaitable`:
  the stock part's input dists first (TorchRec's pipeline fuses their splits with other
  modules' and fills the stock context's sharding contexts by position), then one ready
  entry per BagPipe fused table. `TrainPipelineSparseDist` and `BagPipeTrainPipeline` run
  it a batch early for both parts.
* `compute_and_output_dist` runs the stock part's lookups and output dist, reads the BagPipe
  part's rows, and combines both outputs into the unsharded module's output (the subclass's
  `_combine`), in the unsharded module's key order.
* One `fused_optimizer`: the BagPipe part's (its param groups' learning rates, per step, and
  its optimizer state in TorchRec's layout: fused_optimizer.py), combined with the stock
  part's (TorchRec's `CombinedOptimizer`) when there is one; LR schedulers and
  `state_dict()` / `load_state_dict()` see both.
* One state dict, keyed as the unsharded module keys it (`<collection>.<table>.weight`, in
  table order): the stock part's entries are TorchRec's (sharded tensors, renamed from
  `_stock.<collection>...`), the BagPipe part's are row-wise sharded tensors of live PS
  views (table_state.py); loads route each entry to its part.

Thread-safety: one training thread per rank.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchrec.distributed.embedding_sharding import KJTListSplitsAwaitable
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.types import (
    Awaitable,
    LazyAwaitable,
    NoWait,
    ParameterSharding,
    QuantizedCommCodecs,
    ShardedModule,
    ShardingEnv,
    ShardingType,
)
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.modules.embedding_modules import get_embedding_names_by_table
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.distributed.bagpipe_tables import BagPipeTables
from torchrec_bagpipe.distributed.layout import split_plan
from torchrec_bagpipe.distributed.layout_agreement import agreed_layout
from torchrec_bagpipe.distributed.stock_part import StockPart, build_stock_part
from torchrec_bagpipe.distributed.table_optimizer import TableOptimizer, table_optimizer
from torchrec_bagpipe.distributed.types import BagPipeContext

__all__ = ["BagPipeShardedModule"]

# The stock part's child module name (its state-dict entries are renamed away from it).
_STOCK = "_stock"


@dataclass
class _Computed:
    """`compute`'s output: the stock part's lookups and the BagPipe part's output."""

    stock: Any
    bagpipe: Any


class BagPipeShardedModule(ShardedModule[KJTList, _Computed, Any, BagPipeContext],
                           FusedOptimizerModule):
    """A sharded embedding module with a BagPipe part and an optional stock part (see module
    docstring). Subclasses set `_COLLECTION` and `_KIND` and turn the BagPipe part's rows
    into outputs (`_bagpipe_output`) and combine both parts' outputs (`_combine`)."""

    _COLLECTION: str  # the unsharded module's table container: embedding_bags | embeddings
    _KIND: str  # names the module kind in error messages

    def _init_parts(
        self,
        module: nn.Module,
        configs: Sequence[BaseEmbeddingConfig],
        plan: Mapping[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None,
        config: BagPipeConfig | None,
        fused_params: Mapping[str, Any] | None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None,
        module_fqn: str | None,
        *,
        weighted: bool,
        use_index_dedup: bool = False,
    ) -> None:
        """Builds both parts (called by the subclass's constructor, once)."""
        self._config = config if config is not None else BagPipeConfig()
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        self._module_fqn = module_fqn or ""
        self._where = f"BagPipe {self._KIND} {self._module_fqn or '<root>'}"
        self._table_order = [cfg.name for cfg in configs]
        names = dict(zip(self._table_order, get_embedding_names_by_table(list(configs))))
        # The unsharded module's output keys and their widths, in its order.
        self._embedding_names = [n for table in self._table_order for n in names[table]]
        self._embedding_dims = [int(cfg.embedding_dim) for cfg in configs
                                for _ in names[cfg.name]]
        # A rank's own mistakes are collected, not raised: every rank hears of them in the
        # BagPipe part's agreement (layout_agreement.agreed_layout) and raises together.
        problem: BaseException | None = None
        ours: list[BaseEmbeddingConfig] = []
        stock: list[BaseEmbeddingConfig] = []
        optimizers: dict[str, TableOptimizer] = {}
        weights: dict[str, torch.Tensor] = {}
        try:
            ours, stock = split_plan(configs, plan, self._where)
            if not ours:
                raise ValueError(
                    f"{self._where}: the plan places no table on the BagPipe kernel; shard "
                    "this module with TorchRec's own sharder (the BagPipe sharders do that "
                    "themselves)"
                )
            tables = getattr(module, self._COLLECTION)
            weights = {cfg.name: tables[cfg.name].weight for cfg in ours}
            # Each BagPipe table's optimizer, read before TorchRec's stock sharder sees the
            # module: it rewrites the `_optimizer_kwargs` that `apply_optimizer_in_backward`
            # shares between tables in place (adds its EmbOptimType, renames lr; the parser
            # reads that form too, for tables of modules sharded earlier).
            optimizers = {
                cfg.name: table_optimizer(weights[cfg.name], fused_params,
                                          f"{self._where}, table {cfg.name!r}")
                for cfg in ours
            }
        except Exception as e:
            problem = e
        job, layout = agreed_layout(
            ours, [names[cfg.name] for cfg in ours], optimizers, env=env, device=self._device,
            config=self._config, module_fqn=self._module_fqn, weighted=weighted,
            where=self._where, problem=problem,
        )

        # The stock part first: it holds no PS resources if the BagPipe part then fails.
        self._stock_part: StockPart | None = None
        if stock:
            self._stock_part = build_stock_part(
                module, stock, plan, names, env=env, device=device, fused_params=fused_params,
                qcomm_codecs_registry=qcomm_codecs_registry, module_fqn=module_fqn,
                where=self._where, use_index_dedup=use_index_dedup,
            )
            self.add_module(_STOCK, self._stock_part.module)
        self._bagpipe = BagPipeTables(
            job, layout, ours, weights, device=self._device, config=self._config,
            param_prefix=self._COLLECTION,
        )
        self.add_module(self._COLLECTION, nn.ModuleDict(self._bagpipe.views))
        if self._stock_part is None:
            self._optim: KeyedOptimizer = self._bagpipe.optimizer
        else:
            self._optim = CombinedOptimizer(
                [("", self._bagpipe.optimizer), ("", self._stock_part.module.fused_optimizer)])
            self.register_state_dict_post_hook(_stock_entries_out)
            self.register_load_state_dict_pre_hook(_stock_entries_in)
            self.register_load_state_dict_post_hook(_stock_keys_out)
        self.register_load_state_dict_post_hook(_after_load)

    # ---- the two parts' outputs (subclasses) ------------------------------------------------
    @abc.abstractmethod
    def _bagpipe_output(self, ctx: BagPipeContext, kjts: Sequence[KeyedJaggedTensor]) -> Any:
        """The BagPipe part's output for one batch (its per-fused-table KJTs)."""

    @abc.abstractmethod
    def _combine(self, stock: LazyAwaitable[Any] | None, bagpipe: Any) -> LazyAwaitable[Any]:
        """The module's output from the stock part's (None: no stock part) and the BagPipe
        part's outputs, in the unsharded module's key order."""

    # ---- TorchRec ShardedModule API ------------------------------------------------------------
    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        return self._optim

    def create_context(self) -> BagPipeContext:
        return BagPipeContext()

    def input_dist(  # type: ignore[override]
        self, ctx: BagPipeContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KJTList]]:
        self._bagpipe.check_open()
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(
                f"{self._where} expects a KeyedJaggedTensor, got {type(features).__name__}"
            )
        # Checked before the BagPipe part submits the batch: a refused batch leaves no trace.
        stock_features = (self._stock_part.select(features)
                          if self._stock_part is not None else None)
        # A training step needs autograd: a training-mode forward under torch.no_grad() is
        # an eval read (it takes no step, so one rank may run it alone).
        training = self.training and torch.is_grad_enabled()
        per_group, keys = self._bagpipe.enter(features, training)
        ctx.training = training
        ctx.batch_size = features.stride()
        ctx.keys = keys
        awaitables: list[Any] = []
        sharding_types: list[str] = []
        if self._stock_part is not None:
            stock = self._stock_part.module
            ctx.stock = stock.create_context()
            request = stock.input_dist(ctx.stock, stock_features)
            awaitables.extend(request.awaitables)
            kinds = getattr(request, "_sharding_types", None)
            sharding_types.extend(kinds or ["stock"] * len(request.awaitables))
            ctx.stock_inputs = len(request.awaitables)
        awaitables.extend(NoWait(NoWait(k)) for k in per_group)
        sharding_types.extend([ShardingType.DATA_PARALLEL.value] * len(per_group))
        return KJTListSplitsAwaitable(awaitables, ctx, self._module_fqn, sharding_types)

    def compute(self, ctx: BagPipeContext, dist_input: KJTList) -> _Computed:
        n = ctx.stock_inputs
        stock = None
        if self._stock_part is not None:
            stock = self._stock_part.module.compute(ctx.stock, KJTList(list(dist_input)[:n]))
        return _Computed(stock, self._bagpipe_output(ctx, list(dist_input)[n:]))

    def output_dist(self, ctx: BagPipeContext, output: _Computed) -> LazyAwaitable[Any]:
        stock = None
        if self._stock_part is not None:
            stock = self._stock_part.module.output_dist(ctx.stock, output.stock)
        return self._combine(stock, output.bagpipe)

    def compute_and_output_dist(self, ctx: BagPipeContext, input: KJTList
                                ) -> LazyAwaitable[Any]:
        n = ctx.stock_inputs
        inputs = list(input)
        stock = None
        if self._stock_part is not None:
            # Its output dist starts before the BagPipe part waits for its rows.
            stock = self._stock_part.module.compute_and_output_dist(
                ctx.stock, KJTList(inputs[:n]))
        return self._combine(stock, self._bagpipe_output(ctx, inputs[n:]))

    def sharded_parameter_names(self, prefix: str = "") -> Iterator[str]:
        # Every parameter: BagPipe placeholders, and the stock part's (TorchRec's sharded
        # modules name all of theirs too; their data-parallel tables synchronise through a
        # DistributedDataParallel of their own).
        for name, _ in self.named_parameters(prefix):
            yield name

    # ---- BagPipe extensions (BagPipeTrainPipeline and tools) ---------------------------------
    @property
    def bagpipe_tables(self) -> BagPipeTables:
        """The BagPipe part."""
        return self._bagpipe

    @property
    def stock_tables(self) -> list[str]:
        """The tables that keep stock TorchRec sharding, in module order."""
        part = self._stock_part
        ours = set(self._bagpipe.views)
        return [] if part is None else [t for t in self._table_order if t not in ours]

    @property
    def bagpipe_config(self) -> BagPipeConfig:
        return self._config

    def presubmit(self, features: KeyedJaggedTensor) -> None:
        """Submits a future training batch to the BagPipe part's lookahead window;
        `input_dist` of the same batch, later, then only checks it matches."""
        self._bagpipe.presubmit(features)

    def hold_submissions(self) -> None:
        """Queues the batches `input_dist` would submit until `release_submissions`."""
        self._bagpipe.hold_submissions()

    def release_submissions(self) -> None:
        self._bagpipe.release_submissions()

    def prescan(self, features: Iterable[KeyedJaggedTensor],
                progress: bool | None = None) -> None:
        """Hands the whole trace (every step's local batch, in order) to the BagPipe part's
        runtimes (a collective: every rank calls it). REQUIRES: no batch submitted yet;
        `optimization_prescan` set in the config."""
        self._bagpipe.prescan(features, progress)

    def bagpipe_metrics(self) -> dict[str, dict[str, Any]]:
        """Runtime metrics per fused table (plain dicts)."""
        return self._bagpipe.metrics()

    def flush(self) -> None:
        """Finishes gradient-less steps (a pending step gets a zero gradient) and waits until
        every pending commit is applied."""
        self._bagpipe.flush()

    def close(self) -> None:
        """Finishes pending steps with a zero gradient, drains pending commits, completes
        the ID exchanges of batches submitted but never run, and closes the PS sessions
        (idempotent)."""
        self._bagpipe.close()


# ---- state-dict hooks ------------------------------------------------------------------------
def _stock_entries_out(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                       local_metadata: Any) -> None:
    """`<prefix>_stock.<collection>.<t>.weight` -> `<prefix><collection>.<t>.weight`, and the
    module's entries in its table order (the unsharded module's)."""
    assert isinstance(module, BagPipeShardedModule)
    stock_prefix = prefix + _STOCK + "."
    entries: dict[str, Any] = {}
    for key in [k for k in state_dict if k.startswith(prefix)]:
        value = state_dict.pop(key)
        if key.startswith(stock_prefix):
            key = prefix + key[len(stock_prefix):]
        entries[key] = value
    for table in module._table_order:
        key = f"{prefix}{module._COLLECTION}.{table}.weight"
        if key in entries:
            state_dict[key] = entries.pop(key)
    state_dict.update(entries)


def _stock_entries_in(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                      local_metadata: Any, strict: bool, missing_keys: list[str],
                      unexpected_keys: list[str], error_msgs: list[str]) -> None:
    """Routes the stock tables' entries of a load to the stock part."""
    assert isinstance(module, BagPipeShardedModule)
    for table in module.stock_tables:
        key = f"{prefix}{module._COLLECTION}.{table}.weight"
        if key in state_dict:
            state_dict[f"{prefix}{_STOCK}.{module._COLLECTION}.{table}.weight"] = \
                state_dict.pop(key)


def _stock_keys_out(module: nn.Module, incompatible_keys: Any) -> None:
    """Missing / unexpected keys of the stock part, named as the state dict names them."""
    assert isinstance(module, BagPipeShardedModule)
    marker = f"{_STOCK}.{module._COLLECTION}."
    for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
        for i, key in enumerate(keys):
            at = key.rfind(marker)
            if at >= 0 and (at == 0 or key[at - 1] == "."):
                keys[i] = key[:at] + key[at + len(_STOCK) + 1:]


def _after_load(module: nn.Module, incompatible_keys: Any) -> None:
    assert isinstance(module, BagPipeShardedModule)
    module._bagpipe.finish_load()
