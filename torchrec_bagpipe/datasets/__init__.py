"""Datasets: synthetic power-law data; Criteo files through TorchRec's readers (layouts,
stages, TSV conversion), the multi-hot formats of TorchRec's DLRM example, and batch
transforms."""

from __future__ import annotations

from torchrec_bagpipe._lazy import lazy_names

_LAZY = {
    "PowerLawCriteoDataset": "torchrec_bagpipe.datasets.synthetic",
    "power_law_ranks": "torchrec_bagpipe.datasets.synthetic",
    "unscatter_ids": "torchrec_bagpipe.datasets.synthetic",
    "scatter_ids": "torchrec_bagpipe.datasets.synthetic",
    "StageFiles": "torchrec_bagpipe.datasets.criteo",
    "convert_tsvs": "torchrec_bagpipe.datasets.criteo",
    "criteo_days": "torchrec_bagpipe.datasets.criteo",
    "stage_files": "torchrec_bagpipe.datasets.criteo",
    "MultiHot": "torchrec_bagpipe.datasets.multi_hot",
    "MultiHotCriteoDataset": "torchrec_bagpipe.datasets.multi_hot",
    "rank_batch_rows": "torchrec_bagpipe.datasets.multi_hot",
    "MappedBatches": "torchrec_bagpipe.datasets.transforms",
    "Undersample": "torchrec_bagpipe.datasets.transforms",
    "select_rows": "torchrec_bagpipe.datasets.transforms",
}


__getattr__, __dir__ = lazy_names(__name__, _LAZY)

__all__ = sorted(_LAZY)
