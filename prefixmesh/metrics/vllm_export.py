"""vLLM's engine metrics through Ray's metrics agent (``vllm:*`` exported as ``ray_vllm_*``)."""

from __future__ import annotations

import sys
from typing import Any

from prefixmesh.metrics.spec import CounterSpec, GaugeSpec, HistogramSpec

_ENGINE = ("model_name", "engine")
VLLM_METRICS = (
    GaugeSpec("vllm:num_requests_running", "Requests in the engine's running batch", _ENGINE),
    GaugeSpec("vllm:num_requests_waiting", "Requests waiting for the engine", _ENGINE),
    GaugeSpec("vllm:kv_cache_usage_perc", "Share of the engine's KV blocks in use", _ENGINE),
    CounterSpec("vllm:prefix_cache_queries", "Prompt tokens looked up in the engine", _ENGINE),
    CounterSpec("vllm:prefix_cache_hits", "Prompt tokens found in the engine's cache", _ENGINE),
    CounterSpec(
        "vllm:external_prefix_cache_queries",
        "Prompt tokens looked up in the KV connector (our CPU and disk tiers)",
        _ENGINE,
    ),
    CounterSpec(
        "vllm:external_prefix_cache_hits",
        "Prompt tokens found in the KV connector (our CPU and disk tiers)",
        _ENGINE,
    ),
    HistogramSpec(
        "vllm:time_to_first_token_seconds", "Engine-side time to first token", (), _ENGINE
    ),
)
"""The vLLM metrics our dashboard reads (a test checks the installed vLLM still names them);
vLLM exports many more. Through Ray each also carries ``ReplicaId``."""


def cluster_stat_loggers() -> list[Any]:
    """Stat loggers to pass to ``AsyncLLM`` besides our own: inside a Ray worker, vLLM's
    ``RayPrometheusStatLogger`` (it replaces vLLM's prometheus_client logger, and labels every
    series with the Serve replica's id, ``ReplicaId``); elsewhere none, and vLLM keeps its
    default logger."""
    ray = sys.modules.get("ray")  # not imported: not a Ray worker
    if ray is None or not ray.is_initialized():
        return []
    if ray.get_runtime_context().get_actor_id() is None:
        return []  # a driver that started Ray (a test, a benchmark): no replica to label
    from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

    return [RayPrometheusStatLogger]
