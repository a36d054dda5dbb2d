"""Token ids: the one check of a list of them, and their wire form (little-endian uint32 bytes: what the prefix
hash chain hashes, what the kvmanager's calls carry and what its call log stores)."""

from __future__ import annotations

import sys
from array import array

from kvserve.common.errors import InvalidRequest

LITTLE = sys.byteorder == "little"
UINT32 = next(code for code in "IL" if array(code).itemsize == 4)  # the array typecode of a 4-byte unsigned int
MAX_TOKEN_ID = (1 << 32) - 1


def check_token_ids(where: str, token_ids, vocab_size: int | None = None) -> None:
    """Raises InvalidRequest (naming ``where`` and the first bad id) unless ``token_ids`` is not empty and every id
    is an int in [0, vocab_size), or a uint32 when the vocabulary is not known (the kvmanager hashes them as
    uint32)."""
    prefix = f"{where}: " if where else ""
    if not len(token_ids):
        raise InvalidRequest(f"{prefix}token_ids must not be empty")
    if vocab_size is None:
        try:
            array(UINT32, token_ids)  # one C pass; raises for anything that is not a uint32
            return
        except (OverflowError, TypeError):
            bad = next(t for t in token_ids if not (isinstance(t, int) and 0 <= t <= MAX_TOKEN_ID))
            raise InvalidRequest(f"{prefix}token id {bad} is not a uint32") from None
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"{prefix}token id {bad} is outside the vocabulary [0, {vocab_size})")


def le_uint32(token_ids) -> bytes:
    """Token ids as little-endian uint32 bytes (callers validated 0 <= id < 2**32). An array of uint32 (what
    unpack_uint32 returns) is copied as is on little-endian machines."""
    if LITTLE and isinstance(token_ids, array) and token_ids.typecode == UINT32:
        return token_ids.tobytes()
    words = array(UINT32, token_ids)
    if not LITTLE:
        words.byteswap()
    return words.tobytes()


def unpack_uint32(data: bytes) -> array:
    """The inverse of le_uint32: an array of token ids (a sequence of ints). Raises ValueError when ``data``
    is not a whole number of 4-byte words."""
    if len(data) % 4:
        raise ValueError(f"{len(data)} bytes are not a whole number of 4-byte token ids")
    words = array(UINT32)
    words.frombytes(data)
    if not LITTLE:
        words.byteswap()
    return words
