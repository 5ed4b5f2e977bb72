"""The runtime's `Collectives` protocol over a torch.distributed process group.

The BagPipe runtime never imports torch.distributed (ARCHITECTURE §4); the TorchRec layer
injects this adapter. It runs on a dedicated gloo group created once per process, so the
runtime's ID exchanges and gradient all-reduces never interleave with DDP's buckets or
TorchRec's all-to-alls on the default group, and every collective is bounded by the
group's timeout.

Thread-safety: one caller at a time per instance (the rank's training thread or its
autograd thread, which never run concurrently for one rank).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

__all__ = ["TorchDistCollectives", "new_runtime_group"]


def new_runtime_group(timeout_s: float) -> dist.ProcessGroup:
    """A gloo group over every rank of the default group, with a bounded timeout.

    REQUIRES: the default process group is initialised; every rank calls this in the same
    order (it is itself a collective).
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "torchrec_bagpipe needs torch.distributed to be initialised "
            "(torch.distributed.init_process_group) before sharding"
        )
    group = dist.new_group(
        ranks=list(range(dist.get_world_size())),
        backend="gloo",
        timeout=datetime.timedelta(seconds=float(timeout_s)),
    )
    assert group is not None
    return group


class TorchDistCollectives:
    """`Collectives` (runtime/collectives.py) backed by a gloo process group."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group
        self.rank: int = dist.get_rank(group)
        self.world_size: int = dist.get_world_size(group)
        self._width = 0  # payload bytes per rank the next all_gather sends in one collective

    @property
    def group(self) -> dist.ProcessGroup:
        """The gloo group (e.g. for sharded tensors whose shards live on the CPU)."""
        return self._group

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Gathers a 1-D tensor of any length from every rank, in rank order.

        One collective when every rank's payload fits the width the previous call agreed on
        (the largest payload it saw plus 25 %, rounded up to 64 bytes): each rank sends an
        8-byte length header and its bytes padded to that width. A larger payload costs a
        second collective for the overflow. Every rank sees every header, so all ranks agree
        on the width without extra messages.
        """
        if t.dim() != 1:
            raise ValueError(f"all_gather: expected a 1-D tensor, got shape {tuple(t.shape)}")
        src = t.detach().contiguous().cpu()
        if self.world_size == 1:
            return [src.clone()]
        payload = src.view(torch.uint8) if src.numel() else torch.empty(0, dtype=torch.uint8)
        nbytes = payload.numel()
        width = self._width
        first = torch.zeros(8 + width, dtype=torch.uint8)
        first[:8].view(torch.int64)[0] = nbytes
        head = min(nbytes, width)
        first[8 : 8 + head] = payload[:head]
        gathered = [torch.empty(8 + width, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(gathered, first, group=self._group)
        sizes = [int(g[:8].view(torch.int64)[0]) for g in gathered]
        largest = max(sizes)
        parts = [g[8 : 8 + min(n, width)] for g, n in zip(gathered, sizes)]
        if largest > width:
            extra = largest - width
            second = torch.zeros(extra, dtype=torch.uint8)
            if nbytes > width:
                second[: nbytes - width] = payload[width:]
            rest = [torch.empty(extra, dtype=torch.uint8) for _ in range(self.world_size)]
            dist.all_gather(rest, second, group=self._group)
            parts = [p if n <= width else torch.cat([p, r[: n - width]])
                     for p, r, n in zip(parts, rest, sizes)]
        self._width = -(-int(largest * 1.25) // 64) * 64
        return [p.view(src.dtype) if p.numel() else torch.empty(0, dtype=src.dtype)
                for p in parts]

    def all_reduce_sum_(self, t: torch.Tensor) -> None:
        """Sums `t` over ranks in place; every rank ends with the same bits."""
        if self.world_size == 1:
            return
        if t.device.type == "cpu":
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self._group)
            return
        staged = t.detach().cpu()
        dist.all_reduce(staged, op=dist.ReduceOp.SUM, group=self._group)
        t.copy_(staged)

    def barrier(self) -> None:
        if self.world_size == 1:
            return
        # A tiny all-reduce rather than dist.barrier: gloo's barrier is fine too, but the
        # all-reduce is bounded by the group's timeout on every backend.
        token = torch.zeros(1)
        dist.all_reduce(token, group=self._group)

    def all_gather_object(self, obj: object) -> list[object]:
        """Every rank's picklable object, in rank order (small metadata only)."""
        out: list[object] = [None] * self.world_size
        if self.world_size == 1:
            out[0] = obj
        else:
            dist.all_gather_object(out, obj, group=self._group)
        return out

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        """Broadcasts a picklable object from `src` (used for small metadata only)."""
        box = [obj]
        if self.world_size > 1:
            dist.broadcast_object_list(box, src=src, group=self._group)
        return box[0]
