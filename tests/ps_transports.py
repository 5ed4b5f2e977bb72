"""The transports the PS suites run over, in turn: how to serve a shard and name it on each.

``rdma-sm`` and ``rdma-tcp`` are the rdma (UCX) backend with ``UCX_TLS=sm`` (frames written
one-sided into the shard's registered slots) and ``UCX_TLS=tcp`` (frames carried by their
doorbells). They need a build with UCX (`torchrec_bagpipe.ps.rdma.HAVE_UCX`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest

from torchrec_bagpipe.ps import rdma

_NO_UCX = pytest.mark.skipif(not rdma.HAVE_UCX, reason="this build has no UCX")
RDMA = [pytest.param(t, marks=_NO_UCX) for t in ("rdma-sm", "rdma-tcp")]


def params(*plain: str) -> list[Any]:
    """`plain` transports ("local", "tcp") followed by the two rdma ones."""
    return [*plain, *RDMA]


@contextlib.contextmanager
def transport_env(transport: str) -> Iterator[None]:
    """UCX_TLS for an rdma-* transport while the block runs (UCX reads it at connection set-up,
    server processes and rank workers inherit it)."""
    if not transport.startswith("rdma-"):
        yield
        return
    old = os.environ.get("UCX_TLS")
    os.environ["UCX_TLS"] = transport.split("-", 1)[1]
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("UCX_TLS", None)
        else:
            os.environ["UCX_TLS"] = old


def endpoint(shard: Any, transport: str, job_token: str = "") -> Any:
    """The endpoint a client uses to reach in-process `shard` over `transport`."""
    if transport == "local":
        return shard
    if transport == "tcp":
        return shard.serve(job_token=job_token).address
    return shard.serve_ucx(job_token=job_token).address


def server_args(transport: str) -> list[str]:
    """Extra `torchrec-bagpipe-ps` flags for a server process of `transport`."""
    return ["--transport", "rdma"] if transport.startswith("rdma") else []


def address(server: Any, transport: str) -> str:
    """The client endpoint of a `spawn_server` process of `transport`."""
    return f"ucx://{server.address}" if transport.startswith("rdma") else server.address
