"""Two `kvserve kvmanager --redis-url` processes on one Redis: a leader and a standby. The standby answers
UNAVAILABLE naming the leader and reports health NOT_SERVING; a KVManagerClient over both addresses (as the
gateway's ``--kvmanager a1,a2``) reaches the leader. After a kill -9 of the leader, the same client's next calls
succeed on the standby, which took over from Redis, within 5 s of the kill, with the state intact: the running
request's page table, and a retried call's remembered answer.

Redis is the test's own (an external Redis to both kvmanagers), so it outlives the leader's SIGKILL."""

from __future__ import annotations

import contextlib
import re
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvmanager_histories import alloc, spec
from kvmanager_processes import READY_TIMEOUT_S, cli_env
from service_process import service_process

from kvserve.common.channels import kvmanager_channel
from kvserve.common.embedded_redis import EmbeddedRedis
from kvserve.common.wire.pages import PageCommit, PageFree, StepOps
from kvserve.services.gateway.rpc.clients import KVManagerClient
from kvserve.v1 import kvmanager_pb2 as pb
from kvserve.v1 import kvmanager_pb2_grpc

TOKEN = "T"
ROLE = re.compile(r"^kvserve kvmanager ready on 127\.0\.0\.1:(\d+) \((leader|standby), redis: (.+)\) admin token: ")
P = list(range(100, 112))  # 3 full pages of 4 tokens
TAKEOVER_LIMIT_S = 5.0


@contextlib.contextmanager
def kvmanager(tmp_path, name: str, redis_url: str):
    """A `kvserve kvmanager` on ``redis_url``; yields (process, port, role)."""
    args = ["kvmanager", "--port", "0", "--redis-url", redis_url, "--admin-token", TOKEN]
    with service_process(args, ROLE, cli_env(tmp_path), tmp_path / f"{name}.stderr", READY_TIMEOUT_S) as (proc, m):
        yield proc, int(m.group(1)), m.group(2)


def health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="kvserve.v1.KVManagerService"), timeout=5).status


def page_table(spec_: str, req_id: str) -> list[int]:
    with kvmanager_channel(spec_) as channel:
        reply = kvmanager_pb2_grpc.KVAdminServiceStub(channel).GetPageTable(
            pb.GetPageTableRequest(req_id=req_id), metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10)
    return list(reply.page_table)


def test_the_standby_takes_over_within_5_s_of_the_leaders_kill9(tmp_path):
    with EmbeddedRedis(tmp_path / "redis") as redis, \
            kvmanager(tmp_path, "first", redis.url) as (leader, leader_port, leader_role), \
            kvmanager(tmp_path, "second", redis.url) as (_, standby_port, standby_role):
        assert (leader_role, standby_role) == ("leader", "standby")
        with grpc.insecure_channel(f"127.0.0.1:{standby_port}") as channel:
            try:
                kvmanager_pb2_grpc.KVManagerServiceStub(channel).Place(pb.PlaceRequest(tenant="A"), timeout=5)
                raise AssertionError("the standby answered")
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE
                assert f"the leader is 127.0.0.1:{leader_port}" in e.details(), e.details()
        assert health(leader_port) == health_pb2.HealthCheckResponse.SERVING
        assert health(standby_port) == health_pb2.HealthCheckResponse.NOT_SERVING

        both = f"127.0.0.1:{leader_port},127.0.0.1:{standby_port}"
        client = KVManagerClient(both, timeout_s=10, retry_for_s=30)
        try:
            client.register(spec("w0"))
            first = client.step_pages(StepOps(1, allocations=(alloc("a", "A", P + [1]),)))
            commit = StepOps(2, commits=(PageCommit("a", 0, tuple(P), 13),))
            committed = client.step_pages(commit)
            before = page_table(both, "a")
            assert before == first.allocations[0].page_table

            leader.kill()
            killed = time.monotonic()
            leader.wait(timeout=10)
            after = client.step_pages(StepOps(3, allocations=(alloc("b", "A", P + [2]),)))
            takeover_s = time.monotonic() - killed
            print(f"\nkvmanager standby took over {takeover_s:.2f} s after the leader's kill -9")
            assert takeover_s < TAKEOVER_LIMIT_S
            assert after.allocations[0].num_cached_tokens == 12  # the prefix index survived the takeover
            assert health(standby_port) == health_pb2.HealthCheckResponse.SERVING
            assert page_table(both, "a") == before
            again = client.step_pages(commit)  # a retry of a call the old leader answered: from memory
            assert again.commits == committed.commits
            client.step_pages(StepOps(4, frees=(PageFree("a"), PageFree("b"))))
        finally:
            client.close()
