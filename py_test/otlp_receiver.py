"""A test-local OpenTelemetry collector: an OTLP/gRPC TraceService that keeps what it gets.

Built from the opentelemetry-proto package's generated stubs, on a thread-pool server,
so it answers whatever event loop (or process) exports to it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as trace_pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as trace_grpc
from opentelemetry.proto.trace.v1.trace_pb2 import Span


class TraceReceiver(trace_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self._spans: list[tuple[dict[str, Any], Span]] = []
        self._lock = threading.Lock()
        self.endpoint = ""

    def Export(
        self, request: trace_pb.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_pb.ExportTraceServiceResponse:
        with self._lock:
            for resource_spans in request.resource_spans:
                resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    self._spans += [(resource, span) for span in scope_spans.spans]
        return trace_pb.ExportTraceServiceResponse()

    def spans_of_trace(self, trace_id: str) -> list[tuple[dict[str, Any], Span]]:
        wanted = bytes.fromhex(trace_id)
        with self._lock:
            return [(res, span) for res, span in self._spans if span.trace_id == wanted]


def attributes(span: Span) -> dict[str, Any]:
    """A span's attributes as plain values."""
    values: dict[str, Any] = {}
    for attribute in span.attributes:
        value = attribute.value
        values[attribute.key] = getattr(value, value.WhichOneof("value") or "string_value")
    return values


@contextmanager
def trace_receiver() -> Iterator[TraceReceiver]:
    receiver = TraceReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    receiver.endpoint = f"127.0.0.1:{port}"
    try:
        yield receiver
    finally:
        server.stop(grace=None)
