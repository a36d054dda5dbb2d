"""``kvserve up``'s KV store: the shared KV tier's Redis (--kv-store-bytes, default DEFAULT_KV_STORE_BYTES; 0 = off): an
embedded instance of its own under <data dir>/kv-store, unless --kv-store-url names one. Its own instance, not
a keyspace of the kvmanager's Redis: GBs of KV bytes would make that one's AOF rewrites, snapshots and restarts
slow, and its memory bound (maxmemory, an LRU backstop to the kvmanager's own bound) must not apply to the
kvmanager's state. It keeps no AOF (a value lost is a miss, never an error): it saves an RDB file when it stops,
so that a stack stopped and started again on the same data dir finds its KV bytes again.

A model that mixes sliding and full layers (Gemma 3) is served with page groups by default, and a store value holds
every layer of a page: its workers get no store (``workers_use_store``), unless --no-page-groups.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

DEFAULT_KV_STORE_BYTES = "2GiB"  # 4x a worker's default pool: revisits survive evictions, within a laptop's RAM


def kv_store_argv(args, worker: bool = False) -> list[str]:
    """The shared KV tier's flags of a kvmanager (URL and bound) or a worker (URL); none with the tier off, nor
    for a worker that keeps page groups."""
    if not args.kv_store_bytes or (worker and not workers_use_store(args)):
        return []
    return ["--kv-store-url", args.kv_store_url] + ([] if worker else ["--kv-store-bytes", str(args.kv_store_bytes)])


def workers_use_store(args) -> bool:
    """False when the workers keep page groups (on, for a --model whose sliding and full layers mix): page groups
    and the shared KV tier do not work together yet, and the groups' memory saving is the default."""
    return not (args.page_groups and args.model and mixes_layers(Path(args.model)))


def mixes_layers(model: Path) -> bool:
    """Whether the model folder's config mixes sliding-window and full-attention layers (False when it cannot be
    read: the worker then says what is wrong with it)."""
    from kvserve.worker.config import ModelConfig

    try:
        return bool(ModelConfig.from_dict(json.loads((model / "config.json").read_text())).layer_windows)
    except Exception:  # noqa: BLE001 - any unreadable or unserved config: not this function's error to report
        return False


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
