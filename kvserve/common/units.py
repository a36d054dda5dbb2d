"""Byte sizes as people write them ('512MiB', '1.5GiB', '64MB', '536870912'), for flags and config files."""

from __future__ import annotations

UNITS = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
         "tb": 10**12, "b": 1}


def byte_size(text: str, allow_zero: bool = False) -> int:
    """'512MiB' -> 536870912: > 0, or >= 0 with ``allow_zero``. Raises ValueError saying what is wrong."""
    s = text.strip().lower()
    for suffix, factor in UNITS.items():
        if s.endswith(suffix):
            s, scale = s[: -len(suffix)], factor
            break
    else:
        scale = 1
    try:
        value = float(s) * scale
    except ValueError:
        raise ValueError(f"not a byte size: {text!r} (try 536870912 or 512MiB)") from None
    if not value >= 0 or (value == 0 and not allow_zero):  # NaN too
        raise ValueError(f"byte size must be {'>= 0' if allow_zero else 'positive'}, got {text!r}")
    return int(value)
