"""The reaper: a thread of the kvmanager process that declares dead the members whose lease lapsed, so that a
worker that died for good loses its pool (and its requests are recomputed elsewhere) within about a lease and a
tenth, whoever else is calling."""

from __future__ import annotations

import logging
import threading

from kvserve.kvmanager.errors import StoreUnavailable
from kvserve.kvmanager.membership import DeadMember
from kvserve.kvmanager.service import KVService

log = logging.getLogger("kvserve.kvmanager")
CHECKS_PER_LEASE = 10


class MemberReaper:
    """Calls ``service.expire_members`` every ``lease / CHECKS_PER_LEASE`` seconds until stopped; logs each
    worker it declares dead."""

    def __init__(self, service: KVService, interval_s: float | None = None):
        self.service = service
        self.interval_s = interval_s if interval_s is not None else service.members.lease_s / CHECKS_PER_LEASE
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvserve-reaper", daemon=True)
        self._failing = False  # the last pass could not write the store (logged once until it can)

    def start(self) -> MemberReaper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()

    def run_once(self) -> list[DeadMember]:
        """One pass: the members declared dead now (logged)."""
        dead = self.service.expire_members(self.service.members.clock())
        for d in dead:
            log.warning("kvmanager: worker %s epoch %d (%s) declared dead: %s; its pool is dropped with %d live "
                        "requests", d.worker_id, d.epoch, d.address, d.reason, len(d.dropped_req_ids))
        return dead

    def _run(self) -> None:
        while not self._stopping.wait(self.interval_s):
            try:
                self.run_once()
            except StoreUnavailable as e:  # the next pass tries again
                if not self._failing:
                    log.warning("kvmanager: the reaper could not write the store (%s); retrying", e)
                self._failing = True
            except Exception:  # a bug: say so, and keep reaping
                log.exception("kvmanager: reaper pass failed")
            else:
                self._failing = False
