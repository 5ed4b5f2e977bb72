"""Datasets: synthetic power-law Criteo-like data and Criteo TSV/NPY readers."""

from __future__ import annotations

from torchrec_bagpipe._lazy import lazy_names

_LAZY = {
    "PowerLawCriteoDataset": "torchrec_bagpipe.datasets.synthetic",
    "power_law_ranks": "torchrec_bagpipe.datasets.synthetic",
    "unscatter_ids": "torchrec_bagpipe.datasets.synthetic",
    "scatter_ids": "torchrec_bagpipe.datasets.synthetic",
    "CriteoTSVDataset": "torchrec_bagpipe.datasets.criteo",
    "CriteoNPYDataset": "torchrec_bagpipe.datasets.criteo",
    "arrays_to_batch": "torchrec_bagpipe.datasets.criteo",
}


__getattr__, __dir__ = lazy_names(__name__, _LAZY)

__all__ = sorted(_LAZY)
