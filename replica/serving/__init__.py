"""A replica served: the Ray Serve deployment (``deployment.py``), the direct path's OpenAI
server (``openai_server.py``, its API in ``direct_front.py``), the standalone replica server
without Serve (``standalone_server.py``), one engine over HTTP (``engine_server.py``), the
replica's spans and its watch on its own pauses."""
