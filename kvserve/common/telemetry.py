"""OpenTelemetry tracing for the three services: one tracer provider per process, W3C trace context across
every gRPC hop, and per-request trace context carried inside batched calls.

Configuration is the standard ``OTEL_*`` environment: spans are exported over OTLP/gRPC when
``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set, sampled by
``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``; ``OTEL_SDK_DISABLED=true`` turns tracing off. Without an
endpoint no SDK is installed at all: the API's no-op tracer makes every span call free, and no trace context
is sent.

Batched calls serve many requests, so a request's context travels per op (``traceparent`` fields of
PageAllocation/.../StepItem), not per call: the kvmanager and the worker open spans as children of each
request's span (or, for a batched decode step, one span linked to every request it served).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import MappingProxyType

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, Span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
# req_id -> W3C traceparent of its span, for the traced requests of a batched call; this one: none traced
NO_TRACES: Mapping[str, str] = MappingProxyType({})


def tracing_enabled_by_env() -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def setup_tracing(service_name: str, instance_id: str = "") -> bool:
    """Installs this process' tracer provider (service.name = ``service_name``, service.instance.id =
    ``instance_id`` if given: a worker's id, so that a trace shows which worker computed what) with an OTLP
    exporter when the environment asks for one. Returns whether tracing is on. Call once, from the process'
    main."""
    if not tracing_enabled_by_env():
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {"service.name": service_name} | ({"service.instance.id": instance_id} if instance_id else {})
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return True


def shutdown_tracing() -> None:
    """Flushes spans still buffered (on a graceful stop)."""
    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def traceparent_of(span: Span | None) -> str:
    """The W3C traceparent of a recording span; "" when tracing is off."""
    if span is None or not span.is_recording():
        return ""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def context_of(traceparent: str) -> otel_context.Context | None:
    """The context a traceparent names (None for "": not traced)."""
    return _PROPAGATOR.extract({"traceparent": traceparent}) if traceparent else None


def link_of(traceparent: str) -> Link | None:
    ctx = context_of(traceparent)
    if ctx is None:
        return None
    span_context = trace.get_current_span(ctx).get_span_context()
    return Link(span_context) if span_context.is_valid else None


def context_from_metadata(metadata) -> otel_context.Context | None:
    """The caller's context from gRPC invocation metadata (``traceparent``), if it sent one."""
    carrier = {k: v for k, v in metadata if k in ("traceparent", "tracestate")}
    return _PROPAGATOR.extract(carrier) if carrier else None
