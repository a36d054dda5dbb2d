"""Redis clients of kvserve's services (the kvmanager's state, the shared KV tier): connect() (a plain
``redis://`` URL or a Sentinel one) and the replication check
after each write (ReplicaWait). The embedded Redis that ``kvserve up`` and ``kvserve kvmanager`` start by default
is a process, not a client: kvserve/common/embedded_redis.py.

URLs::

    redis://HOST:PORT/DB, rediss://..., unix://...       one Redis (redis-py's from_url)
    redis+sentinel://H:P[,H:P...]/SERVICE_NAME[/DB][?password=PW&sentinel_password=PW]
                                                         the current primary of SERVICE_NAME, as the sentinels
                                                         at H:P (default port 26379) name it

Durability of an acknowledged call, by deployment (a call is answered only once its write returned):

- One Redis, no replicas (the embedded one, or a ``redis://`` URL). What gets ``kill -9``'d in practice is the
  kvmanager, not Redis: every write the kvmanager acknowledged is already in Redis' memory (and AOF buffer), and
  Redis keeps running, so a kvmanager restart (kill -9 included) loses nothing. A crash of Redis itself (or of
  the machine) loses what its persistence had not written yet: the embedded one runs ``appendonly yes`` with
  ``appendfsync everysec`` and no RDB snapshots (``save ""``), so the last ~1 s of writes; ``appendfsync always``
  would close that window at the cost of one fsync per RPC, which takes longer than the calls themselves. A
  graceful stop (SIGTERM) flushes and fsyncs the AOF. An external Redis loses what its own settings lose.
- Replicas (Sentinel, or a managed Redis behind one ``redis://`` name). Replication is asynchronous: a primary
  that dies loses the writes its replicas had not received yet, and a replica without them is then promoted.
  With ``wait_replicas`` N > 0 the store sends ``WAIT N timeout_ms`` on the connection of each write (each log
  append, each inline snapshot, each new generation number) and treats fewer than N acknowledgements as a
  failed write (NotReplicated: the call answers UNAVAILABLE and is retried with the same step_id; the next write
  rewrites the whole state, so nothing is built on a write the replicas may lack). An acknowledged call is then
  in the memory of the primary and of at least N replicas. WAIT is not strong consistency: it neither makes the
  write durable on the replicas' disks nor keeps a replica that lacks it from being promoted. What makes it hold
  is that Sentinel promotes, among the replicas of equal ``replica-priority`` that it can reach, the one with
  the highest replication offset, which has every acknowledged write as long as one of the N replicas that
  acknowledged it is alive. So with N=1 and two replicas an acknowledged call survives the loss of the primary,
  unless the only replica that had it dies too (or is cut off while the other is promoted); N=2 survives one
  more loss, at the cost of waiting for the slower replica. While fewer than N replicas are up, every call
  waits ``timeout_ms`` (holding the service lock) and answers UNAVAILABLE. A call that answered UNAVAILABLE may
  or may not be on the new primary; its retry makes it so either way.
- A demoted primary (it answers READONLY after a failover, reached through a stale connection, DNS name or load
  balancer) is a dropped connection: the client disconnects and retries on a new connection, which reaches the
  current primary (through the sentinels, or through DNS); until then the call answers UNAVAILABLE.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection

SENTINEL_SCHEME = "redis+sentinel"
DEFAULT_SENTINEL_PORT = 26379


def connect(url: str, timeout_s: float = 2.0) -> redis.Redis:
    """A client for the kvmanager's store: bounded connect/read timeouts, two quick retries on a dropped
    connection (a retried MULTI/EXEC is safe: the store writes current values, so a repeat is idempotent).
    A ``redis+sentinel://`` URL gives a client of the service's current primary: each new connection asks the
    sentinels where it is, so after a failover the retried call reaches the promoted replica. Raises
    ValueError for a malformed URL."""
    options = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
               "retry": Retry(ExponentialBackoff(cap=0.1, base=0.01), retries=2),
               "health_check_interval": 30, "decode_responses": True}
    if is_sentinel_url(url):
        return _primary_of(parse_sentinel_url(url), timeout_s, options)
    if urllib.parse.urlsplit(url).scheme == "redis":  # rediss:// and unix:// keep their own connection class
        options["connection_class"] = PrimaryConnection
    return redis.Redis.from_url(url, **options)


class _DropsOnReadOnly:
    """A connection to what should be the primary, which drops itself on READONLY (also inside a script's
    error: a fenced write runs as a Lua script): the node it reached was demoted, and a new connection may reach
    the new primary. The ConnectionError makes the client retry on one."""

    def read_response(self, *args, **kwargs):
        try:
            return super().read_response(*args, **kwargs)
        except redis.ResponseError as e:
            if not is_read_only(e):
                raise
            self.disconnect()
            raise redis.ConnectionError(f"{self.host}:{self.port} is a read-only replica now ({e})") from e


def is_read_only(error: redis.ResponseError) -> bool:
    """READONLY, as a command's reply or inside a script's error (a fenced write runs as a Lua script)."""
    return isinstance(error, redis.ReadOnlyError) or "-READONLY " in str(error)


class PrimaryConnection(_DropsOnReadOnly, redis.Connection):
    """A plain URL's connection (a failover behind a DNS name or a load balancer)."""


