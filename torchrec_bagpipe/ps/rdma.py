"""The rdma (UCX) transport of the PS: availability, shard servers and endpoint names.

Shards serve UCX clients on a TCP control port (the bootstrap: job token, worker addresses,
the registered slot ring's remote key); frames then travel through UCX, written one-sided
into the shard's registered slots where UCX has native RMA (RC verbs on InfiniBand/RoCE,
shared memory on one host) or carried by active messages where it does not (TCP). UCX
chooses transports and devices from ``UCX_TLS`` / ``UCX_NET_DEVICES`` (e.g.
``UCX_TLS=rc,sm,self UCX_NET_DEVICES=mlx5_0:1``); the arguments below override them for
one server (`UcxServerSpec`).

Clients name a UCX shard ``"ucx://host:port"`` (or ``"rdma://host:port"``) in
`PSClient` endpoints. A build without UCX raises `RdmaUnavailableError` for either side.
"""

from __future__ import annotations

from typing import Any

from torchrec_bagpipe._native import C
from torchrec_bagpipe.ps._args import spec_arg
from torchrec_bagpipe.ps.native_server import NativeServer
from torchrec_bagpipe.ps.shard_specs import UcxServerSpec

__all__ = [
    "HAVE_UCX",
    "UCX_VERSION",
    "RdmaUnavailableError",
    "UcxShardServer",
    "rdma_endpoint",
    "require_rdma",
    "serve_ucx",
]

HAVE_UCX: bool = bool(C.HAVE_UCX)
UCX_VERSION: str = str(C.UCX_VERSION)


class RdmaUnavailableError(RuntimeError):
    """ps_type='rdma' was asked for in a build compiled without UCX (libucx-dev)."""


_UNAVAILABLE = (
    "ps_type='rdma' needs UCX (the ucx library, Debian/Ubuntu package libucx-dev, found through "
    "pkg-config 'ucx'), and this build of torchrec_bagpipe was compiled without it: install "
    "libucx-dev and rebuild (make build / pip install .), or use ps_type='tcp' or the "
    "single-node local backend"
)


def require_rdma() -> None:
    """Raises `RdmaUnavailableError` naming the missing library when UCX is not built in."""
    if not HAVE_UCX:
        raise RdmaUnavailableError(str(C.RDMA_UNAVAILABLE) or _UNAVAILABLE)


def rdma_endpoint(address: str) -> str:
    """The `PSClient` endpoint of the UCX shard listening at ``host:port``."""
    if not isinstance(address, str):
        raise TypeError(f"address must be a str 'host:port', got {type(address).__name__}")
    text = address
    for prefix in ("ucx://", "rdma://", "tcp://"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{address!r} is not host:port")
    return f"ucx://{text}"


class UcxShardServer(NativeServer):
    """A UCX server for one `PSShard`, running on background native threads."""

    _scheme = "ucx://"


def serve_ucx(shard: Any, spec: UcxServerSpec | None = None, /,
              **fields: Any) -> UcxShardServer:
    """Serves `shard` (a `PSShard`) over UCX as `spec` says (a `UcxServerSpec`, or its fields
    as keywords: host, port (0 picks a free control port), job_token, ``ucx_tls`` /
    ``ucx_devices`` overriding ``UCX_TLS`` / ``UCX_NET_DEVICES``, handshake_timeout,
    max_connections, ...)."""
    require_rdma()
    spec = spec_arg(UcxServerSpec, spec, fields, "serve_ucx")
    return UcxShardServer(C.serve_ucx(shard.core, spec.native()), shard)
