"""The OpenAI front door every prefixmesh server shares: the direct path's router
(``router/front/route_server.py``) and replica (``replica/serving/direct_front.py``), the proxy
path's ingress (``router/front/ingress.py``) and the standalone replica server
(``replica/serving/standalone_server.py``).

- ``prepare``: one request's body into one typed ``PreparedRequest`` (parse, model, limits,
  tokens, sampling, key, priority), through ``FrontDoor``;
- ``protocol`` (request models, parsing), ``prompts`` (tokenizing), ``limits`` (checked before
  work), ``auth`` (API keys, the tenant), ``priority``, ``quota`` (tokens per tenant);
- ``generation`` and ``detokenize`` (a replica's token stream as text), ``render`` (responses,
  server-sent events, headers), ``errors`` (every error as OpenAI JSON), ``request_metrics``;
- ``word_vocabulary``: the exact tokenizing shortcut for load-test text.

What travels between router and replica is ``prefixmesh/wire/``; this package builds on it, never
the reverse.
"""
