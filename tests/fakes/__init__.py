"""Fakes for unit tests of logic only (never for the thing an issue delivers)."""
