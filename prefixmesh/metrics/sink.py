"""Where metric values go: the ``MetricSink`` protocol and the sinks that need no Ray.

Instruments keep prometheus_client's call shape (``labels(**values)`` then ``inc``, ``set``,
``observe``; ``remove(*values)`` for a gauge's series), so code that records a value never
knows where it goes. ``PrometheusSink`` keeps a registry of its own and renders it as text (a
process's ``/metrics``); ``Tee`` sends every value to several sinks; ``NullSink`` drops them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from prefixmesh.metrics.spec import CounterSpec, GaugeSpec, HistogramSpec


class CounterInstrument(Protocol):
    def labels(self, **values: str) -> CounterInstrument: ...

    def inc(self, amount: float = 1) -> None: ...


class GaugeInstrument(Protocol):
    def labels(self, **values: str) -> GaugeInstrument: ...

    def set(self, value: float) -> None: ...

    def remove(self, *values: str) -> None:
        """Stop reporting the series with these label values (in label order)."""


class HistogramInstrument(Protocol):
    def labels(self, **values: str) -> HistogramInstrument: ...

    def observe(self, amount: float) -> None: ...


class MetricSink(Protocol):
    def counter(self, spec: CounterSpec) -> CounterInstrument: ...

    def gauge(self, spec: GaugeSpec) -> GaugeInstrument: ...

    def histogram(self, spec: HistogramSpec) -> HistogramInstrument: ...


class PrometheusSink:
    """prometheus_client metrics in a registry of their own: two objects in one process never
    collide, and each renders only its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()

    def counter(self, spec: CounterSpec) -> CounterInstrument:
        return Counter(spec.name, spec.help, spec.labels, registry=self.registry)

    def gauge(self, spec: GaugeSpec) -> GaugeInstrument:
        return Gauge(spec.name, spec.help, spec.labels, registry=self.registry)

    def histogram(self, spec: HistogramSpec) -> HistogramInstrument:
        return Histogram(
            spec.name, spec.help, spec.labels, buckets=spec.buckets, registry=self.registry
        )

    def render(self) -> str:
        return generate_latest(self.registry).decode()


class _Fanout:
    """One instrument per sink, each call passed to all of them."""

    __slots__ = ("_parts",)

    def __init__(self, parts: list[Any]) -> None:
        self._parts = parts

    def labels(self, **values: str) -> _Fanout:
        return _Fanout([part.labels(**values) for part in self._parts])

    def inc(self, amount: float = 1) -> None:
        for part in self._parts:
            part.inc(amount)

    def set(self, value: float) -> None:
        for part in self._parts:
            part.set(value)

    def observe(self, amount: float) -> None:
        for part in self._parts:
            part.observe(amount)

    def remove(self, *values: str) -> None:
        for part in self._parts:
            part.remove(*values)


class Tee:
    """Every value to each of ``sinks``: a process's own text and Ray's agent."""

    def __init__(self, *sinks: MetricSink) -> None:
        self._sinks = sinks

    def counter(self, spec: CounterSpec) -> CounterInstrument:
        return _Fanout([sink.counter(spec) for sink in self._sinks])

    def gauge(self, spec: GaugeSpec) -> GaugeInstrument:
        return _Fanout([sink.gauge(spec) for sink in self._sinks])

    def histogram(self, spec: HistogramSpec) -> HistogramInstrument:
        return _Fanout([sink.histogram(spec) for sink in self._sinks])


class _Nothing:
    __slots__ = ()

    def labels(self, **values: str) -> _Nothing:
        return self

    def inc(self, amount: float = 1) -> None:
        return None

    def set(self, value: float) -> None:
        return None

    def observe(self, amount: float) -> None:
        return None

    def remove(self, *values: str) -> None:
        return None


_NOTHING = _Nothing()


class NullSink:
    """Drops every value (a process outside Ray Serve has no cluster view to feed)."""

    def counter(self, spec: CounterSpec) -> CounterInstrument:
        return _NOTHING

    def gauge(self, spec: GaugeSpec) -> GaugeInstrument:
        return _NOTHING

    def histogram(self, spec: HistogramSpec) -> HistogramInstrument:
        return _NOTHING
