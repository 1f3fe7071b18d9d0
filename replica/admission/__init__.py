"""What happens to a request between its arrival at a replica and the engine: delay-hit holds
(``holds.py``), the fair-share order and gate (``fair_share.py``, ``fair_gate.py``), and the
coalescing of what the engine streams back (``coalesce.py``)."""
