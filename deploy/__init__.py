"""Operator tools that drive a deployment from the outside (``make deploy-check``). Not installed
with the package, and production code never imports it."""
