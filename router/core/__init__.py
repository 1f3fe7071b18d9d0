"""The routing decision, without HTTP: ``RoutingCore`` (``decide.py``), its holds, ledger and
replica loads, the state shared with Ray Serve's copy of our request router (``local_state.py``,
``serve_router.py``), and the router's metrics and spans."""
