"""Datasets: synthetic power-law Criteo-like data and Criteo TSV/NPY readers."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "PowerLawCriteoDataset": "torchrec_bagpipe.datasets.synthetic",
    "power_law_ranks": "torchrec_bagpipe.datasets.synthetic",
    "unscatter_ids": "torchrec_bagpipe.datasets.synthetic",
    "scatter_ids": "torchrec_bagpipe.datasets.synthetic",
    "CriteoTSVDataset": "torchrec_bagpipe.datasets.criteo",
    "CriteoNPYDataset": "torchrec_bagpipe.datasets.criteo",
    "arrays_to_batch": "torchrec_bagpipe.datasets.criteo",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'torchrec_bagpipe.datasets' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = sorted(_LAZY)
