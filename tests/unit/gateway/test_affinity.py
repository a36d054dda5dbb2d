"""Placement affinity (OpenAI's prompt_cache_key): the map of (tenant, key) -> worker on its own, then the
gateway's placement over two rule workers (tests/support/engine_fakes.py) whose steps wait on a gate, so that the
requests placed while it is closed are all in flight: the load the kvmanager's placement balances is known."""

from __future__ import annotations

import threading

import pytest
from engine_fakes import LockedKV, PagedRuleWorker, reference

from kvserve.common.telemetry import NO_TRACES
from kvserve.common.wire.worker import SamplingParams
from kvserve.services.gateway.affinity import Affinity, has_room
from kvserve.services.gateway.app import Gateway, GatewayConfig
from kvserve.services.gateway.auth import ApiKeys
from kvserve.services.gateway.request import FinishReason, Request, RequestParams
from kvserve.services.gateway.validate import GenerateInput

GATE_S = 60.0  # a closed gate never holds a step longer (a test that forgot to open it fails instead of hanging)


def test_a_key_goes_to_its_remembered_worker_while_it_has_room():
    affinity = Affinity()
    assert affinity.worker_for("a", "doc", {"w0": 0, "w1": 0}) is None  # nothing remembered yet
    affinity.remember("a", "doc", "w1")
    assert affinity.worker_for("a", "doc", {"w0": 0, "w1": 0}) == "w1"
    assert affinity.worker_for("a", "doc", {"w0": 0, "w1": 2}) == "w1"  # within ROOM_SLACK of the least queued
    assert affinity.worker_for("a", "doc", {"w0": 0, "w1": 3}) is None  # full: placed elsewhere
    assert affinity.worker_for("a", "doc", {"w0": 5, "w1": 7}) == "w1"  # every worker is as busy
    assert affinity.worker_for("a", "doc", {"w0": 0}) is None  # draining, retiring or gone: not placeable
    assert affinity.worker_for("a", "other", {"w0": 0, "w1": 0}) is None


def test_keys_are_per_tenant():
    affinity = Affinity()
    affinity.remember("a", "doc", "w1")
    assert affinity.worker_for("b", "doc", {"w0": 0, "w1": 0}) is None  # b's "doc" is not a's
    affinity.remember("b", "doc", "w0")
    assert affinity.worker_for("a", "doc", {"w0": 0, "w1": 0}) == "w1"
    assert affinity.worker_for("b", "doc", {"w0": 0, "w1": 0}) == "w0"


def test_the_least_recently_used_key_goes_first_past_the_bound():
    affinity = Affinity(max_entries=2)
    affinity.remember("a", "k0", "w0")
    affinity.remember("a", "k1", "w1")
    assert affinity.worker_for("a", "k0", {"w0": 0, "w1": 0}) == "w0"  # k0 used: k1 is the least recent now
    affinity.remember("a", "k2", "w1")
    assert len(affinity) == 2
    assert affinity.worker_for("a", "k1", {"w0": 0, "w1": 0}) is None
    assert [affinity.worker_for("a", k, {"w0": 0, "w1": 0}) for k in ("k0", "k2")] == ["w0", "w1"]
    affinity.remember("a", "k0", "w1")  # placed elsewhere once: remembered there, no second entry
    assert len(affinity) == 2 and affinity.worker_for("a", "k0", {"w0": 0, "w1": 0}) == "w1"


def test_room_is_the_slack_over_the_least_queued_worker():
    assert has_room("w0", {"w0": 4, "w1": 2}, room_slack=2)
    assert not has_room("w0", {"w0": 5, "w1": 2}, room_slack=2)
    assert has_room("w0", {"w0": 0, "w1": 0}, room_slack=0)  # the least queued itself always has room
    assert not has_room("w2", {"w0": 0, "w1": 0})


class GatedRuleWorker(PagedRuleWorker):
    """A rule worker whose steps wait until ``gate`` is open."""

    def __init__(self, worker_id: str, gate: threading.Event):
        super().__init__(worker_id, num_pages=64)
        self.gate = gate

    def step(self, batch, traceparents=NO_TRACES):
        assert self.gate.wait(GATE_S), "the test left the gate closed"
        return super().step(batch, traceparents)

    def interrupt(self) -> None:  # a stopping engine's step in flight ends
        self.gate.set()


