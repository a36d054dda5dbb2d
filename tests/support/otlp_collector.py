"""A small in-process OTLP/gRPC trace collector for end-to-end tests.

It serves ``opentelemetry.proto.collector.trace.v1.TraceService/Export`` on 127.0.0.1 (a free port) with a real
``grpc.server`` and keeps every span it receives, flattened to :class:`CollectedSpan`. Tests then block on
:meth:`OtlpCollector.wait_for` until the spans they expect have arrived (each Export notifies a condition
variable: no polling), or fail with a summary of what did arrive.

Pointing a process at it (the Python OTLP/gRPC exporter, ``OTLPSpanExporter``)::

    OTEL_EXPORTER_OTLP_ENDPOINT=<collector.endpoint>   # "http://127.0.0.1:PORT"; the http:// scheme makes the
                                                       # exporter use an insecure channel, unless
                                                       # OTEL_EXPORTER_OTLP_[TRACES_]INSECURE says otherwise
    OTEL_BSP_SCHEDULE_DELAY=50                         # ms between BatchSpanProcessor exports (default 5000)

``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, when set, takes precedence over ``OTEL_EXPORTER_OTLP_ENDPOINT``, so a
child environment should drop (or also set) it. ``OTEL_EXPORTER_OTLP_INSECURE=true`` is harmless to add. gRPC
honours ``http_proxy``/``https_proxy``/``grpc_proxy``: where one is set, add 127.0.0.1 to ``no_proxy``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

__all__ = ["CollectedSpan", "OtlpCollector", "any_value_to_python"]


@dataclass(frozen=True)
class CollectedSpan:
    service_name: str  # the resource attribute service.name ("" when absent)
    name: str
    trace_id: str  # 32 lowercase hex digits
    span_id: str  # 16 lowercase hex digits
    parent_span_id: str  # "" for a root span
    links: tuple[tuple[str, str], ...]  # (trace_id, span_id) hex pairs
    attributes: dict[str, Any] = field(hash=False)  # plain Python values; arrays become lists
    events: tuple[str, ...]  # event names, in order
    start_ns: int
    end_ns: int
    kind: str = "SPAN_KIND_UNSPECIFIED"  # e.g. "SPAN_KIND_SERVER", "SPAN_KIND_INTERNAL"
    status_code: str = "STATUS_CODE_UNSET"  # "STATUS_CODE_OK" / "STATUS_CODE_ERROR"
    service_instance: str = ""  # the resource attribute service.instance.id (a worker's id)

    @property
    def is_root(self) -> bool:
        return not self.parent_span_id


def any_value_to_python(value: common_pb2.AnyValue) -> Any:
    """An OTLP AnyValue as a plain Python value: str/int/float/bool/bytes, list for arrays, dict for kvlists,
    None when unset."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [any_value_to_python(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    if kind is None:
        return None
    return getattr(value, kind)


def _attributes(key_values) -> dict[str, Any]:
    return {kv.key: any_value_to_python(kv.value) for kv in key_values}


def _flatten(request: trace_service_pb2.ExportTraceServiceRequest) -> list[CollectedSpan]:
    spans = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        service_name, instance = resource.get("service.name") or "", resource.get("service.instance.id") or ""
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    CollectedSpan(
                        service_name=str(service_name),
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links),
                        attributes=_attributes(span.attributes),
                        events=tuple(event.name for event in span.events),
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        kind=trace_pb2.Span.SpanKind.Name(span.kind),
                        status_code=trace_pb2.Status.StatusCode.Name(span.status.code),
                        service_instance=str(instance),
                    )
                )
    return spans


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, collector: OtlpCollector):
        self._collector = collector

    def Export(self, request, context):  # noqa: N802 (the gRPC method name)
        self._collector._ingest(_flatten(request))
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpCollector:
    """An OTLP/gRPC trace receiver on 127.0.0.1:<free port>. Use as a context manager (or start()/stop()).
    Thread-safe: Export runs on the server's threads, tests read from theirs."""

    def __init__(self, max_workers: int = 4):
        self._cond = threading.Condition(threading.Lock())
        self._spans: list[CollectedSpan] = []
        self._exports = 0  # bumped by every Export; wait_for() waits for it to move
        self._max_workers = max_workers
        self._server: grpc.Server | None = None
        self._port = 0

    # lifecycle

    def start(self) -> OtlpCollector:
        if self._server is not None:
            raise RuntimeError("OtlpCollector already started")
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self._max_workers, thread_name_prefix="otlp"))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), server)
        port = server.add_insecure_port("127.0.0.1:0")
        if not port:
            raise RuntimeError("OtlpCollector could not bind 127.0.0.1:0")
        server.start()
        self._server, self._port = server, port
        return self

    def stop(self, grace_s: float | None = None) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace_s).wait()

    def __enter__(self) -> OtlpCollector:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # addresses

    @property
    def port(self) -> int:
        if not self._port:
            raise RuntimeError("OtlpCollector not started")
        return self._port

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT``: for OTEL_EXPORTER_OTLP_ENDPOINT or OTLPSpanExporter(endpoint=...); the
        http:// scheme makes the exporter connect without TLS."""
        return f"http://127.0.0.1:{self.port}"

    # spans

    def _ingest(self, spans: list[CollectedSpan]) -> None:
        with self._cond:
            self._spans.extend(spans)
            self._exports += 1
            self._cond.notify_all()

    def spans(self) -> list[CollectedSpan]:
        """A copy of every span received so far, in arrival order."""
        with self._cond:
            return list(self._spans)

    @property
    def export_count(self) -> int:
        with self._cond:
            return self._exports

    def clear(self) -> None:
        """Forgets the spans received so far (e.g. between phases of a test)."""
        with self._cond:
            self._spans.clear()

    def wait_for(
        self, predicate: Callable[[list[CollectedSpan]], bool], timeout_s: float, what: str = ""
    ) -> list[CollectedSpan]:
        """Blocks until ``predicate(spans)`` is true of the spans received so far and returns those spans;
        re-evaluated after each Export. Raises AssertionError, with a summary of what was received, once
        ``timeout_s`` passes. The predicate runs without the collector's lock held (it may call spans())."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._cond:
                snapshot = list(self._spans)
                seen = self._exports
            if predicate(snapshot):
                return snapshot
            with self._cond:
                while self._exports == seen:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise AssertionError(self._timeout_message(timeout_s, what))
                    self._cond.wait(remaining)

    def _timeout_message(self, timeout_s: float, what: str) -> str:
        # called with self._cond held
        by_service: dict[str, list[str]] = {}
        for span in self._spans:
            by_service.setdefault(span.service_name or "<no service.name>", []).append(span.name)
        head = f"OtlpCollector: no match{f' for {what}' if what else ''} within {timeout_s:g} s; "
        head += f"{len(self._spans)} span(s) from {self._exports} export(s)"
        if not by_service:
            return head + " (nothing received)"
        lines = []
        for service, names in sorted(by_service.items()):
            shown = ", ".join(names[:50]) + (f", ... (+{len(names) - 50})" if len(names) > 50 else "")
            lines.append(f"  {service}: {shown}")
        return head + ":\n" + "\n".join(lines)
