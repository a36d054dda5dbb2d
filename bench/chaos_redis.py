"""The chaos run's Redis: a Sentinel deployment (tests/support/redis_sentinel.py's SentinelCluster, the tests'
harness), else one EmbeddedRedis. Either way the fault is a SIGKILL of the primary:

    SentinelRedis   kill -9 of the primary's redis-server; the sentinels promote a replica (the killed node
                    comes back as a replica once the phase drained: restore())
    SingleRedis     kill -9 of the only redis-server, restarted at once on the same port and AOF

Of SentinelCluster this module uses ``SentinelCluster(data_dir)``, ``.url`` (``redis+sentinel://...``),
``kill_primary()``, ``wait_for_failover(old_port, timeout_s)``, ``restart(port)`` and ``stop()``.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from redis_sentinel import SentinelCluster  # noqa: E402  (the tests' harness)

from kvserve.common.embedded_redis import EmbeddedRedis  # noqa: E402


class SingleRedis:
    """One EmbeddedRedis (AOF, appendfsync everysec), a child of this process."""

    kind = "one embedded redis-server (no Sentinel): kill -9, restarted on the same port and AOF"

    def __init__(self, data_dir: Path):
        self.server = EmbeddedRedis(data_dir)
        self.url = self.server.url

    def kill_primary(self) -> dict:
        """SIGKILL, then a restart on the same port and data; figures: restart_s (to PING answered)."""
        t0 = time.monotonic()
        proc = self.server.proc
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        self.server.start()  # polls PING under a deadline
        return {"redis_restarted_s": time.monotonic() - t0}

    def restore(self) -> None:
        """Nothing to do: kill_primary restarted it."""

    def stop(self) -> None:
        self.server.stop()


class SentinelRedis:
    """A SentinelCluster (a primary, two replicas, three sentinels) owned by this run."""

    kind = "Redis Sentinel (primary + 2 replicas, 3 sentinels): kill -9 of the primary, a replica promoted"

    def __init__(self, data_dir: Path, failover_timeout_s: float = 30.0):
        self.cluster = SentinelCluster(Path(data_dir))
        self.url = self.cluster.url
        self.failover_timeout_s = failover_timeout_s
        self.killed: int | None = None

    def kill_primary(self) -> dict:
        """SIGKILL of the primary; returns once the sentinels name another primary and it says it is one.
        Figures: failover_s. Raises TimeoutError past the deadline."""
        t0 = time.monotonic()
        self.killed = self.cluster.kill_primary()
        new = self.cluster.wait_for_failover(self.killed, self.failover_timeout_s)
        return {"failover_s": time.monotonic() - t0, "old_primary_port": self.killed, "new_primary_port": new}

    def restore(self) -> None:
        """The killed node back, as a replica of the new primary (as an init script would do)."""
        if self.killed is not None:
            self.cluster.restart(self.killed)
            self.killed = None

    def stop(self) -> None:
        self.cluster.stop()


def make_redis(data_dir: Path, sentinel: bool):
    return SentinelRedis(data_dir) if sentinel else SingleRedis(data_dir)
