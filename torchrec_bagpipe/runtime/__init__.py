"""The framework-agnostic BagPipe runtime: bounded cache, lookahead planners, coherence.

It never imports torch.distributed or a transport: collectives and the PS client are
injected, so W ranks can be simulated in one process (`ThreadCollectives`, and the test
tools `torchrec_bagpipe.testing.reference_ps` / `torchrec_bagpipe.testing.simulate`).
Names are imported lazily.
"""

from __future__ import annotations

from torchrec_bagpipe._lazy import lazy_names

_LAZY = {
    "BagPipeController": "torchrec_bagpipe.runtime.controller",
    "ControllerError": "torchrec_bagpipe.runtime.controller",
    "PSClientLike": "torchrec_bagpipe.runtime.controller",
    "Step": "torchrec_bagpipe.runtime.controller",
    "Collectives": "torchrec_bagpipe.runtime.collectives",
    "CollectiveAborted": "torchrec_bagpipe.runtime.collectives",
    "ThreadCollectives": "torchrec_bagpipe.runtime.collectives",
    "ThreadGroup": "torchrec_bagpipe.runtime.collectives",
    "DeviceCache": "torchrec_bagpipe.runtime.device_cache",
    "EvictionSpec": "torchrec_bagpipe.runtime.eviction",
    "OnlinePlanner": "torchrec_bagpipe.runtime.access_plans",
    "PrescanPlanner": "torchrec_bagpipe.runtime.access_plans",
    "PlanMismatchError": "torchrec_bagpipe.runtime.access_plans",
    "StepPlan": "torchrec_bagpipe.runtime.access_plans",
    "RuntimeMetrics": "torchrec_bagpipe.runtime.metrics",
}


__getattr__, __dir__ = lazy_names(__name__, _LAZY)

__all__ = sorted(_LAZY)
