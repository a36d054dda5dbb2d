"""The gateway follows the kvmanager's membership: one engine loop per live worker, started as a worker joins and
retired as it leaves, drains or is dropped.

A poll thread reads ListWorkers every ``membership_poll_s`` and reconciles:

    member not served yet               dial its address, check its Info, register, start its engine
    member draining                     its engine takes no new request; its queued ones go elsewhere
    engine whose member is gone         retire: its requests are handed over to live workers (recompute)
    member at another address           the worker restarted elsewhere: retire the old engine, dial the new one

A (worker_id, epoch) retired here is never dialled again: a worker that comes back joins under a new epoch.
While the kvmanager does not answer, nothing changes (its absence says nothing about the workers), and a member
missing from one answer is retired only once it is still missing MISSING_FOR_S later: a kvmanager that has just
taken over may answer before its members' first heartbeats.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvserve.common.wire.worker import WorkerInfo
from kvserve.services.gateway.backends import WorkerBackend
from kvserve.services.gateway.errors import BackendFailure, WorkerUnavailable

log = logging.getLogger("kvserve.gateway")
MISSING_FOR_S = 1.0


class Membership:
    def __init__(self, gateway, connect_worker: Callable[[str], WorkerBackend]):
        self.gateway, self.connect_worker = gateway, connect_worker
        self.cfg = gateway.cfg
        self.members: dict[str, object] = {}  # worker_id -> WorkerMember, as of the last answer
        self.retired: set[tuple[str, int]] = set()  # (worker_id, epoch) never served again
        self._failed: dict[tuple[str, int, str], str] = {}  # members that could not be served: why (logged once)
        self._missing_since: dict[str, float] = {}  # worker_id of a served worker not listed -> first seen so
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="membership", daemon=True)

    def start(self) -> None:
        """Waits (up to connect_timeout_s) until a first worker serves, then follows membership in the
        background. Raises WorkerUnavailable when none joins in time."""
        deadline = time.monotonic() + self.cfg.connect_timeout_s
        while not self.gateway.engines:
            self.poll()
            if self.gateway.engines:
                break
            if time.monotonic() > deadline:
                raise WorkerUnavailable(f"no worker joined the kvmanager within {self.cfg.connect_timeout_s:g} s")
            self._stop.wait(self.cfg.membership_poll_s)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def is_member(self, info: WorkerInfo) -> bool:
        """Whether the kvmanager lists this worker incarnation (asked now; True while it cannot answer)."""
        try:
            members = self.gateway.kv.list_workers()
        except BackendFailure:
            return True
        return any(m.worker_id == info.worker_id and m.epoch == info.epoch for m in members)

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.membership_poll_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - a bug here must not stop following membership
                log.exception("membership: a poll failed")
            self.gateway.expire_parked()

    def poll(self) -> None:
        """One reconcile of the engines with the kvmanager's list of live workers."""
        try:
            members = {m.worker_id: m for m in self.gateway.kv.list_workers()}
        except BackendFailure as e:
            log.debug("membership: the kvmanager did not list its workers (%s)", e)
            return
        self.members = members
        engines = {e.info.worker_id: e for e in self.gateway.engines}
        now = time.monotonic()
        for worker_id in [w for w in self._missing_since if w in members or w not in engines]:
            del self._missing_since[worker_id]
        for worker_id, engine in engines.items():
            member = members.get(worker_id)
            if member is None:
                since = self._missing_since.setdefault(worker_id, now)
                if now - since >= MISSING_FOR_S:
                    self.retire(engine, "it left the kvmanager's membership (left, or its lease lapsed)")
            elif member.address != engine.worker.address:
                self.retire(engine, f"it joined again at {member.address}")
            elif member.draining and not engine.draining:
                log.info("worker %s drains: no new requests go to it", worker_id)
                engine.drain()
        for worker_id, member in members.items():
            if member.draining or (worker_id, member.epoch) in self.retired:
                continue
            engine = engines.get(worker_id)
            if engine is None or engine.retiring or member.address != engine.worker.address:
                self._serve(member)

    def retire(self, engine, why: str) -> None:
        """Retires the engine and never dials this (worker_id, epoch) again."""
        self.retired.add((engine.info.worker_id, engine.info.epoch))
        self.gateway.retire(engine, why)

    def _serve(self, member) -> None:
        """Dials a member, checks and registers it, and starts its engine. A member that cannot be served is
        logged once and tried again at each poll (it may still be starting)."""
        if self.gateway.closing:
            return
        key = (member.worker_id, member.epoch, member.address)
        worker = self.connect_worker(member.address)
        try:
            engine = self.gateway.connect_engine(worker, wait_s=max(1.0, 4 * self.cfg.membership_poll_s))
        except (BackendFailure, ValueError) as e:
            worker.close()
            if self._failed.get(key) != str(e):
                log.warning("membership: worker %s at %s cannot be served yet: %s", member.worker_id,
                            member.address, e)
                self._failed[key] = str(e)
            return
        self._failed.pop(key, None)
        if (engine.info.worker_id, engine.info.epoch) in self.retired:
            worker.close()
            return
        log.info("membership: worker %s joined at %s (epoch %d)", member.worker_id, member.address,
                 engine.info.epoch)
        self.gateway.add_engine(engine)
