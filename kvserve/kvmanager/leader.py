"""Leader election between kvmanager processes on one Redis: a lease, and the fencing token it comes with.

The lease is the well-known single-instance Redis recipe (the Redis documentation's SET NX PX lock): a key
that one process holds, with a time to live, and a value unique to that process instance::

    <prefix>:leader   "<advertised host:port> <random nonce>"   PX ttl

    acquire   SET <prefix>:leader <value> NX PX ttl          (a standby, every ttl/4)
    renew     if GET == value then PEXPIRE ttl               (the leader, every ttl/3; Lua, atomic)
    release   if GET == value then DEL                       (a graceful stop, a step-down; Lua, atomic)

A lease alone does not make a leader safe: a leader paused for longer than ttl (GC, SIGSTOP, a partition)
resumes believing it leads. So the new leader claims the prefix after acquiring the lease (snapshot.claim
increments ``<prefix>:owner``: its fencing token) and only then loads the state, and every write a leader makes
checks the token atomically in Redis (fencing.py). A deposed leader's late write fails with Fenced and is never
acknowledged; the leader that gets it steps down at once.

A leader that cannot renew (Redis unreachable, or another holds the key) before its lease runs out steps down
too: it stops answering and goes back to standby; its in-memory state is dropped, and a later term loads it
again from Redis. The value names the advertised address, so a standby can say who leads.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable

import redis

from kvserve.kvmanager.service import KVService

log = logging.getLogger("kvserve.kvmanager")
DEFAULT_LEASE_S = 2.0
RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class LeaderLease:
    """One process instance's lease on ``<prefix>:leader``. ``client`` should have short timeouts (a fraction
    of the lease): a renewal that hangs must not outlast it."""

    def __init__(self, client: redis.Redis, prefix: str, address: str, ttl_s: float = DEFAULT_LEASE_S):
        if ttl_s <= 0:
            raise ValueError(f"the leader lease must be positive, got {ttl_s}")
        self.client, self.key, self.address = client, f"{prefix}:leader", address
        self.value = f"{address} {secrets.token_hex(8)}"
        self.ttl_s = ttl_s
        self.ttl_ms = max(1, int(ttl_s * 1000))

    def acquire(self) -> bool:
        """Takes the lease if nobody holds it."""
        return bool(self.client.set(self.key, self.value, nx=True, px=self.ttl_ms))

    def renew(self) -> bool:
        """Extends the lease by a full ttl if this instance still holds it (False: lost)."""
        return bool(self.client.eval(RENEW, 1, self.key, self.value, self.ttl_ms))

    def release(self) -> bool:
        """Gives the lease up if this instance holds it, so a standby takes over at its next poll."""
        return bool(self.client.eval(RELEASE, 1, self.key, self.value))

    def holder(self) -> tuple[str | None, int]:
        """(the leader's advertised address or None, milliseconds its lease has left)."""
        with self.client.pipeline(transaction=False) as pipe:
            value, pttl = pipe.get(self.key).pttl(self.key).execute()
        if value is None:
            return None, 0
        value = value.decode() if isinstance(value, bytes) else value
        return value.rsplit(" ", 1)[0], max(0, int(pttl))


class Election:
    """Runs one kvmanager process's side of the election over ``service`` (a KVService on a Redis store).

    first() makes the election before the ready line; spawn() then runs the loop in a thread of its own: as
    standby it tries to acquire every ttl/4, as leader it renews every ttl/3. ``on_role(leading)`` is told each
    change (the server flips gRPC health with it). Winning means service.take_over() (claim, load); losing means
    service.step_down(). The lease is kept renewed while the state loads.
    """

    def __init__(self, lease: LeaderLease, service: KVService, on_role: Callable[[bool], None] = lambda _: None):
        self.lease, self.service, self.on_role = lease, service, on_role
        self.leading = False
        self.lease_deadline = 0.0  # time.monotonic() by which the lease may have lapsed in Redis
        self.num_terms = 0
        self.last_takeover_s = 0.0  # acquire to serving, of the latest term
        self.last_failure = ""  # why the latest attempt to take over failed
        self.wake = threading.Event()  # set when a write was fenced, or to stop
        self.closing = threading.Event()
        self.thread: threading.Thread | None = None
        service.leading = False  # a standby until it wins
        service.on_fenced = self.wake.set
        self._standby("no kvmanager leads yet")

    @property
    def poll_s(self) -> float:
        return self.lease.ttl_s / 4

    @property
    def renew_s(self) -> float:
        return self.lease.ttl_s / 3

    # -- the first election ------------------------------------------------------------------------------
    def first(self, stop: threading.Event) -> bool:
        """Leads at once when the lease is free. When another instance holds it, watches it for up to 1.5 ttl:
        it lapses (its holder died, e.g. killed just before this restart: this one takes over) or it is
        renewed or taken by another (a live leader: this one is a standby). So a lone kvmanager's ready line
        always means it leads. Raises when Redis is unreachable or the state cannot be loaded."""
        deadline = time.monotonic() + 1.5 * self.lease.ttl_s
        seen = None
        while not stop.is_set():
            if self._try_lead(raise_errors=True):
                return True
            holder = self.lease.holder()
            if seen is not None and holder[0] is not None and (holder[0] != seen[0] or holder[1] > seen[1]):
                return False  # renewed, or taken by another: a live leader
            seen = holder if holder[0] is not None else seen
            if time.monotonic() >= deadline:
                return False
            stop.wait(self.lease.ttl_s / 10)
        return False

    # -- the loop ----------------------------------------------------------------------------------------
    def spawn(self) -> threading.Thread:
        """Starts run() in a daemon thread; close() ends it."""
        self.thread = threading.Thread(target=self.run, name="kvmanager-election", daemon=True)
        self.thread.start()
        return self.thread

    def run(self) -> None:
        """Until close(): the standby's polls and the leader's renewals; a fenced write wakes it at once."""
        while not self.closing.is_set():
            wait_s = self.tick()
            self.wake.wait(wait_s)
            self.wake.clear()

    def tick(self) -> float:
        """One turn of the loop; the seconds until the next."""
        if not self.leading:
            return 0.0 if self._try_lead() else self.poll_s
        if not self.service.leading:  # a write was fenced: the service stopped leading itself
            self._step_down(self.service.not_leading_why)
            return self.poll_s
        t0 = time.monotonic()
        try:
            if self.lease.renew():
                self.lease_deadline = t0 + self.lease.ttl_s
                return self.renew_s
            self._step_down("not the leader any more: another kvmanager holds the lease")
            return self.poll_s
        except redis.RedisError as e:
            if time.monotonic() >= self.lease_deadline:
                self._step_down(f"not the leader any more: its lease lapsed, Redis unreachable ({e})")
                return self.poll_s
            return min(self.renew_s, max(0.0, self.lease_deadline - time.monotonic()))

    def close(self) -> None:
        """A graceful stop, once the server stopped answering: gives the lease up, so a standby takes over at
        its next poll instead of waiting for the lease to lapse."""
        self.closing.set()
        self.wake.set()
        if self.thread is not None:
            self.thread.join()
        if self.leading:
            self.leading = False
            with contextlib.suppress(redis.RedisError):
                self.lease.release()

    # -- taking over and stepping down -------------------------------------------------------------------
    def _try_lead(self, raise_errors: bool = False) -> bool:
        t0 = time.monotonic()
        try:
            if not self.lease.acquire():
                self._standby_naming_leader()
                return False
            self.lease_deadline = t0 + self.lease.ttl_s
            with self._renewing() as lost:
                self.service.take_over()
            if lost.is_set():
                raise RuntimeError("the lease was lost while the state loaded")
        except Exception as e:  # noqa: BLE001 - Redis down, a state that does not load: stay a standby
            self.service.step_down(f"not the leader: this kvmanager could not take over ({type(e).__name__}: {e})")
            with contextlib.suppress(redis.RedisError):
                self.lease.release()
            if raise_errors:
                raise
            why = f"{type(e).__name__}: {e}"
            if why != self.last_failure:  # once, not at every poll while Redis is down
                log.warning("kvmanager: could not take over as leader (%s); still a standby", why)
            self.last_failure = why
            return False
        self.last_failure = ""
        self.leading = True
        self.num_terms += 1
        self.last_takeover_s = time.monotonic() - t0
        log.info("kvmanager: leader (term %d) on %s, state loaded in %.0f ms", self.num_terms, self.lease.address,
                 self.last_takeover_s * 1000)
        self.on_role(True)
        return True

    @contextlib.contextmanager
    def _renewing(self):
        """Renews the lease every ttl/3 in a thread while the body runs (a big state can take longer than the
        lease to load); yields an event set if a renewal found the lease lost."""
        done, lost = threading.Event(), threading.Event()

        def renew() -> None:
            while not done.wait(self.renew_s):
                t0 = time.monotonic()
                try:
                    if not self.lease.renew():
                        lost.set()
                        return
                    self.lease_deadline = t0 + self.lease.ttl_s
                except redis.RedisError:
                    if time.monotonic() >= self.lease_deadline:
                        lost.set()
                        return

        thread = threading.Thread(target=renew, name="kvmanager-lease-while-loading", daemon=True)
        thread.start()
        try:
            yield lost
        finally:
            done.set()
            thread.join()

    def _step_down(self, why: str) -> None:
        self.leading = False
        self.service.step_down(why)
        log.warning("kvmanager: stepped down (%s); a standby now", why)
        self.on_role(False)
        with contextlib.suppress(redis.RedisError):
            self.lease.release()
        self._standby_naming_leader()

    def _standby_naming_leader(self) -> None:
        try:
            address, _ = self.lease.holder()
        except redis.RedisError as e:
            self._standby(f"Redis is unreachable ({type(e).__name__})")
            return
        self._standby(f"the leader is {address}" if address else "no kvmanager leads now")

    def _standby(self, leader: str) -> None:
        if not self.service.leading:
            self.service.not_leading_why = (f"not the leader: this kvmanager ({self.lease.address}) is a standby; "
                                            f"{leader}")
