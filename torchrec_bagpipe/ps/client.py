"""PSClient: one trainer rank's connection to the PS shards of one fused table.

Commits and reads are asynchronous: ``commit_async`` / ``get_async`` return a `PSHandle` at
once and a native worker thread partitions the keys, packs bounded packets and sends them
(round-robin across shards, up to ``inflight_packets`` per shard before waiting for ACKs)
with the GIL released. Tensors cross zero-copy and are borrowed until the handle is done:
the client keeps them alive, the caller must not modify them meanwhile.

Endpoints, one per shard in shard order, may mix transports: a `PSShard` object of this
process (local: no sockets), ``"host:port"`` / ``"tcp://host:port"`` / ``(host, port)`` (TCP),
``"ucx://host:port"`` / ``"rdma://host:port"`` (UCX, see `torchrec_bagpipe.ps.rdma`).
"""

from __future__ import annotations

import contextlib
import numbers
import threading
from collections.abc import Sequence
from typing import Any

import torch

from torchrec_bagpipe._native import C
from torchrec_bagpipe.ps import rdma
from torchrec_bagpipe.ps._args import float_arg, int_arg, spec_arg, step_lr_arg
from torchrec_bagpipe.ps._tensor_args import keys_arg, rows_arg
from torchrec_bagpipe.ps.client_spec import ClientSpec, default_session_id
from torchrec_bagpipe.ps.partitioner import Partitioner
from torchrec_bagpipe.ps.shard import PSShard

__all__ = ["PSClient", "PSHandle", "StartStepError", "default_session_id"]


# A table's committed step on a PS shard is not the step a session declared it starts after
# (`ClientSpec.expected_step`), refused by the shard when the session opens: a restored shard
# or a long-lived server reached by a new job (whose steps up to the committed one would be
# acknowledged without being applied), a resume from another step, or shards of one table at
# different steps (not one consistent checkpoint). A ValueError; raised by the native core.
StartStepError = C.StartStepError


def _num_endpoints(endpoints: Any) -> int:
    if isinstance(endpoints, (str, bytes)) or not isinstance(endpoints, Sequence):
        raise TypeError("endpoints must be a sequence (one endpoint per shard, in shard order)")
    return len(endpoints)


def _endpoint(e: Any, index: int) -> Any:
    if isinstance(e, PSShard):
        return e.core
    if isinstance(e, C.PSShardCore):
        return e
    if isinstance(e, tuple) and len(e) == 2:
        host, port = e
        if (not isinstance(host, str) or isinstance(port, bool)
                or not isinstance(port, numbers.Integral)):
            raise TypeError(f"endpoints[{index}] must be (host: str, port: int)")
        return (host, int(port))
    if isinstance(e, str):
        text = e
        is_rdma = text.startswith("ucx://") or text.startswith("rdma://")
        if is_rdma:
            rdma.require_rdma()
            text = text.split("://", 1)[1]
        if text.startswith("tcp://"):
            text = text[len("tcp://"):]
        host, sep, port = text.rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"endpoints[{index}] = {e!r} is not host:port")
        return ("ucx", host, int(port)) if is_rdma else (host, int(port))
    raise TypeError(
        f"endpoints[{index}] must be a PSShard, 'host:port' or (host, port), got {type(e).__name__}"
    )


class PSHandle:
    """An asynchronous commit / get / assign / checkpoint.

    ``wait(timeout)`` returns the rows (get), the per-shard checkpoint steps (checkpoint) or
    None, and raises the operation's error (SessionError, TransportError, ValueError) or
    TimeoutError when it is not done within `timeout` seconds (the operation continues; wait
    again). ``done()`` never blocks.
    """

    __slots__ = ("_client", "_keep", "_kind", "_op", "_result")

    def __init__(
        self, op: Any, kind: str, result: Any, keep: tuple[Any, ...], client: PSClient
    ) -> None:
        self._op = op
        self._kind = kind
        self._result = result
        self._keep = keep
        self._client = client

    @property
    def kind(self) -> str:
        return self._kind

    @property
    def step(self) -> int:
        """The commit step, or the get's at_step (-1 for other operations)."""
        return int(self._op.step)

    def done(self) -> bool:
        return bool(self._op.done())

    def wait(self, timeout: float | None = None) -> Any:
        t = self._client.timeout if timeout is None else float_arg(timeout, "timeout")
        if t < 0:
            raise ValueError(f"timeout must be >= 0, got {t}")
        try:
            self._op.wait(t)
        except TimeoutError as e:
            raise TimeoutError(f"{e} (waited {t:g} s; shards committed "
                               f"{self._client.shard_committed_steps()})") from None
        self._keep = ()
        if self._kind == "checkpoint":
            return list(self._op.shard_steps)
        return self._result

    def __repr__(self) -> str:
        return f"PSHandle({self._kind}, step={self.step}, done={self.done()})"


