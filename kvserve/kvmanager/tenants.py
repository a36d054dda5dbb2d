"""Who may keep how much of the cache: per-tenant weights, floors, caps and pin budgets (``--tenants-file``).

The kvmanager enforces them (fair_share.py), so the file is the kvmanager's, not the gateway's: the gateway's
``--api-keys-file`` maps secrets to tenant names, this one gives those names their share of the cache, and an
operator can publish it (it holds no secret). TOML::

    active_window = "5m"    # a tenant counts for the fair share while it used the cache this recently

    [default]               # every tenant the file does not name
    weight = 1

    [tenant.acme]
    weight = 3              # its share of each pool and of the shared tier, against the other active tenants'
    floor = "20%"           # of each pool (or a page count): below it, its pages are evicted last of all
    cap = 4000              # pages (or "50%"): at or over it, its own pages are evicted first
    pin_budget = "10%"      # pages its soft pins may hold; default: half its floor (half its fair share without one)
    store_floor = "2GiB"    # the same in bytes of the shared KV tier
    store_cap = "8GiB"

Without a file every tenant has weight 1, no floor and no cap: the cache is shared equally among the tenants
active in the window.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvserve.common.units import byte_size

DEFAULT_ACTIVE_WINDOW_MS = 300_000
DEFAULT_PIN_SHARE = 0.5  # of the floor (or of the fair share when there is no floor)
POLICIES = ("fair", "lru")  # lru: one global LRU over every tenant, as before fair share (for comparisons)


class TenantsFileError(ValueError):
    """The tenants file cannot be read or says something that is not a policy."""


@dataclass(frozen=True, slots=True)
class Amount:
    """Pages of a pool: a count, or a share of the pool's pages. Zero: none."""

    pages: int = 0
    share: float = 0.0

    def of(self, num_pages: int) -> int:
        return self.pages or int(self.share * num_pages)

    def __bool__(self) -> bool:
        return bool(self.pages or self.share)


NONE = Amount()


@dataclass(frozen=True, slots=True)
class TenantQuota:
    weight: float = 1.0
    floor: Amount = NONE
    cap: Amount = NONE
    pin_budget: Amount | None = None  # None: DEFAULT_PIN_SHARE of the floor, or of the fair share
    store_floor_bytes: int = 0
    store_cap_bytes: int = 0


@dataclass(frozen=True, slots=True)
class CachePolicy:
    """How pages and tier entries are chosen for eviction (fair_share.py)."""

    mode: str = "fair"
    default: TenantQuota = TenantQuota()
    tenants: dict[str, TenantQuota] = field(default_factory=dict)
    active_window_ms: int = DEFAULT_ACTIVE_WINDOW_MS

    @property
    def fair(self) -> bool:
        return self.mode == "fair"

    def quota(self, tenant: str) -> TenantQuota:
        return self.tenants.get(tenant, self.default)


def policy_to_dict(p: CachePolicy) -> dict:
    """The policy as JSON-ready data: it is state too (snapshot.py, call_log.py), since replaying calls under
    another policy would evict, and so hand out, other pages than the calls did."""
    return asdict(p)


def policy_from_dict(d: dict) -> CachePolicy:
    def quota(q: dict) -> TenantQuota:
        pin = q["pin_budget"]
        return TenantQuota(q["weight"], Amount(**q["floor"]), Amount(**q["cap"]),
                           None if pin is None else Amount(**pin), q["store_floor_bytes"], q["store_cap_bytes"])

    return CachePolicy(d["mode"], quota(d["default"]), {t: quota(q) for t, q in d["tenants"].items()},
                       d["active_window_ms"])


