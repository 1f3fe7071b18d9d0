"""The replicas' hierarchical prefix KV cache: tier policies (``policy/``, pure strategy objects)
and a trace-driven multi-tier cache simulator (``cache_sim.py``) that replays prompts through
them."""
