"""PS backends for the runtime simulations: the real PS in-process (local transport).

`LocalPSBackend` hosts `num_shards` PSShard objects in this process; every simulated rank gets
its own PSClient whose endpoints are the shard objects themselves (no sockets). The table is
loaded with the test's initial rows by an `assign` before any step, so the exact numpy
reference (`reference_run`) starts from the same values.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import torch

from torchrec_bagpipe.ps import Partitioner, PSClient, start_local_shards
from torchrec_bagpipe.ps.optimizer_spec import OptimizerSpec

TABLE = "bagpipe_test"


class LocalPSBackend:
    def __init__(
        self,
        num_keys: int,
        dim: int,
        world_size: int,
        lr: float,
        divide: bool,
        init: np.ndarray,
        timeout: float,
        *,
        num_shards: int = 2,
        partitioner: str = "modulo",
        optimizer: OptimizerSpec | str = "sgd",
    ) -> None:
        self.num_keys = num_keys
        self.dim = dim
        self.optimizer = OptimizerSpec.of(optimizer)
        self.shards = start_local_shards(num_shards)
        self.partitioner = Partitioner(partitioner, num_shards)
        self.clients = [
            PSClient(self.shards, table=TABLE, dim=dim, lr=lr, rank=r, world_size=world_size,
                     gradient_division=divide, partitioner=partitioner, timeout=timeout,
                     key_bound=num_keys, optimizer=self.optimizer)
            for r in range(world_size)
        ]
        self.clients[0].assign(torch.arange(num_keys), torch.from_numpy(init.copy()))

    def client(self, rank: int) -> PSClient:
        return self.clients[rank]

    def committed_step(self) -> int:
        return min(s.committed_step(TABLE) for s in self.shards)

    def _rows(self) -> np.ndarray:
        """Every row with its optimizer state, read from its shard."""
        keys = torch.arange(self.num_keys)
        owner = self.partitioner.shard_of(keys)
        out = np.empty((self.num_keys, self.dim + self.optimizer.state_dim(self.dim)),
                       dtype=np.float32)
        for s, shard in enumerate(self.shards):
            mine = keys[owner == s]
            out[mine.numpy()] = shard.lookup(TABLE, mine, with_state=True).numpy()
        return out

    def snapshot(self) -> np.ndarray:
        return np.ascontiguousarray(self._rows()[:, :self.dim])

    def snapshot_state(self) -> np.ndarray:
        return np.ascontiguousarray(self._rows()[:, self.dim:])

    def close(self) -> None:
        for c in self.clients:
            with contextlib.suppress(Exception):
                c.close()
        for s in self.shards:
            s.close()


def local_backend(num_shards: int, partitioner: str = "modulo"):
    """A simulate() backend factory for `num_shards` in-process shards."""
    return functools.partial(LocalPSBackend, num_shards=num_shards, partitioner=partitioner)
