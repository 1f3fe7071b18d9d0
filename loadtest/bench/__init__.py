"""The benchmark CLIs (``prefixmesh *-bench``), one module each, kept out of the library
packages: production code never imports them.

``policy``: one routing decision per policy; ``registry``: registry lookup and publish;
``freshness``: a replica's cache change to a router seeing it in Redis; ``serving``: the real
cluster under each policy, and what each serving path adds; ``tier``: vLLM TTFT with our CPU and
disk tiers; ``kernels`` (CUDA): KV block gather/scatter; ``store`` (CUDA): the KV connector's
CPU-tier path.
"""
