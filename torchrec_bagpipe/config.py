"""One typed configuration object for every BagPipe knob.

Field names are BagPipe's flag names (as upstream BagPipe and `examples/dlrm` spell them)
with ``_`` for ``-``: the field ``optimization_cache_capacity`` is the CLI flag
``--optimization-cache-capacity``.
`BagPipeConfig.add_arguments` adds every field to an ``argparse`` parser and
`BagPipeConfig.from_args` reads them back, so scripts never restate the knobs.
"""

from __future__ import annotations

import argparse
import dataclasses
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args, get_origin, get_type_hints

ReadMode = Literal["bagpipe", "ps"]
Aggregation = Literal["ps", "collective", "writeback"]
PSType = Literal["local", "tcp", "rdma"]
EvictionPolicy = Literal["oracle", "lru"]
Partitioner = Literal["modulo", "hash", "fast_range"]

ROWS_PER_CACHE_UNIT = 64


_BYTE_SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_memory_budget(value: Any, name: str = "memory_budget") -> int:
    """A memory budget in bytes: an int, or a string such as '512M' / '4G' (K, M, G, T are
    binary units); 'auto' (any case) -> -1. Raises TypeError / ValueError naming `name`."""
    if isinstance(value, str):
        text = value.strip().upper()
        if text == "AUTO":
            return -1
        mult = 1
        if text and text[-1] in _BYTE_SUFFIX:
            mult, text = _BYTE_SUFFIX[text[-1]], text[:-1]
        try:
            value = int(float(text) * mult)
        except ValueError:
            raise ValueError(
                f"{name} must be bytes (an int, or e.g. '512M', '4G') or 'auto', got {value!r}"
            ) from None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0 bytes or 'auto', got {value}")
    return int(value)


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class BagPipeConfig:
    """Every knob of the BagPipe runtime, the parameter server and its transports.

    With no arguments it runs on one node with any number of rank processes and no server to
    start: PS shards live inside the trainer processes (one per rank), online planning, ``ps``
    aggregation and an automatically sized cache.
    """

    # ---- execution --------------------------------------------------------------------
    read_mode: ReadMode = field(
        default="bagpipe",
        metadata=_help(
            "bagpipe: bounded cache with lookahead prefetch; ps: no cache, every row is "
            "fetched from the PS every step (the no-cache baseline)"
        ),
    )
    optimization_prescan: bool = field(
        default=False,
        metadata=_help(
            "build access plans from the whole ID trace before training (each step is then "
            "checked against its plan); otherwise ranks exchange batch IDs online"
        ),
    )
    optimization_cache_capacity: int | None = field(
        default=None,
        metadata=_help(
            "per-rank cache capacity in units of 64 rows; unset: sized automatically "
            "(see cache_auto_fraction)"
        ),
    )
    cache_auto_fraction: float = field(
        default=0.05,
        metadata=_help("automatic cache size as a fraction of the table rows (at least 1 unit)"),
    )
    bagpipe_aggregation: Aggregation = field(
        default="ps",
        metadata=_help(
            "ps: ranks send local unique-row gradients to the PS, which sums them in rank "
            "order; collective: all-reduce active-row gradients, one rank submits each row; "
            "writeback: every cache holds the same rows (the ranks' union), resident rows "
            "are updated in the caches only and go back to the PS when evicted (upstream "
            "BagPipe's logically replicated cache)"
        ),
    )
    lookahead: int = field(
        default=8,
        metadata=_help("number of future batches the planner sees (0: no prefetch)"),
    )
    lookahead_max: int = field(
        default=0,
        metadata=_help(
            "adaptive window (oracle eviction): batches are submitted up to this many ahead, "
            "and under cache pressure a step's window grows past `lookahead`, up to this "
            "bound, through the last of the next steps that reads a cached row with no known "
            "next use (docs/adaptive_lookahead.md); 0: a fixed window of `lookahead` batches"
        ),
    )
    eviction_policy: EvictionPolicy = field(
        default="oracle",
        metadata=_help(
            "oracle: evict the row whose next use in the window is furthest; lru: least "
            "recently used"
        ),
    )
    prepared_batches: int = field(
        default=2,
        metadata=_help(
            "prefetch distance: rows are prefetched at most this many steps before their use "
            "and wait in a bounded queue of prepared batches on the device"
        ),
    )
    prepare_ahead: bool = field(
        default=True,
        metadata=_help(
            "prepare step t+1 (access plan, cache query and admission, index plans, prefetch "
            "issue) on the runtime's own thread while step t runs, leaving the training "
            "thread only its step's tensor ops; off: prepared on the training thread at "
            "next_step (one thread fewer: faster where the host has no spare core)"
        ),
    )
    placement_min_rows: int | None = field(
        default=None,
        metadata=_help(
            "placement (both planners): tables with at least this many rows go to BagPipe, "
            "smaller ones keep TorchRec's stock sharding (0: every table); unset (and "
            "placement_memory_fraction unset): every table a BagPipe sharder can serve goes "
            "to BagPipe"
        ),
    )
    placement_memory_fraction: float | None = field(
        default=None,
        metadata=_help(
            "placement (both planners): tables larger than this fraction of one rank's device "
            "memory (the topology's HBM on CUDA, DDR on CPU) go to BagPipe; smaller tables "
            "keep TorchRec's stock sharding (ParameterConstraints force either side); unset: "
            "no size rule"
        ),
    )
    gradient_division: bool | None = field(
        default=None,
        metadata=_help(
            "divide summed sparse gradients by the world size; unset: follow TorchRec's "
            "torchrec.distributed.comm_ops.get_gradient_division()"
        ),
    )

    # ---- parameter server --------------------------------------------------------------
    ps_type: PSType = field(
        default="local",
        metadata=_help(
            "transport to the PS shards: local (in-process), tcp, or rdma (UCX); the launcher "
            "uses the local backend on a single node"
        ),
    )
    ps_addresses: list[str] = field(
        default_factory=list,
        metadata=_help(
            "host:port of each PS shard server, in shard order; empty: shards are hosted "
            "inside the trainer processes"
        ),
    )
    ps_shards: int | None = field(
        default=None,
        metadata=_help("number of PS shards; unset: len(ps_addresses), or one per rank"),
    )
    partitioner: Partitioner = field(
        default="modulo", metadata=_help("how fused row keys map to PS shards")
    )
    memory_budget: str | None = field(
        default=None,
        metadata=_help(
            "DRAM budget of each PS table's store in bytes (suffixes K, M, G, T allowed) or "
            "'auto' (half of the memory available); unset: unlimited"
        ),
    )
    spill_dir: str | None = field(
        default=None,
        metadata=_help("directory for PS pages spilled above the memory budget"),
    )
    store_threads: int = field(
        default=1, metadata=_help("worker threads of each PS table's store")
    )
    init_seed: int = field(
        default=0, metadata=_help("seed of the PS's deterministic lazy row initialisation")
    )
    max_packet_rows: int = field(
        default=4096, metadata=_help("rows per gradient/get packet (bounded packets)")
    )
    inflight_packets: int = field(
        default=8,
        metadata=_help("packets in flight per shard before waiting for ACKs (slot capacity)"),
    )
    job_token: str | None = field(
        default=None,
        metadata=_help(
            "shared secret PS servers require from clients; unset: $BAGPIPE_JOB_TOKEN, else "
            "one drawn per job (a standalone PS server: else none)"
        ),
    )

    # ---- failure handling ---------------------------------------------------------------
    ps_timeout: float = field(
        default=120.0,
        metadata=_help(
            "seconds (the one deadline of every PS operation, from its submission): a get, a "
            "commit, a committed step; past it the rank fails with TimeoutError and the job "
            "exits within a few seconds"
        ),
    )
    connect_timeout: float = field(
        default=30.0, metadata=_help("seconds to connect to a PS shard")
    )
    ps_checkpoint_max_failures: int = field(
        default=3,
        metadata=_help(
            "PS shards that checkpoint periodically report each checkpoint to the trainers: "
            "a failed one is a warning on the rank's log and a metric; this many failures "
            "in a row on one shard raise PSCheckpointError (0: never)"
        ),
    )
    ps_checkpoint_incremental: bool = field(
        default=True,
        metadata=_help(
            "PS shards' periodic checkpoints are chains (Check-N-Run): each one writes only "
            "the rows changed since the previous one, with their optimizer state, linked to a "
            "full base; restoring replays base and increments, bitwise the full checkpoint"
        ),
    )
    ps_checkpoint_full_every: int = field(
        default=8,
        metadata=_help("a PS checkpoint chain writes a full base after this many increments"),
    )
    ps_checkpoint_chain_fraction: float = field(
        default=0.5,
        metadata=_help(
            "a PS checkpoint chain writes a full base once its increments would pass this "
            "fraction of the base's bytes"
        ),
    )
    ps_checkpoint_background: bool = field(
        default=False,
        metadata=_help(
            "PS shards write their periodic checkpoints in the background, from a "
            "copy-on-write snapshot of the checkpoint's step, while later steps commit "
            "(training does not wait for the disk)"
        ),
    )
    checkpoint_dir: str | None = field(
        default=None,
        metadata=_help(
            "directory of whole-job checkpoints (PS shards' tables and every trainer's state "
            "at one committed step, a manifest written last); unset: $BAGPIPE_CHECKPOINT_DIR, "
            "else the --resume directory, else none"
        ),
    )
    checkpoint_every: int = field(
        default=0,
        metadata=_help(
            "take a whole-job checkpoint every N training steps (needs a checkpoint "
            "directory; 0: unset: $BAGPIPE_CHECKPOINT_EVERY, else only when asked)"
        ),
    )
    resume: str | None = field(
        default=None,
        metadata=_help(
            "resume from the whole-job checkpoint in this directory (hosted PS shards restore "
            "its tables, trainers its state, training continues after its step); unset: "
            "$BAGPIPE_RESUME, else a fresh job"
        ),
    )
    check_finite_grads: bool = field(
        default=False,
        metadata=_help(
            "check every embedding row gradient for NaN/inf before it is committed: a "
            "non-finite one fails the step on every rank with NonFiniteGradientError before "
            "anything reaches the PS (off by default, as TorchRec)"
        ),
    )

    def __post_init__(self) -> None:
        self.validate()

    # ---- validation -----------------------------------------------------------------------
    def validate(self) -> None:
        """Raises ValueError naming the field for any inconsistent setting."""
        hints = get_type_hints(type(self))
        for f in fields(self):
            allowed = _literal_values(hints[f.name])
            value = getattr(self, f.name)
            if allowed is not None and value not in allowed:
                raise ValueError(
                    f"BagPipeConfig.{f.name} must be one of {sorted(allowed)}, got {value!r}"
                )
        if self.optimization_cache_capacity is not None and self.optimization_cache_capacity < 1:
            raise ValueError(
                "BagPipeConfig.optimization_cache_capacity must be >= 1 (units of 64 rows), "
                f"got {self.optimization_cache_capacity}"
            )
        if not 0.0 < self.cache_auto_fraction <= 1.0:
            raise ValueError("BagPipeConfig.cache_auto_fraction must be in (0, 1]")
        if self.bagpipe_aggregation == "writeback" and self.read_mode != "bagpipe":
            raise ValueError(
                "BagPipeConfig.bagpipe_aggregation 'writeback' needs read_mode 'bagpipe' (the "
                f"caches own the rows they hold), got read_mode {self.read_mode!r}"
            )
        for name in ("lookahead", "lookahead_max"):
            if getattr(self, name) < 0:
                raise ValueError(f"BagPipeConfig.{name} must be >= 0")
        if self.lookahead_max:
            if self.lookahead_max < self.lookahead:
                raise ValueError(
                    f"BagPipeConfig.lookahead_max ({self.lookahead_max}) must be 0 or >= "
                    f"lookahead ({self.lookahead})"
                )
            if self.eviction_policy != "oracle":
                raise ValueError(
                    "BagPipeConfig.lookahead_max needs eviction_policy 'oracle' (the window "
                    f"only ranks victims under it), got {self.eviction_policy!r}"
                )
        if self.placement_min_rows is not None and self.placement_min_rows < 0:
            raise ValueError(
                f"BagPipeConfig.placement_min_rows must be >= 0, got {self.placement_min_rows}"
            )
        if (self.placement_memory_fraction is not None
                and not 0.0 <= self.placement_memory_fraction <= 1.0):
            raise ValueError(
                "BagPipeConfig.placement_memory_fraction must be in [0, 1], got "
                f"{self.placement_memory_fraction}"
            )
        for name in ("prepared_batches", "store_threads", "max_packet_rows", "inflight_packets"):
            if getattr(self, name) < 1:
                raise ValueError(f"BagPipeConfig.{name} must be >= 1")
        if self.ps_shards is not None and self.ps_shards < 1:
            raise ValueError("BagPipeConfig.ps_shards must be >= 1")
        if self.ps_addresses and self.ps_shards not in (None, len(self.ps_addresses)):
            raise ValueError(
                f"BagPipeConfig.ps_shards ({self.ps_shards}) does not match the "
                f"{len(self.ps_addresses)} ps_addresses"
            )
        for addr in self.ps_addresses:
            host, sep, port = addr.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"BagPipeConfig.ps_addresses: {addr!r} is not host:port")
        if self.memory_budget is not None:
            self.memory_budget_bytes()  # raises on a malformed value
        for name in ("ps_timeout", "connect_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"BagPipeConfig.{name} must be > 0 seconds")
        if self.checkpoint_every < 0:
            raise ValueError("BagPipeConfig.checkpoint_every must be >= 0 (0: only when asked)")
        if self.ps_checkpoint_max_failures < 0:
            raise ValueError("BagPipeConfig.ps_checkpoint_max_failures must be >= 0 (0: never)")
        if self.ps_checkpoint_full_every < 1:
            raise ValueError("BagPipeConfig.ps_checkpoint_full_every must be >= 1")
        if not 0.0 < self.ps_checkpoint_chain_fraction < float("inf"):
            raise ValueError("BagPipeConfig.ps_checkpoint_chain_fraction must be > 0")

    # ---- derived values ---------------------------------------------------------------------
    def memory_budget_bytes(self) -> int | None:
        """The budget in bytes; -1 means 'auto'; None means unlimited."""
        if self.memory_budget is None:
            return None
        return parse_memory_budget(str(self.memory_budget), "BagPipeConfig.memory_budget")

    @property
    def window_batches(self) -> int:
        """How many batches ahead of the running step are submitted and planned: the
        adaptive window's bound, else `lookahead`; 0 without a cache (read_mode ps)."""
        if self.read_mode != "bagpipe":
            return 0
        return max(self.lookahead, self.lookahead_max)

    def resolved_gradient_division(self) -> bool:
        """Whether summed gradients are divided by the world size (TorchRec's switch)."""
        if self.gradient_division is not None:
            return self.gradient_division
        try:
            from torchrec.distributed.comm_ops import get_gradient_division
        except ImportError:  # torchrec absent: TorchRec's default
            return True
        return bool(get_gradient_division())

    def cache_rows(self, table_rows: int) -> int:
        """Resident row capacity of one rank's cache for a fused table of `table_rows` rows."""
        units = self.optimization_cache_capacity
        if units is None:
            wanted = max(1, int(table_rows * self.cache_auto_fraction))
            units = max(1, -(-wanted // ROWS_PER_CACHE_UNIT))
        return units * ROWS_PER_CACHE_UNIT

    def replace(self, **changes: Any) -> BagPipeConfig:
        return dataclasses.replace(self, **changes)

    # ---- CLI ------------------------------------------------------------------------------
    @classmethod
    def add_arguments(
        cls,
        parser: argparse.ArgumentParser | Any,
        names: Sequence[str] | None = None,
        *,
        group: str | None = "BagPipe",
    ) -> None:
        """Adds one ``--flag`` per field (``--foo-bar`` for ``foo_bar``), with the field's
        help. `names`: only these fields (a program that takes a few of them, like the PS
        server). `group`: the argument group's title; None adds the flags to `parser` itself
        (which may be an argument group)."""
        hints = get_type_hints(cls)
        known = {f.name: f for f in fields(cls)}
        if names is not None:
            for name in names:
                if name not in known:
                    raise ValueError(f"BagPipeConfig has no field {name!r}")
        target = parser.add_argument_group(group) if group is not None else parser
        for f in fields(cls):
            if names is not None and f.name not in names:
                continue
            flag = "--" + f.name.replace("_", "-")
            tp = hints[f.name]
            help_text = f.metadata.get("help", "")
            if f.default is not dataclasses.MISSING:
                default = f.default
            else:
                default = f.default_factory()  # type: ignore[misc]
            kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": help_text}
            base = _strip_optional(tp)
            if base is bool:
                if tp is bool:
                    kwargs["action"] = argparse.BooleanOptionalAction
                else:
                    kwargs["type"] = _parse_bool
                    kwargs["metavar"] = "{true,false}"
            elif _literal_values(base) is not None:
                kwargs["choices"] = sorted(_literal_values(base))  # type: ignore[arg-type]
                kwargs["type"] = _case_insensitive(_literal_values(base))  # type: ignore[arg-type]
            elif get_origin(base) is list:
                kwargs["nargs"] = "*"
                kwargs["type"] = str
            elif base in (int, float, str):
                kwargs["type"] = base
            else:  # pragma: no cover - a new field type must be taught here
                raise TypeError(f"no CLI mapping for BagPipeConfig.{f.name}: {tp}")
            target.add_argument(flag, **kwargs)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> BagPipeConfig:
        """Builds a config from a namespace filled by `add_arguments` (extra names ignored)."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        values.update(overrides)
        return cls(**values)


def _strip_optional(tp: Any) -> Any:
    args = get_args(tp)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return tp


def _literal_values(tp: Any) -> set[Any] | None:
    tp = _strip_optional(tp)
    if get_origin(tp) is Literal:
        return set(get_args(tp))
    return None


def _parse_bool(text: str) -> bool:
    t = str(text).strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _case_insensitive(values: set[str]):
    lookup = {v.lower(): v for v in values}

    def parse(text: str) -> str:
        return lookup.get(text.lower(), text)

    return parse
