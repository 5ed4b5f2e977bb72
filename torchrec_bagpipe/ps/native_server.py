"""The Python face shared by the native shard servers (TCP: `ps.shard.ShardServer`, UCX:
`ps.rdma.UcxShardServer`): address, stop and counters of a server running on background
native threads. Both shard.py and rdma.py build on it; neither imports the other's server."""

from __future__ import annotations

from typing import Any

__all__ = ["NativeServer"]


class NativeServer:
    """A shard server (TCP or UCX) running on background native threads; `_core` is its
    native handle (host, port, stopped, stop(drain_timeout), stats())."""

    _scheme = ""  # the endpoint prefix clients use for this transport

    def __init__(self, core: Any, shard: Any) -> None:
        self._core = core
        self.shard = shard  # the PSShard it serves

    @property
    def host(self) -> str:
        return str(self._core.host)

    @property
    def port(self) -> int:
        return int(self._core.port)

    @property
    def address(self) -> str:
        """The `PSClient` endpoint of this server (IPv6 hosts bracketed)."""
        host = self.host
        port = self.port
        return self._scheme + (f"[{host}]:{port}" if ":" in host else f"{host}:{port}")

    @property
    def stopped(self) -> bool:
        return bool(self._core.stopped)

    def stop(self, drain_timeout: float = 0.0) -> None:
        """Stops accepting, waits up to `drain_timeout` s for clients to disconnect, then
        closes the remaining connections (their ranks leave their sessions)."""
        self._core.stop(float(drain_timeout))

    def stats(self) -> dict[str, int]:
        """accepted, refused (every slot authenticated), shed (unauthenticated connections
        closed to admit newer ones), handshake_timeouts, idle_timeouts, active,
        unauthenticated, frames, bytes_in, bytes_out, closed_by_server (protocol or
        authentication violations), threads (serving threads)."""
        return dict(self._core.stats())

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.address}, "
                f"shard={self.shard.shard_id}/{self.shard.num_shards})")
