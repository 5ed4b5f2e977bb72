"""Loads the native extension with an actionable error when it has not been built."""

from __future__ import annotations

try:
    from torchrec_bagpipe import _C
except ImportError as e:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "torchrec_bagpipe's native extension (_C) is not built: run `make build` in the "
        f"source tree or `pip install .` ({e})"
    ) from e

C = _C
SessionError = _C.SessionError
TransportError = _C.TransportError
ShuttingDownError = _C.ShuttingDownError

__all__ = ["C", "SessionError", "ShuttingDownError", "TransportError"]
