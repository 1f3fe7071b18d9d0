"""Builds the Ray Serve application: N replicas routed by our router.

``serving.path``: ``direct`` (HAProxy asks the router deployment where each request goes and
forwards it to that replica, which serves the OpenAI API itself) or ``proxy`` (the ingress
deployment calls the replicas through a handle whose request router is ours).

``build_app(config)`` for Python; ``app_builder`` for Serve configs
(``import_path: prefixmesh.app:app_builder`` with ``args: {config: FILE, overrides: [...]}``).
This module and the CLI (``cli.py``, ``serve_cli.py``) are the ones that may import every package.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixmesh.config import PrefixmeshConfig, load_config, merge_overrides, process_json
from prefixmesh.replica.demo_model import resolve_model_path

if TYPE_CHECKING:
    from prefixmesh.replica.serving.deployment import ReplicaServer
    from prefixmesh.router.front.ingress import IngressServer
    from prefixmesh.router.front.route_server import RouterServer

INGRESS_NAME = "Ingress"
ROUTER_NAME = "Router"
REPLICA_NAME = "Replica"


def replica_env(config: PrefixmeshConfig) -> dict[str, str]:
    """Environment of every replica process: loopback Ray, offline hub, no telemetry, vLLM's
    caches under our cache folder."""
    cache = Path(config.cache_dir).expanduser()
    return {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
    }


def request_router_class(config: PrefixmeshConfig) -> Any:
    """The Ray Serve RequestRouter class of ``routing.serve_request_router``: ours, or one of
    Ray's own (with their shipped defaults) for side-by-side comparisons."""
    from prefixmesh import serve_private

    choice = config.routing.serve_request_router
    if choice == "ray_pow2":
        return serve_private.power_of_two_router_class()
    if choice == "ray_prefix_affinity":
        return serve_private.prefix_affinity_router_class()
    from prefixmesh.router.core.serve_router import PrefixmeshRequestRouter

    return PrefixmeshRequestRouter


def build_app(config: PrefixmeshConfig) -> Any:
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    direct = config.serving.path == "direct"
    replica_class: type[ReplicaServer]
    front_class: type[RouterServer | IngressServer]
    if direct:
        from prefixmesh.replica.serving.openai_server import ReplicaHTTPServer as replica_class
        from prefixmesh.router.front.route_server import RouterServer as front_class

        front_name = ROUTER_NAME
    else:
        from prefixmesh.replica.serving.deployment import ReplicaServer as replica_class
        from prefixmesh.router.front.ingress import IngressServer as front_class

        front_name = INGRESS_NAME
    model_path = resolve_model_path(config)
    config_json = process_json(config)  # the one dump that carries the Redis password
    env = replica_env(config)
    replica = config.replica
    replica_actor: dict[str, Any] = {
        "num_cpus": replica.num_cpus,
        "num_gpus": replica.num_gpus,
        "runtime_env": {"env_vars": env},
    }
    if replica.resources:
        replica_actor["resources"] = dict(replica.resources)
    placement: dict[str, Any] = {}
    tp = replica.vllm.tensor_parallel_size
    if replica.engine == "vllm" and tp > 1:
        # One bundle per tensor-parallel worker, packed on one node (Ray Serve LLM's layout).
        # The replica actor sits in the first bundle, so that one carries its CPUs.
        first = {"CPU": max(1.0, replica.num_cpus), "GPU": 1}
        placement = {
            "placement_group_bundles": [first] + [{"CPU": 1, "GPU": 1}] * (tp - 1),
            "placement_group_strategy": "STRICT_PACK",
        }
        replica_actor.pop("num_gpus")
    # Ray annotates only the decorator form, ``serve.deployment(**options)(cls)``.
    replicas = serve.deployment(
        name=REPLICA_NAME,
        num_replicas=replica.num_replicas,
        max_ongoing_requests=replica.max_ongoing_requests,
        ray_actor_options=replica_actor,
        request_router_config=RequestRouterConfig(
            request_router_class=request_router_class(config),
            request_router_kwargs=(
                {"config_json": config_json}
                if config.routing.serve_request_router == "prefixmesh"
                else {}
            ),
            # Ray annotates the constructor's ``**kwargs: dict[str, Any]`` (each value a dict).
            request_routing_stats_period_s=replica.routing_stats_period_s,  # type: ignore[arg-type]
            request_routing_stats_timeout_s=max(1.0, replica.routing_stats_period_s),  # type: ignore[arg-type]
        ),
        health_check_period_s=5.0,
        health_check_timeout_s=replica.health_check_timeout_s,
        graceful_shutdown_timeout_s=20.0,
        **placement,
    )(replica_class)
    front = serve.deployment(
        name=front_name,
        num_replicas=config.ingress.num_replicas,
        max_ongoing_requests=config.ingress.max_ongoing_requests,
        ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": env}},
        # A dead router stays in HAProxy's router pool until Serve's health check notices.
        health_check_period_s=config.ingress.health_check_period_s,
    )(front_class)
    bound_replicas = replicas.bind(config_json, model_path, front_name)
    bound_front = front.bind(bound_replicas, config_json, model_path)
    if direct:
        # The replicas are the HTTP ingress, and HAProxy asks the router deployment which one
        # takes each POST (a private hook of Ray's).
        from prefixmesh.serve_private import with_ingress_request_router

        return with_ingress_request_router(bound_replicas, bound_front)
    return bound_front


def app_builder(args: dict[str, Any]) -> Any:
    """Entry point for Serve config files. ``args``: ``config`` (a YAML file on the node that
    builds the app), ``settings`` (a mapping in the same shape, applied over it) and
    ``overrides`` (``section.field=value`` lines, applied last)."""
    unknown = set(args) - {"config", "settings", "overrides"}
    if unknown:
        raise ValueError(f"unknown app args {sorted(unknown)}; use config, settings, overrides")
    layered = merge_overrides(args.get("settings") or {}, args.get("overrides") or [])
    return build_app(load_config(args.get("config"), layered))