class SentinelPrimaryConnection(_DropsOnReadOnly, SentinelManagedConnection):
    """redis.sentinel's connection: dropped, it asks the sentinels again for the primary."""


# -- Sentinel ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SentinelUrl:
    """A parsed ``redis+sentinel://H:P[,H:P...]/SERVICE_NAME[/DB][?password=&sentinel_password=]``."""

    sentinels: tuple[tuple[str, int], ...]
    service_name: str
    db: int = 0
    password: str | None = None  # of the Redis nodes
    sentinel_password: str | None = None  # of the sentinels


def is_sentinel_url(url: str | None) -> bool:
    return bool(url) and url.lower().startswith(SENTINEL_SCHEME + "://")


def parse_sentinel_url(url: str) -> SentinelUrl:
    """Raises ValueError, naming the URL and what is wrong with it."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() != SENTINEL_SCHEME:
        raise ValueError(f"{url!r}: not a {SENTINEL_SCHEME}:// URL")
    if "@" in parts.netloc:
        raise ValueError(f"{url!r}: give passwords as ?password=...&sentinel_password=..., not user:pass@")
    if not parts.netloc:
        raise ValueError(f"{url!r}: no sentinel address (expected {SENTINEL_SCHEME}://HOST:PORT[,HOST:PORT...]/"
                         "SERVICE_NAME[/DB])")
    sentinels = tuple(_host_port(url, address) for address in parts.netloc.split(","))
    path = [urllib.parse.unquote(p) for p in parts.path.strip("/").split("/")] if parts.path.strip("/") else []
    if not path or not path[0]:
        raise ValueError(f"{url!r}: no service name (expected {SENTINEL_SCHEME}://HOST:PORT/SERVICE_NAME[/DB])")
    if len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(f"{url!r}: the path must be /SERVICE_NAME or /SERVICE_NAME/DB (DB a number), got "
                         f"{parts.path!r}")
    query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
    unknown = sorted(set(query) - {"password", "sentinel_password"})
    if unknown:
        raise ValueError(f"{url!r}: unknown option(s) {', '.join(unknown)} (known: password, sentinel_password)")
    return SentinelUrl(sentinels, path[0], int(path[1]) if len(path) == 2 else 0,
                       query.get("password", [None])[-1], query.get("sentinel_password", [None])[-1])


def _host_port(url: str, address: str) -> tuple[str, int]:
    """'host:port', '[v6]:port', or a host alone (port 26379)."""
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else rest
    else:
        host, sep, port = address.rpartition(":")
        if not sep:
            host, port = address, ""
    if not host:
        raise ValueError(f"{url!r}: empty sentinel host in {address!r}")
    if not port:
        return host, DEFAULT_SENTINEL_PORT
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{url!r}: bad port {port!r} in sentinel address {address!r} (expected 1..65535)")
    return host, int(port)


def _primary_of(target: SentinelUrl, timeout_s: float, options: dict) -> redis.Redis:
    # The sentinels are asked once each, no retry: an unreachable one is skipped for the next.
    sentinel_options = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
                        "retry": Retry(NoBackoff(), 0), "password": target.sentinel_password}
    sentinels = Sentinel(list(target.sentinels), sentinel_kwargs=sentinel_options)
    return sentinels.master_for(target.service_name, db=target.db, password=target.password,
                                connection_class=SentinelPrimaryConnection, **options)


def describe_url(url: str) -> str:
    """The URL for a log line: passwords left out; a Sentinel URL says which service it follows."""
    if not is_sentinel_url(url):
        return url
    target = parse_sentinel_url(url)
    addresses = ",".join(f"{h}:{p}" if ":" not in h else f"[{h}]:{p}" for h, p in target.sentinels)
    return (f"{SENTINEL_SCHEME}://{addresses}/{target.service_name}/{target.db} (the primary of sentinel "
            f"service {target.service_name!r})")


def fresh_client(client: redis.Redis, **overrides) -> redis.Redis:
    """A new client, with a connection pool of its own, to what ``client`` talks to (for a Sentinel client: the
    current primary, found through connections of its own to the same sentinels); ``overrides`` change
    connection options (``decode_responses=False``). Reads ``client``'s settings only, never its connections,
    so a forked child may call it. Close it with close_client()."""
    pool = client.connection_pool
    kwargs = {**pool.connection_kwargs, **overrides}
    if not isinstance(pool, SentinelConnectionPool):
        return redis.Redis(connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **kwargs))
    kwargs.pop("connection_pool")  # the old pool's proxy: the new pool makes its own
    old = pool.sentinel_manager
    addresses = [(s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
                 for s in old.sentinels]
    sentinels = Sentinel(addresses, min_other_sentinels=old.min_other_sentinels, sentinel_kwargs=old.sentinel_kwargs)
    return sentinels.master_for(pool.service_name, connection_pool_class=type(pool),
                                check_connection=pool.check_connection, connection_class=pool.connection_class,
                                **kwargs)


def close_client(client: redis.Redis) -> None:
    """Closes a client of fresh_client(), and its connections to the sentinels."""
    pool = client.connection_pool
    client.close()
    pool.disconnect()
    if isinstance(pool, SentinelConnectionPool):
        pool.sentinel_manager.close()


# -- replication ------------------------------------------------------------------------------------------------
class NotReplicated(redis.RedisError):
    """Fewer replicas than asked acknowledged a write within the timeout: it is on the primary, but may be lost
    with it. The write counts as failed."""


@dataclass(frozen=True, slots=True)
class ReplicaWait:
    """``WAIT num_replicas timeout_ms`` after a write, on the write's own connection (WAIT covers the writes
    of the connection it is sent on, up to its last one); nothing when ``num_replicas`` is 0."""

    num_replicas: int = 0
    timeout_ms: int = 500

    def __bool__(self) -> bool:
        return self.num_replicas > 0

    def send(self, conn: redis.Connection) -> None:
        """Sends the WAIT behind a command sent on ``conn``, unread (read() reads its reply)."""
        if self:
            conn.send_command("WAIT", self.num_replicas, self.timeout_ms)

    def read(self, conn: redis.Connection) -> None:
        if self:
            self.check(conn.read_response())

    def run(self, client: redis.Redis, command):
        """``command(client)`` (a write: ``lambda c: c.rpush(...)``), then the WAIT on the same connection: both
        in one pipeline. Returns the command's reply; raises NotReplicated."""
        if not self:
            return command(client)
        with client.pipeline(transaction=False) as pipe:
            command(pipe)
            pipe.wait(self.num_replicas, self.timeout_ms)
            reply, num_acks = pipe.execute()
        self.check(num_acks)
        return reply

    def check(self, num_acks) -> None:
        """Raises NotReplicated when fewer than ``num_replicas`` acknowledged."""
        if self and int(num_acks) < self.num_replicas:
            raise NotReplicated(f"WAIT {self.num_replicas} {self.timeout_ms}: {num_acks} of {self.num_replicas} "
                                f"replica(s) acknowledged the write within {self.timeout_ms} ms")

    def describe(self) -> str:
        if not self:
            return "no WAIT"
        return f"WAIT for {self.num_replicas} replica(s) within {self.timeout_ms} ms after each write"