class PSClient:
    """One rank's client of one fused table on the PS (docs/ARCHITECTURE.md §3).

    Built from `endpoints` (one per shard, in shard order) and a `ClientSpec` (or its fields
    as keywords: ``PSClient(endpoints, table="t", dim=16, lr=0.1, rank=r, world_size=W)``;
    with a spec they replace its fields; `partitioner` may also be a `Partitioner` of
    ``len(endpoints)`` shards). The session (`table`, `dim`, `world_size`,
    `gradient_division`, the init of rows never written, `key_bound`, the table's
    `optimizer`) opens on every shard at construction; a shard that holds the session or the
    table with other values refuses with a ValueError naming the table and the field, and
    one whose committed step is not the session's declared start (`expected_step`: -1 for a
    new job, the default; s for a resume from step s; None: no check) refuses with a
    `StartStepError` naming the table and the steps. `lr`
    is the learning rate of a commit that passes none: each commit carries its step's (an LR
    schedule; for Adam the bias-corrected step size, `ps.optimizer_spec.adam_step_size`),
    and every rank must commit a step with the same one. Every wait is bounded by `timeout`
    seconds; a dead shard fails pending work at once (TransportError), a lost rank surfaces
    as a TimeoutError or SessionError.
    """

    def __init__(self, endpoints: Sequence[Any], spec: ClientSpec | None = None, /,
                 **fields: Any) -> None:
        self._core: Any = None
        self._closed = False
        self._lock = threading.Lock()
        self._pending: list[PSHandle] = []
        self._stager: Any = None  # DeviceStagerCore, created by the first CUDA commit
        n = _num_endpoints(endpoints)
        partitioner = fields.get("partitioner")
        if isinstance(partitioner, Partitioner):
            if partitioner.num_shards != n:
                raise ValueError(
                    f"partitioner has {partitioner.num_shards} shards but {n} endpoints"
                )
            fields["partitioner"] = partitioner.kind
        spec = spec_arg(ClientSpec, spec, fields, "PSClient")
        eps = [_endpoint(e, i) for i, e in enumerate(endpoints)]
        if not eps:
            raise ValueError("endpoints must list at least one shard")
        self.spec = spec
        self.table = spec.table
        self.dim = spec.dim
        self.lr = spec.lr
        self.rank = spec.rank
        self.world_size = spec.world_size
        self.session_id = spec.session
        self.timeout = spec.timeout
        self.partitioner = Partitioner(spec.partitioner, len(eps))
        self.optimizer = spec.optimizer
        self.state_dim = self.optimizer.state_dim(self.dim)
        self._core = C.PSClientCore(eps, spec.native(), spec.native_connect())
        # Each shard's committed step when the session opened (OpenOk): -1 for a new table;
        # every shard checked it against `expected_step` (unless None).
        self.opened_steps: list[int] = list(self._core.shard_committed_steps())

    @property
    def expected_step(self) -> int | None:
        """The committed step the session declared it starts after (the shards checked it
        when it opened; its first step is this + 1), None if it attached without a check."""
        return self.spec.expected_step

    # ---- properties -----------------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        return self.partitioner.num_shards

    def __repr__(self) -> str:
        peers = self._core.shard_peers() if self._core is not None else []
        return (f"PSClient(table={self.table!r}, rank={self.rank}/{self.world_size}, "
                f"dim={self.dim}, shards={peers})")

    def _track(self, handle: PSHandle) -> PSHandle:
        # The client keeps every unfinished handle (and so its borrowed tensors) alive, also
        # when the caller drops it; the lock keeps concurrent callers from losing one.
        with self._lock:
            self._pending = [h for h in self._pending if not h.done()]
            self._pending.append(handle)
        return handle

    def _live(self) -> Any:
        if self._core is None:
            raise RuntimeError("PSClient is not open")
        return self._core

    # ---- protocol -------------------------------------------------------------------------
    def commit_async(
        self, step: int, keys: torch.Tensor, grads: torch.Tensor, lr: float | None = None,
        *, evict: torch.Tensor | None = None,
    ) -> PSHandle:
        """Commits this rank's gradient rows of `step` (keys: 1-D int64 on the CPU; grads:
        (n, dim) float32, on the CPU or in CUDA memory; n may be 0 — every rank commits every
        step) with the step's learning rate `lr` (finite, >= 0; None: the client's `lr`; for
        Adam the bias-corrected step size). Every rank must give a step the same lr (else the
        session fails: "conflicting lr"). The handle completes when every shard has committed
        `step`. `evict` (virtual tables): keys evicted at this step's boundary, erased by
        their shards with their optimizer state once the step is applied, before any read of
        the step is served (one rank sends them; docs/virtual_tables.md)."""
        step = int_arg(step, "step", minimum=0)
        lr = self.lr if lr is None else step_lr_arg(lr)
        e = None if evict is None or len(evict) == 0 else keys_arg(evict, "evict")
        if isinstance(grads, torch.Tensor) and grads.is_cuda:
            if e is not None:
                grads = grads.detach().to("cpu")  # evictions ride the host path
            else:
                return self._commit_async_device(step, keys, grads, lr)
        k = keys_arg(keys)
        g = rows_arg(grads, "grads", k.shape[0], self.dim)
        op = self._live().commit_async(step, k, g, lr, e)
        return self._track(PSHandle(op, "commit", None, (keys, grads, k, g, evict, e), self))

    def _commit_async_device(self, step: int, keys: torch.Tensor, grads: torch.Tensor,
                             lr: float) -> PSHandle:
        """Gradients in CUDA memory: an event is recorded on the current stream (after the
        backward pass wrote them); a native worker waits for it, copies the rows into a pinned
        host buffer and the client packs them from there. Keys stay on the CPU (they come from
        the CPU-side plans: no device round trip). `grads` and the event are kept alive in the
        handle until the commit is done."""
        if isinstance(keys, torch.Tensor) and keys.device.type != "cpu":
            raise TypeError(
                f"keys must be a CPU tensor, got device {keys.device}: commit IDs come from the "
                "CPU-side plans, never from a device round trip"
            )
        k = keys_arg(keys)
        if grads.dtype != torch.float32:
            raise TypeError(f"grads must have dtype torch.float32, got {grads.dtype}")
        if grads.layout != torch.strided or not grads.is_contiguous():
            raise TypeError("grads must be a dense, contiguous tensor")
        if grads.dim() != 2 or grads.shape[0] != k.shape[0] or grads.shape[1] != self.dim:
            raise ValueError(
                f"grads must have shape ({k.shape[0]}, {self.dim}), got {tuple(grads.shape)}"
            )
        g = grads.detach()
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(g.device))
        if self._stager is None:
            self._stager = C.DeviceStagerCore(self.timeout)
        source = C.DeviceSource()
        source.src = g.data_ptr()
        source.bytes = g.numel() * 4
        source.device = (g.device.index if g.device.index is not None
                         else torch.cuda.current_device())
        source.event = event.cuda_event
        op = C.commit_async_device(self._live(), step, k, self._stager, source, lr)
        return self._track(PSHandle(op, "commit", None, (keys, grads, k, g, event), self))

    def get_async(
        self, keys: torch.Tensor, at_step: int, out: torch.Tensor | None = None, *,
        with_state: bool = False,
    ) -> PSHandle:
        """Rows of `keys` (n, dim) once every shard committed `at_step` (-1: now); with
        `with_state`, each row followed by its optimizer state: (n, dim + state_dim). A get
        must follow this client's commit of `at_step`, or it fails with TimeoutError."""
        at_step = int_arg(at_step, "at_step", minimum=-1)
        with_state = bool(with_state)
        k = keys_arg(keys)
        width = self.dim + (self.state_dim if with_state else 0)
        if out is None:
            out = torch.empty((k.shape[0], width), dtype=torch.float32)
        o = rows_arg(out, "out", k.shape[0], width)
        if out.requires_grad:
            raise ValueError("out must not require grad")
        op = self._live().get_async(k, at_step, o, with_state)
        return self._track(PSHandle(op, "get", out, (keys, k, o), self))

    def commit(
        self, step: int, keys: torch.Tensor, grads: torch.Tensor, timeout: float | None = None,
        lr: float | None = None,
    ) -> None:
        """commit_async(step, keys, grads, lr).wait(timeout)."""
        self.commit_async(step, keys, grads, lr).wait(timeout)

    def get(self, keys: torch.Tensor, at_step: int, timeout: float | None = None) -> torch.Tensor:
        """get_async(...).wait(timeout)."""
        return self.get_async(keys, at_step).wait(timeout)

    def committed_step(self) -> int:
        """The minimum over shards of the committed step this client has observed."""
        return int(self._live().committed_step())

    def shard_committed_steps(self) -> list[int]:
        return list(self._live().shard_committed_steps())

    # ---- weights ------------------------------------------------------------------------------
    def assign(self, keys: torch.Tensor, rows: torch.Tensor, timeout: float | None = None, *,
               with_state: bool = False) -> None:
        """Writes rows (n, dim) for keys on their shards (loading weights; stored rows keep
        their optimizer state; the last duplicate wins); with `with_state`, rows
        (n, dim + state_dim) carry their optimizer state after the weights. Runs after every
        earlier operation and before every later one."""
        self.assign_async(keys, rows, with_state=with_state).wait(timeout)

    def assign_async(self, keys: torch.Tensor, rows: torch.Tensor, *,
                     with_state: bool = False) -> PSHandle:
        """`assign` without the wait: each shard applies the rows on arrival, after this
        client's earlier messages and before its later ones (so before a commit sent after
        it: write-back aggregation's ordering)."""
        k = keys_arg(keys)
        with_state = bool(with_state)
        r = rows_arg(rows, "rows", k.shape[0], self.dim + (self.state_dim if with_state else 0))
        op = self._live().assign_async(k, r, with_state)
        return self._track(PSHandle(op, "assign", None, (keys, rows, k, r), self))

    def lookup(self, keys: torch.Tensor, timeout: float | None = None, *,
               with_state: bool = False) -> torch.Tensor:
        """Rows of `keys` at the shards' current committed step (materialising weights;
        `with_state` as `get_async`)."""
        return self.get_async(keys, -1, with_state=with_state).wait(timeout)

    def checkpoint(self, timeout: float | None = None, *, label: str = "") -> list[int]:
        """Checkpoints this table on every shard (each into its own checkpoint directory, or
        its subdirectory `label`: 1-128 characters of [A-Za-z0-9_.:-]) at its committed
        step; returns the step saved per shard."""
        if not isinstance(label, str):
            raise TypeError(f"label must be a str, got {type(label).__name__}")
        op = self._live().checkpoint_async(label)
        return self._track(PSHandle(op, "checkpoint", None, (), self)).wait(timeout)

    # ---- accounting and shutdown ---------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """commits, gets, packets, bytes_sent, bytes_received, ack_waits, rows_committed,
        rows_read (counted by this client over every shard)."""
        return dict(self._live().stats())

    def channel_stats(self) -> list[dict[str, Any]]:
        """Per shard, in shard order: peer, frames_sent, bytes_sent, frames_received,
        bytes_received, slot_waits (waits for an ACK with the window full), flushes, and for
        the rdma transport one_sided_writes and doorbells."""
        return list(self._live().channel_stats())

    def failure(self) -> str | None:
        """The error that failed this client, if any."""
        return self._live().failure()

    def checkpoint_report(self) -> dict[str, Any]:
        """What the shards reported about their periodic checkpoints of this table (shards
        started with a checkpoint interval tell every attached rank how each one went):
        succeeded, failed, consecutive_failures (the longest current run of failures on one
        shard), last_step (per shard, -1: none yet), last_error ("" if none)."""
        return dict(self._live().checkpoint_report())

    def close(self, timeout: float | None = None) -> None:
        """Drains pending work, closes the session on every reachable shard and releases the
        connections. Idempotent; raises TimeoutError if draining timed out. Later operations
        raise SessionError."""
        core = self._core
        if core is None or self._closed:
            return
        self._closed = True
        try:
            core.close(self.timeout if timeout is None else float_arg(timeout, "timeout"))
        finally:
            with self._lock:
                self._pending.clear()
            self._stager = None  # joins the staging worker

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            with contextlib.suppress(Exception):  # the original exception matters more
                self.close()

    def __del__(self) -> None:
        core = getattr(self, "_core", None)
        if core is not None and not getattr(self, "_closed", True):
            self._closed = True
            with contextlib.suppress(Exception):
                core.close(min(getattr(self, "timeout", 5.0), 5.0))
