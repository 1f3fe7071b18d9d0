"""What a replica tells the cluster: its KV cache events translated into block keys
(``kv_events.py``) and published in batches (``publisher.py``), each request's progress to the
router (``progress.py``), and the shared KV tier's listing (``shared_tier.py``)."""
