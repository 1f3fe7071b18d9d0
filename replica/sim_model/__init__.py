"""The simulated engine's model (not the LLM, which is ``replica/demo_model.py``): step timing,
a block cache and continuous batching.

Pure (no I/O, no real time, no asyncio): the cluster simulator (loadtest/) drives it with a
simulated clock, and the real-time ``sim`` engine drives it with wall-clock ``now_s``.
"""

from __future__ import annotations

from prefixmesh.replica.sim_model.engine import EngineModel
from prefixmesh.replica.sim_model.prefix_cache import (
    CacheChange,
    PrefixCache,
    PrefixMatch,
    to_events,
)
from prefixmesh.replica.sim_model.profile import (
    CPU_SMALL,
    DEFAULT_PROFILE,
    H100_LLAMA8B,
    PROFILES,
    EngineProfile,
    get_profile,
    with_cpu_tier,
)
from prefixmesh.replica.sim_model.records import (
    CacheChanged,
    EngineEvent,
    Finished,
    FirstToken,
    ModelLoad,
    RequestRecord,
    SimRequest,
)

__all__ = [
    "CPU_SMALL",
    "DEFAULT_PROFILE",
    "H100_LLAMA8B",
    "PROFILES",
    "CacheChange",
    "CacheChanged",
    "EngineEvent",
    "EngineModel",
    "EngineProfile",
    "Finished",
    "FirstToken",
    "ModelLoad",
    "PrefixCache",
    "PrefixMatch",
    "RequestRecord",
    "SimRequest",
    "get_profile",
    "to_events",
    "with_cpu_tier",
]