class PlacingKV(LockedKV):
    """The in-process kvmanager, its calls serialised (two engine threads call it), its Place calls recorded as
    (tenant, worker_id)."""

    def __init__(self):
        super().__init__()
        self.placed: list[tuple[str, str]] = []

    def place_among(self, tenant, token_ids, num_queued, worker_ids, pull_peers):
        worker_id, num_cached = super().place_among(tenant, token_ids, num_queued, worker_ids, pull_peers)
        self.placed.append((tenant, worker_id))
        return worker_id, num_cached


@pytest.fixture
def gated(model_dir):
    """(gateway over w0 and w1, their gate (closed), the kvmanager)."""
    gate, kv = threading.Event(), PlacingKV()
    gateway = Gateway(GatewayConfig(model_dir), ApiKeys(), kv, [GatedRuleWorker(f"w{i}", gate) for i in range(2)])
    yield gateway, gate, kv
    gate.set()
    gateway.close(drain_s=1.0)


# Prompts that share no first token, so that no placement is a prefix hit.
PROMPTS = ["Rivers carry sediment to the sea.", "Owls hunt at night in the forest.", "Copper conducts heat well.",
           "Glaciers carve valleys slowly.", "Bakers rise before dawn.", "Tides follow the moon.",
           "Violins need rosin on the bow.", "Mosses grow on north faces."]


def submit(gateway: Gateway, prompt: str, tenant: str = "a", cache_key: str = ""):
    inp = GenerateInput(prompt=prompt, messages=None, sampling=SamplingParams(), max_tokens=4, ignore_eos=True,
                        cache_key=cache_key)
    return gateway.submit(inp, tenant)


def test_a_tenants_keyed_requests_stay_on_one_worker_while_unkeyed_ones_spread_by_load(gated):
    """Gate closed: a filler takes w0, so the key's first request is placed on w1 by load; the next ones follow
    the key to w1 (without it, the third would go to w0: one request there against two on w1), unkeyed ones
    still go by load, and another tenant's same key is placed as any request."""
    gateway, gate, kv = gated
    filler = submit(gateway, PROMPTS[0])
    keyed = [submit(gateway, p, cache_key="doc") for p in PROMPTS[1:4]]
    unkeyed = submit(gateway, PROMPTS[4])
    other_tenant = submit(gateway, PROMPTS[5], tenant="b", cache_key="doc")
    assert filler.worker_id == "w0"
    assert [h.worker_id for h in keyed] == ["w1", "w1", "w1"]
    assert unkeyed.worker_id == "w0" and other_tenant.worker_id == "w0"
    # Place was asked for all but the key's second and third requests
    assert kv.placed == [("a", "w0"), ("a", "w1"), ("a", "w0"), ("b", "w0")]
    gate.set()
    for handle in [filler, *keyed, unkeyed, other_tenant]:
        deltas = list(handle)
        assert deltas[-1].finish_reason is FinishReason.LENGTH
        assert [t for d in deltas for t in d.token_ids] == reference(handle.req.prompt_token_ids, 4)

    idle_keyed = submit(gateway, PROMPTS[6], cache_key="doc")  # both idle: Place's tie would name w0
    assert idle_keyed.worker_id == "w1" and len(kv.placed) == 4
    list(idle_keyed)


def test_a_full_or_draining_remembered_worker_sends_the_key_elsewhere_and_it_is_remembered_there(gated):
    gateway, gate, kv = gated
    gate.set()
    w0, w1 = gateway.engines
    gateway.affinity.remember("a", "doc", "w1")
    req = Request("r0", "a", [5, 6, 7], RequestParams(max_tokens=1), cache_key="doc")
    assert gateway.place(req, {"w0": 0, "w1": 2}, [w0, w1]) is w1 and kv.placed == []
    assert gateway.place(req, {"w0": 0, "w1": 3}, [w0, w1]) is w0  # full: Place named the least loaded
    assert kv.placed == [("a", "w0")]
    assert gateway.place(req, {"w0": 0, "w1": 0}, [w0, w1]) is w0  # and the key follows it there

    gateway.affinity.remember("a", "doc", "w1")
    w1.drain()
    handle = submit(gateway, PROMPTS[7], cache_key="doc")
    assert handle.worker_id == "w0"
    assert gateway.affinity.worker_for("a", "doc", {"w0": 0}) == "w0"
    assert list(handle)[-1].finish_reason is FinishReason.LENGTH
