"""The kvmanager's gRPC servicers: protobuf <-> dataclasses (convert.py), the KVService, and the one table of
domain errors to status codes. Admin authentication is wired in server.py (an interceptor)."""

from __future__ import annotations

import functools
import time
from typing import Protocol

import grpc

from kvserve.kvmanager import admin, placement
from kvserve.kvmanager import convert as cv
from kvserve.kvmanager.errors import (
    InvalidRequest,
    RequestsRunning,
    StaleEpoch,
    StaleStep,
    StoreUnavailable,
    UnknownRequest,
    UnknownTenant,
    UnknownWorker,
)
from kvserve.kvmanager.service import KVService
from kvserve.kvmanager.spans import record_op_spans
from kvserve.services.telemetry import tracer
from kvserve.v1 import kvmanager_pb2 as pb
from kvserve.v1 import kvmanager_pb2_grpc

ERROR_STATUS: dict[type[Exception], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    UnknownWorker: grpc.StatusCode.NOT_FOUND,
    UnknownRequest: grpc.StatusCode.NOT_FOUND,
    UnknownTenant: grpc.StatusCode.NOT_FOUND,
    StaleStep: grpc.StatusCode.FAILED_PRECONDITION,
    StaleEpoch: grpc.StatusCode.FAILED_PRECONDITION,
    RequestsRunning: grpc.StatusCode.FAILED_PRECONDITION,
    admin.TextUnsupported: grpc.StatusCode.FAILED_PRECONDITION,
    StoreUnavailable: grpc.StatusCode.UNAVAILABLE,
}


class TextEncoder(Protocol):
    """What the admin servicer needs of a tokenizer (kvserve.worker.tokenizer.Tokenizer)."""

    def encode(self, text: str) -> list[int]: ...


def status_for(error: Exception) -> grpc.StatusCode:
    return next(code for kind, code in ERROR_STATUS.items() if isinstance(error, kind))


def _mapped(method):
    """Aborts the call with the mapped status and the error's message when the domain raises."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except tuple(ERROR_STATUS) as e:
            context.abort(status_for(e), str(e))

    return wrapper


class KVManagerServicer(kvmanager_pb2_grpc.KVManagerServiceServicer):
    """The gateway's and workers' calls. Thin: convert, call the service, convert back, map errors."""

    def __init__(self, service: KVService):
        self.service = service
        self.tracer = tracer("kvserve.kvmanager")

    def _num_evicted(self) -> int:
        return sum(p.num_evicted for p in list(self.service.manager.pools.values()))

    @_mapped
    def RegisterWorker(self, request, context):
        return cv.register_to_proto(self.service.register_worker(cv.spec_from_proto(request),
                                                                 request.release_requests))

    @_mapped
    def StepPages(self, request, context):
        t0, start_ns, evicted = time.perf_counter(), time.time_ns(), self._num_evicted()
        results = self.service.step(cv.step_from_proto(request))
        record_op_spans(self.tracer, request, results, start_ns, time.time_ns(), self._num_evicted() - evicted)
        return cv.step_to_proto(results, handle_ms=(time.perf_counter() - t0) * 1000)


    @_mapped
    def Place(self, request, context):
        token_ids = cv.unpack_token_ids("place", request.packed_token_ids)
        result = self.service.read(placement.place, request.tenant, token_ids, dict(request.num_queued))
        return pb.PlaceResponse(worker_id=result.worker_id, num_hit_tokens=result.num_hit_tokens)


class KVAdminServicer(kvmanager_pb2_grpc.KVAdminServiceServicer):
    """Operator calls; the admin token is checked before these run. ``tokenizer`` serves text input."""

    def __init__(self, service: KVService, tokenizer: TextEncoder | None = None):
        self.service = service
        self.tokenizer = tokenizer

    def _token_ids(self, request) -> tuple[int, ...]:
        token_ids, text = cv.input_of(request)
        if token_ids is not None:
            return token_ids
        if text is None:
            raise InvalidRequest("set token_ids or text")
        if self.tokenizer is None:
            raise admin.TextUnsupported("text input needs a tokenizer: start the kvmanager with --model PATH "
                                        "(a model folder with tokenizer.json), or send token_ids")
        return tuple(self.tokenizer.encode(text))

    @_mapped
    def Stats(self, request, context):
        return cv.stats_to_proto(self.service.read(admin.stats), self.service.store_ok)

    @_mapped
    def ListTenants(self, request, context):
        tenants = self.service.read(admin.list_tenants)
        return pb.ListTenantsResponse(tenants=[cv.tenant_to_proto(t) for t in tenants])

    @_mapped
    def InspectTenant(self, request, context):
        report = self.service.read(admin.inspect_tenant, request.tenant, request.max_blocks, request.max_prefixes)
        return cv.inspect_to_proto(report)

    @_mapped
    def Probe(self, request, context):
        result = self.service.read(admin.probe, request.tenant, self._token_ids(request), request.worker_id)
        return cv.probe_to_proto(result)

    @_mapped
    def EvictTenant(self, request, context):
        result = self.service.mutate(admin.evict_tenant, request.tenant, request.worker_id, request.include_pinned)
        return pb.EvictTenantResponse(num_evicted_blocks=result.num_evicted_blocks,
                                      num_kept_blocks=result.num_kept_blocks)

    @_mapped
    def Pin(self, request, context):
        result = self.service.mutate(admin.pin, request.tenant, self._token_ids(request), request.worker_id)
        return pb.PinResponse(num_pinned_blocks=result.num_pinned_blocks, num_pinned_tokens=result.num_pinned_tokens)

    @_mapped
    def Unpin(self, request, context):
        num = self.service.mutate(admin.unpin, request.tenant, self._token_ids(request), request.worker_id)
        return pb.UnpinResponse(num_unpinned_blocks=num)

    @_mapped
    def GetPageTable(self, request, context):
        return cv.page_table_to_proto(self.service.read(admin.page_table, request.req_id))

    @_mapped
    def Reset(self, request, context):
        if not request.confirm:
            raise InvalidRequest("reset drops every cached block and counter: set confirm (kvserve admin reset --yes)")
        result = self.service.mutate(admin.reset, request.force)
        return pb.ResetResponse(num_dropped_requests=result.num_dropped_requests,
                                num_dropped_blocks=result.num_dropped_blocks)

    @_mapped
    def ForgetWorker(self, request, context):
        result = self.service.mutate(admin.forget_worker, request.worker_id, request.force)
        return pb.ForgetWorkerResponse(num_dropped_requests=result.num_dropped_requests,
                                       num_dropped_blocks=result.num_dropped_blocks)
