"""The job's rendezvous store: how PS shards and trainer nodes find each other.

One `torch.distributed.TCPStore` per job, at the rendezvous endpoint (``host:port``). It is
hosted by PS replica 0 in a torchx job (the job's first role, so torchx's ``rank0_env``
names its host on every scheduler) or by `torchrec-bagpipe-launch` on one node; every
other process is a client. torchrun's c10d rendezvous of the trainers uses the same store
(``--rdzv-conf is_host=0``), so a job needs one reachable port. Keys, all under
``torchrec_bagpipe/<run id>/`` (torchrun's own keys live under ``torch.rendezvous.``):

* ``token``: the job token PS servers require (the first PS replica, or the launcher, sets
  it; everyone else reads it);
* ``ps/<i>``: PS shard i's address ``host:port``;
* ``ps/exited/<i>``: PS shard i's exit status (replica 0 waits for these before it stops
  hosting the store);
* ``ps/draining/<i>``: why PS shard i started draining before the trainers were done (its
  server got SIGTERM, or its role was interrupted); trainer nodes then stop their trainers
  at once instead of waiting for the shard to exit;
* ``trainer/beat/<n>``: trainer node n's heartbeat counter (advanced every
  `HEARTBEAT_S` while its trainers run);
* ``trainer/done/<n>``: trainer node n's exit status (set by the node, or ``lost`` by the PS
  when its heartbeat stops); PS shards drain and exit once every node is done, and trainer
  nodes stop early when another node failed.

Thread-safety: a `JobStore` is used by one thread at a time (each role keeps one per thread).
Every wait is bounded by a timeout.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence

__all__ = ["HEARTBEAT_S", "JobStore", "TrainerWatch", "parse_endpoint"]

HEARTBEAT_S = 2.0


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` (IPv6 hosts in brackets) -> (host, port); port 0 lets a host pick."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"rendezvous endpoint must be host:port, got {endpoint!r}")
    return host.strip("[]"), int(port)


class JobStore:
    """A client (or, with `host=True`, the server) of the job's rendezvous store."""

    def __init__(self, endpoint: str, run_id: str, *, host: bool = False,
                 timeout: float = 300.0) -> None:
        from torch.distributed import TCPStore

        self.host_name, port = parse_endpoint(endpoint)
        if port == 0 and not host:
            raise ValueError(f"a rendezvous client needs the store's port, got {endpoint!r}")
        self.timeout = timeout
        # Connecting retries until `timeout`: the host may start after its clients.
        self.store = TCPStore(self.host_name, port, is_master=host, multi_tenant=True,
                              wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout))
        self.port = int(self.store.port)
        self.prefix = f"torchrec_bagpipe/{run_id}/"

    @property
    def endpoint(self) -> str:
        return f"{self.host_name}:{self.port}"

    def _k(self, name: str) -> str:
        return self.prefix + name

    def _get(self, name: str, timeout: float) -> str:
        self.store.wait([self._k(name)], datetime.timedelta(seconds=timeout))
        return self.store.get(self._k(name)).decode()

    def _has(self, names: Sequence[str]) -> bool:
        return bool(self.store.check([self._k(n) for n in names]))

    # ---- job token ------------------------------------------------------------------------
    def agree_token(self, proposal: str, timeout: float) -> str:
        """The job's token: `proposal` if no one set one before (compare-and-set)."""
        value = self.store.compare_set(self._k("token"), "", proposal)
        if isinstance(value, bytes):
            value = value.decode()
        return value or self._get("token", timeout)

    # ---- PS shards ------------------------------------------------------------------------
    def publish_ps(self, shard: int, address: str) -> None:
        self.store.set(self._k(f"ps/{shard}"), address)

    def ps_addresses(self, shards: int, timeout: float,
                     abort: Callable[[], str | None] | None = None) -> list[str]:
        """Every shard's address, in shard order; TimeoutError naming the missing ones,
        RuntimeError when a shard exited first or `abort` returns a reason."""
        deadline = time.monotonic() + timeout
        while True:
            why = abort() if abort is not None else None
            if why:
                raise RuntimeError(why)
            missing = [i for i in range(shards) if not self._has([f"ps/{i}"])]
            if not missing:
                return [self._get(f"ps/{i}", timeout) for i in range(shards)]
            failed = [i for i in missing if self._has([f"ps/exited/{i}"])]
            if failed:
                raise RuntimeError(f"PS shard {failed[0]} exited before it was serving")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"PS shards {missing} did not publish their addresses within {timeout}s"
                )
            time.sleep(0.2)

    def ps_draining(self, shard: int, why: str) -> None:
        self.store.set(self._k(f"ps/draining/{shard}"), why)

    def ps_draining_reasons(self, shards: Sequence[int]) -> dict[int, str]:
        return {i: self._get(f"ps/draining/{i}", self.timeout) for i in shards
                if self._has([f"ps/draining/{i}"])}

    def ps_exited(self, shard: int, status: int) -> None:
        self.store.set(self._k(f"ps/exited/{shard}"), str(status))

    def ps_exit_statuses(self, shards: Sequence[int]) -> dict[int, int]:
        return {i: int(self._get(f"ps/exited/{i}", self.timeout)) for i in shards
                if self._has([f"ps/exited/{i}"])}

    # ---- trainer nodes --------------------------------------------------------------------
    def beat(self, node: int) -> int:
        return int(self.store.add(self._k(f"trainer/beat/{node}"), 1))

    def beats(self, node: int) -> int:
        return int(self.store.add(self._k(f"trainer/beat/{node}"), 0))

    def trainer_done(self, node: int, status: str) -> None:
        self.store.set(self._k(f"trainer/done/{node}"), status)

    def trainers_done(self, nodes: int) -> dict[int, str]:
        """Statuses of the trainer nodes that are done (node -> "0", "1", ..., "lost")."""
        return {n: self._get(f"trainer/done/{n}", self.timeout) for n in range(nodes)
                if self._has([f"trainer/done/{n}"])}


class TrainerWatch:
    """Tells when every trainer node is done: its done key is set, or its heartbeat has not
    advanced for `beat_timeout` seconds (then it is marked ``lost``); a node gets
    `start_timeout` seconds for its first heartbeat."""

    def __init__(self, store: JobStore, nodes: int, start_timeout: float,
                 beat_timeout: float) -> None:
        self.store = store
        self.nodes = nodes
        self.beat_timeout = beat_timeout
        now = time.monotonic()
        self.seen = {n: (0, now + start_timeout - beat_timeout) for n in range(nodes)}

    def all_done(self) -> bool:
        done = self.store.trainers_done(self.nodes)
        now = time.monotonic()
        for n in range(self.nodes):
            if n in done:
                continue
            beats = self.store.beats(n)
            last, since = self.seen[n]
            if beats != last:
                self.seen[n] = (beats, now)
            elif now - since > self.beat_timeout:
                print(f"[rendezvous] trainer node {n} sent no heartbeat for "
                      f"{self.beat_timeout:.0f}s; taking it as lost", flush=True)
                self.store.trainer_done(n, "lost")
                done[n] = "lost"
        return len(done) == self.nodes
