"""Launching BagPipe jobs: PS shards and torchrun trainers that meet in one rendezvous store.

* `component` — the torchx component (``torchx run ... torchrec_bagpipe/launch/component.py:
  bagpipe``): a PS role and a trainer role (torchx ``dist.ddp``-style), any scheduler.
* `cli` — ``torchrec-bagpipe-launch`` / ``python -m torchrec_bagpipe.launch``: the same
  pieces on one machine.
* `ps_role`, `trainer_role` — the two role programs; `rendezvous` — the store they share;
  `processes` — bounded child-process handling.
"""

from __future__ import annotations

from torchrec_bagpipe._lazy import lazy_names

_LAZY = {
    "main": "torchrec_bagpipe.launch.cli",
    "parse_args": "torchrec_bagpipe.launch.cli",
    "rewrite_ps_type": "torchrec_bagpipe.launch.trainer_role",
    "bagpipe": "torchrec_bagpipe.launch.component",
}

__getattr__, __dir__ = lazy_names(__name__, _LAZY)

__all__ = sorted(_LAZY)
