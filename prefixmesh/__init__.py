"""prefixmesh: a cache-aware LLM serving cluster on Ray Serve."""
