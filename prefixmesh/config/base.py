"""The base every config section derives from, and how secret settings dump."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, SecretStr, SerializationInfo

WITH_SECRETS = "prefixmesh.with_secrets"
"""Serialization context key under which a JSON dump carries the secrets
(``prefixmesh.config.load.process_json``)."""


class Section(BaseModel):
    """A config section: unknown fields refused, immutable, each field documented by the
    docstring under it."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def dump_secret(secret: SecretStr | None, info: SerializationInfo) -> SecretStr | str | None:
    """How a secret setting dumps: masked in Python dumps, left out (null) of JSON dumps except
    ``process_json``'s, which carries it to the cluster's own processes."""
    if secret is None or not info.mode_is_json():
        return secret
    context = info.context
    if isinstance(context, Mapping) and context.get(WITH_SECRETS):
        return secret.get_secret_value()
    return None  # a report or a file written from a dump never carries it
