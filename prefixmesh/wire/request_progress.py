"""What a replica tells the router about the requests it serves, between reports: which reached
their first token and which ended (``replica/events/progress.py`` sends it, the router's ledger
reads it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestProgress:
    replica: str
    first_tokens: tuple[str, ...]
    finished: tuple[str, ...]
