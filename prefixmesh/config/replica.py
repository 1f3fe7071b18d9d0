"""``replica``: the model replicas (engine, count, resources) and their fair share."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from prefixmesh.config.base import Section
from prefixmesh.config.engine import RemoteEngineConfig, SimEngineConfig, VllmConfig


class FairShareConfig(Section):
    """Fair share when a replica is saturated (``replica/admission/fair_share.py``): off by
    default."""

    enabled: bool = False
    """Requests start by priority, then the tenant with the least service (a virtual token
    counter), instead of in arrival order: at the replica past ``prefill_budget_tokens``, and
    inside the engine (a vLLM engine is started with prefixmesh's priority scheduler). A
    request's ``priority`` takes effect only with this on."""
    prefill_budget_tokens: int = Field(default=8192, ge=1)
    """Prompt tokens (less their cached prefix) still to prefill that the engine would serve
    before a request, with its own, for it to start (alone, any prompt starts): about four of
    the engine's steps (vLLM's ``max_num_batched_tokens`` is 2048 on small devices; scale it
    with yours), so the engine never starves between requests. Smaller keeps a saturating
    tenant's backlog out of the engine at the cost of its throughput
    (``docs/benchmarks-log.md``)."""
    output_weight: float = Field(default=2.0, ge=0)
    """What a generated token costs a tenant's counter, a prompt token costing 1 (VTC's)."""
    idle_credit_tokens: int = Field(default=4096, ge=0)
    """Credit a tenant returning from idle keeps against the service in progress (its counter is
    lifted to the virtual time less this): a burst of about this many prompt tokens goes ahead
    of a saturating tenant instead of alternating with it; 0 is strict fair share."""


class ReplicaConfig(Section):
    engine: Literal["vllm", "sim", "remote"] = "vllm"
    """Which engine each replica runs: ``vllm``, ``sim``, or ``remote`` (forward to a replica
    server that runs one of the other two)."""
    num_replicas: int = Field(default=2, ge=1)
    """Replicas (data-parallel ranks) of the model."""
    num_cpus: float = Field(default=0.0, ge=0)
    """CPUs Ray reserves per replica; 0 lets more replicas than cores share a machine."""
    num_gpus: float = Field(default=0.0, ge=0)
    """GPUs Ray reserves per replica (tensor_parallel_size on a GPU cluster)."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each replica needs (``ray start --resources``): pins the replicas
    to the nodes that offer them, e.g. GPU workers, never the head."""
    max_ongoing_requests: int = Field(default=64, ge=1)
    """Serve's per-replica concurrency cap; set from the engine's real concurrency (Serve's
    default of 5 throttles a batching engine to a crawl, docs/design.md §7)."""
    model_path: str | None = None
    """A Hugging Face model folder; None serves the demo model (generated on first use)."""
    demo_model_size: Literal["tiny", "small"] = "tiny"
    """Which demo model to generate when model_path is None."""
    publish_interval_ms: float = Field(default=5.0, gt=0)
    """How often a replica sends its batched cache events to the registry."""
    routing_stats_period_s: float = Field(default=1.0, gt=0)
    """How often Serve polls each replica's load for the routers."""
    coalesce_stream: bool = True
    """Send the output deltas that piled up during the previous send as one chunk (the first
    goes out at once; replica/admission/coalesce.py): less Ray and SSE relaying per token when
    busy."""
    health_check_timeout_s: float = Field(default=10.0, gt=0)
    """Serve's bound on one replica health check (its engine alive, or its replica server
    reachable); a replica that fails it is replaced."""
    vllm: VllmConfig = VllmConfig()
    """Settings of the vllm engine."""
    sim: SimEngineConfig = SimEngineConfig()
    """Settings of the sim engine."""
    fair_share: FairShareConfig = FairShareConfig()
    """Admission by priority and tenant when the replica is saturated (off by default)."""
    remote: RemoteEngineConfig = RemoteEngineConfig()
    """Settings of the remote engine."""

    @model_validator(mode="after")
    def _check_remote(self) -> ReplicaConfig:
        if self.engine == "remote" and len(self.remote.urls) < self.num_replicas:
            raise ValueError(
                f"replica.engine=remote needs one replica.remote.urls entry per replica: "
                f"{len(self.remote.urls)} urls for {self.num_replicas} replicas"
            )
        return self