def load_policy(path: Path | None, mode: str = "fair") -> CachePolicy:
    """The policy of a tenants file (None: the defaults). Raises TenantsFileError naming the file and field."""
    if mode not in POLICIES:
        raise TenantsFileError(f"cache policy must be one of {', '.join(POLICIES)}, got {mode!r}")
    if path is None:
        return CachePolicy(mode)
    try:
        doc = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise TenantsFileError(f"{path}: {e}") from None
    try:
        return parse_policy(doc, mode)
    except TenantsFileError as e:
        raise TenantsFileError(f"{path}: {e}") from None


def parse_policy(doc: dict, mode: str = "fair") -> CachePolicy:
    unknown = set(doc) - {"active_window", "default", "tenant"}
    if unknown:
        raise TenantsFileError(f"unknown keys {sorted(unknown)} (expected active_window, [default], [tenant.NAME])")
    window = _duration_ms("active_window", doc.get("active_window", "5m"))
    default = _quota("[default]", doc.get("default", {}))
    tenants = doc.get("tenant", {})
    if not isinstance(tenants, dict):
        raise TenantsFileError("[tenant] must be tables: [tenant.NAME]")
    quotas = {name: _quota(f"[tenant.{name}]", t) for name, t in tenants.items()}
    return CachePolicy(mode, default, quotas, window)


QUOTA_KEYS = ("weight", "floor", "cap", "pin_budget", "store_floor", "store_cap")


def _quota(where: str, t) -> TenantQuota:
    if not isinstance(t, dict):
        raise TenantsFileError(f"{where} must be a table")
    unknown = set(t) - set(QUOTA_KEYS)
    if unknown:
        raise TenantsFileError(f"{where}: unknown keys {sorted(unknown)} (expected {', '.join(QUOTA_KEYS)})")
    weight = t.get("weight", 1)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < math.inf:
        raise TenantsFileError(f"{where}: weight must be a positive number, got {weight!r}")
    floor, cap = _amount(where, "floor", t.get("floor")), _amount(where, "cap", t.get("cap"))
    pin = _amount(where, "pin_budget", t["pin_budget"]) if "pin_budget" in t else None
    store_floor, store_cap = _bytes(where, "store_floor", t.get("store_floor")), _bytes(where, "store_cap",
                                                                                          t.get("store_cap"))
    if cap and floor and (cap.share and floor.share and cap.share < floor.share
                          or cap.pages and floor.pages and cap.pages < floor.pages):
        raise TenantsFileError(f"{where}: cap {_show(cap)} is below floor {_show(floor)}")
    if store_cap and store_floor > store_cap:
        raise TenantsFileError(f"{where}: store_cap ({store_cap} bytes) is below store_floor ({store_floor} bytes)")
    return TenantQuota(float(weight), floor, cap, pin, store_floor, store_cap)


def _amount(where: str, key: str, value) -> Amount:
    if value is None:
        return NONE
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return Amount(pages=value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*%\s*", value)
        if m and float(m.group(1)) <= 100:
            return Amount(share=float(m.group(1)) / 100)
    raise TenantsFileError(f"{where}: {key} must be a page count (an integer >= 0) or a share of the pool "
                           f"(\"25%\"), got {value!r}")


def _bytes(where: str, key: str, value) -> int:
    if value is None:
        return 0
    try:
        if isinstance(value, int) and not isinstance(value, bool):
            return byte_size(str(value), allow_zero=True)
        if isinstance(value, str):
            return byte_size(value, allow_zero=True)
    except ValueError as e:
        raise TenantsFileError(f"{where}: {key}: {e}") from None
    raise TenantsFileError(f"{where}: {key} must be a byte size (\"2GiB\" or an integer), got {value!r}")


def _duration_ms(key: str, value) -> int:
    units = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)\s*", value)
        if m and float(m.group(1)) > 0:
            return int(float(m.group(1)) * units[m.group(2)])
    raise TenantsFileError(f"{key} must be a duration like \"90s\", \"5m\" or \"1h\", got {value!r}")


def _show(a: Amount) -> str:
    return f"{a.share:.0%}" if a.share else f"{a.pages} pages"
