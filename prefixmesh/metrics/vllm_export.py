"""vLLM's engine metrics through Ray's metrics agent (``vllm:*`` as ``ray_vllm_*``)."""

from __future__ import annotations

from typing import Any


def cluster_stat_loggers() -> list[Any]:
    """Stat loggers to pass to ``AsyncLLM`` besides our own: inside a Ray worker, vLLM's
    ``RayPrometheusStatLogger`` (it replaces vLLM's prometheus_client logger, and labels every
    series with the Serve replica's id, ``ReplicaId``); elsewhere none, and vLLM keeps its
    default logger."""
    import ray

    if not ray.is_initialized():
        return []
    from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

    return [RayPrometheusStatLogger]
