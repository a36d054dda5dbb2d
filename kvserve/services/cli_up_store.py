"""``kvserve up``'s KV store: the shared KV tier's Redis (--kv-store-bytes, default DEFAULT_KV_STORE_BYTES; 0 = off): an
embedded instance of its own under <data dir>/kv-store, unless --kv-store-url names one. Its own instance, not
a keyspace of the kvmanager's Redis: GBs of KV bytes would make that one's AOF rewrites, snapshots and restarts
slow, and its memory bound (maxmemory, an LRU backstop to the kvmanager's own bound) must not apply to the
kvmanager's state. It keeps no AOF (a value lost is a miss, never an error): it saves an RDB file when it stops,
so that a stack stopped and started again on the same data dir finds its KV bytes again.
"""

from __future__ import annotations

import contextlib

DEFAULT_KV_STORE_BYTES = "2GiB"  # 4x a worker's default pool: revisits survive evictions, within a laptop's RAM


def kv_store_argv(args, worker: bool = False) -> list[str]:
    """The shared KV tier's flags of a kvmanager (URL and bound) or a worker (URL); none with the tier off."""
    if not args.kv_store_bytes:
        return []
    return ["--kv-store-url", args.kv_store_url] + ([] if worker else ["--kv-store-bytes", str(args.kv_store_bytes)])


def open_kv_store(args, stack: contextlib.ExitStack) -> None:
    """Starts the embedded KV store unless --kv-store-url (or the tier is off); sets args.kv_store_url."""
    if not args.kv_store_bytes or args.kv_store_url:
        return
    from kvserve.common.embedded_redis import EmbeddedRedis
    from kvserve.services.cli_kvmanager import default_data_dir

    data_dir = (args.data_dir or default_data_dir()).expanduser() / "kv-store"
    maxmemory = args.kv_store_bytes * 5 // 4 + (64 << 20)  # values' overhead; the kvmanager's bound comes first
    store = EmbeddedRedis(data_dir, args=("--appendonly", "no", "--save", "3600", "1", "--maxmemory", str(maxmemory),
                                          "--maxmemory-policy", "allkeys-lru"))
    stack.enter_context(store)
    args.kv_store_url = store.url
