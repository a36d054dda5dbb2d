"""The kvmanager's gRPC servicers: protobuf <-> dataclasses (kvserve/common/convert/pages.py for the page ops,
convert.py for the admin answers) around the KVService; typed errors become statuses by the one table of
kvserve/common/grpc_server.py. Admin authentication is wired in server.py (an interceptor)."""

from __future__ import annotations

import time
from typing import Protocol

from kvserve.common.convert import membership as member_cv
from kvserve.common.convert import pages as page_cv
from kvserve.common.errors import InvalidRequest
from kvserve.common.grpc_server import aborts_on_domain_errors
from kvserve.common.telemetry import tracer
from kvserve.kvmanager import admin
from kvserve.kvmanager import convert as cv
from kvserve.kvmanager.errors import TextUnsupported
from kvserve.kvmanager.service import KVService
from kvserve.kvmanager.spans import record_op_spans
from kvserve.v1 import kvmanager_pb2 as pb
from kvserve.v1 import kvmanager_pb2_grpc


class TextEncoder(Protocol):
    """What the admin servicer needs of a tokenizer (kvserve.common.tokenizer.Tokenizer)."""

    def encode(self, text: str) -> list[int]: ...


class KVManagerServicer(kvmanager_pb2_grpc.KVManagerServiceServicer):
    """The gateway's and workers' calls. Thin: convert, call the service, convert back, map errors."""

    def __init__(self, service: KVService):
        self.service = service
        self.tracer = tracer("kvserve.kvmanager")

    def _num_evicted(self) -> int:
        return sum(p.num_evicted for p in list(self.service.manager.pools.values()))

    @aborts_on_domain_errors
    def RegisterWorker(self, request, context):
        return page_cv.register_to_proto(self.service.register_worker(page_cv.spec_from_proto(request),
                                                                 request.release_requests))

    @aborts_on_domain_errors
    def StepPages(self, request, context):
        t0, start_ns, evicted = time.perf_counter(), time.time_ns(), self._num_evicted()
        results = self.service.step(page_cv.step_from_proto(request))
        record_op_spans(self.tracer, request, results, start_ns, time.time_ns(), self._num_evicted() - evicted)
        return page_cv.step_to_proto(results, handle_ms=(time.perf_counter() - t0) * 1000)


    @aborts_on_domain_errors
    def Place(self, request, context):
        token_ids = page_cv.unpack_token_ids("place", request.packed_token_ids)
        result = self.service.place(request.tenant, token_ids, dict(request.num_queued), tuple(request.worker_ids),
                                    request.pull_peers)
        return pb.Placement(worker_id=result.worker_id, num_cached_tokens=result.num_cached_tokens)

    # -- membership ---------------------------------------------------------------------------------------
    @aborts_on_domain_errors
    def JoinWorker(self, request, context):
        return member_cv.join_to_proto(self.service.join_worker(*member_cv.join_from_proto(request)))

    @aborts_on_domain_errors
    def Heartbeat(self, request, context):
        result = self.service.heartbeat(request.worker_id, request.epoch, request.draining)
        return member_cv.heartbeat_to_proto(result)

    @aborts_on_domain_errors
    def LeaveWorker(self, request, context):
        return pb.LeaveWorkerResponse(dropped_req_ids=self.service.leave_worker(request.worker_id, request.epoch))

    @aborts_on_domain_errors
    def ListWorkers(self, request, context):
        return member_cv.workers_to_proto(self.service.list_workers())

    @aborts_on_domain_errors
    def ReportTier(self, request, context):
        added, evicted = self.service.report_tier(cv.checked_tier_report(request))
        return pb.TierReportResult(num_added=added, num_evicted=evicted)


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
            raise TextUnsupported("text input needs a tokenizer: start the kvmanager with --model PATH "
                                        "(a model folder with tokenizer.json), or send token_ids")
        return tuple(self.tokenizer.encode(text))

    @aborts_on_domain_errors
    def Stats(self, request, context):
        return cv.stats_to_proto(self.service.read(admin.stats), self.service.store_ok)

    @aborts_on_domain_errors
    def ListTenants(self, request, context):
        tenants = self.service.read(admin.list_tenants)
        return pb.ListTenantsResponse(tenants=[cv.tenant_to_proto(t) for t in tenants])

    @aborts_on_domain_errors
    def InspectTenant(self, request, context):
        report = self.service.read(admin.inspect_tenant, request.tenant, request.max_blocks, request.max_prefixes)
        return cv.inspect_to_proto(report)

    @aborts_on_domain_errors
    def Probe(self, request, context):
        result = self.service.read(admin.probe, request.tenant, self._token_ids(request), request.worker_id)
        return cv.probe_to_proto(result)

    @aborts_on_domain_errors
    def EvictTenant(self, request, context):
        result = self.service.mutate(admin.evict_tenant, request.tenant, request.worker_id, request.include_pinned)
        return pb.EvictResult(num_evicted_blocks=result.num_evicted_blocks, num_kept_blocks=result.num_kept_blocks)

    @aborts_on_domain_errors
    def Pin(self, request, context):
        result = self.service.mutate(admin.pin, request.tenant, self._token_ids(request), request.worker_id,
                                     request.ttl_s)
        return pb.PinResult(num_pinned_blocks=result.num_pinned_blocks, num_pinned_tokens=result.num_pinned_tokens,
                            expires_ms=result.expires_ms, num_over_budget_blocks=result.num_over_budget_blocks)

    @aborts_on_domain_errors
    def Unpin(self, request, context):
        num = self.service.mutate(admin.unpin, request.tenant, self._token_ids(request), request.worker_id)
        return pb.UnpinResponse(num_unpinned_blocks=num)

    @aborts_on_domain_errors
    def GetPageTable(self, request, context):
        return cv.page_table_to_proto(self.service.read(admin.page_table, request.req_id))

    @aborts_on_domain_errors
    def Reset(self, request, context):
        if not request.confirm:
            raise InvalidRequest("reset drops every cached block and counter: set confirm (kvserve admin reset --yes)")
        result = self.service.mutate(admin.reset, request.force)
        return pb.DropResult(num_dropped_requests=result.num_dropped_requests,
                             num_dropped_blocks=result.num_dropped_blocks)

    @aborts_on_domain_errors
    def ForgetWorker(self, request, context):
        result = self.service.mutate(admin.forget_worker, request.worker_id, request.force)
        return pb.DropResult(num_dropped_requests=result.num_dropped_requests,
                             num_dropped_blocks=result.num_dropped_blocks)
