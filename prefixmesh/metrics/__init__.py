"""Metrics of every serving process, for one Prometheus view of the cluster (docs/metrics.md).

``spec``: what each metric is (pure values); ``sink``: where values go (the ``MetricSink``
protocol, prometheus_client's text for a process's own ``/metrics``, a tee, a null sink);
``ray_sink``: Ray's metrics agent, which serves every process of a node on one port, labelled
by Serve replica; ``vllm_export``: vLLM's engine metrics through the same agent.
"""
