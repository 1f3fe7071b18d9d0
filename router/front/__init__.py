"""The router's HTTP front doors: the proxy path's ingress on Ray Serve (``ingress.py``, with
its retries in ``retry.py``), the direct path's router that HAProxy asks
(``route_server.py``), and their one view of the registry's health
(``registry_watch.py``)."""
