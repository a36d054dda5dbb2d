"""Fenced writes: every write a kvmanager leader makes to Redis checks, atomically in Redis, that its claim on
the prefix is still the latest.

The fencing token is the ``<prefix>:owner`` counter (snapshot.claim): a kvmanager increments it when it claims
the prefix, before it reads the state, and remembers the number. A leader that was paused (a GC pause, SIGSTOP,
a network partition) while its lease lapsed and another took over resumes believing it leads; the fence makes
each of its writes a no-op that fails instead, so a deposed leader's late write is never applied::

    A claims: owner = 5   A writes (owner == 5: applied)   A paused ...             A writes (owner == 6: refused)
                                                      B's lease, B claims: owner = 6, B loads what A wrote

Every write that passed the fence happened before the new leader's claim, so the new leader, which reads only
after its claim, loads it. The check is a short Lua script sent with EVAL, not EVALSHA: a promoted replica (Redis
failover) may not have the script cached. A refused write is an error reply starting with FENCED, raised here as
errors.Fenced; redis-py raises every other failure as before.

The switch to a new snapshot (snapshot.write's MULTI/EXEC) is fenced with WATCH on the owner key instead
(fenced_pipeline): EXEC fails if anyone claimed in between. Left unfenced, because a deposed leader's copy of
them is harmless: a snapshot's chunks under its new generation's key (nobody reads them before the switch) and
the deletion of generations older than one already switched to (which nobody loads again).
"""

from __future__ import annotations

from contextlib import contextmanager

import redis

from kvserve.kvmanager.errors import Fenced

# KEYS[1] the owner key, ARGV[1] the token, ARGV[2..] the command and its arguments.
FENCED_CALL = """
local owner = redis.call('GET', KEYS[1])
if owner ~= ARGV[1] then
  return redis.error_reply('FENCED the prefix is claimed by ' .. tostring(owner) .. ', not ' .. ARGV[1])
end
return redis.call(unpack(ARGV, 2))
"""
# KEYS[1] the owner key, KEYS[2] the list, ARGV[1] the token, ARGV[2..] the values: RPUSH in chunks (Lua's
# unpack takes a few thousand values at most). Returns the list's length.
FENCED_RPUSH = """
local owner = redis.call('GET', KEYS[1])
if owner ~= ARGV[1] then
  return redis.error_reply('FENCED the prefix is claimed by ' .. tostring(owner) .. ', not ' .. ARGV[1])
end
local n = 0
for i = 2, #ARGV, 1000 do
  n = redis.call('RPUSH', KEYS[2], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
return n
"""
FENCED_PREFIX = "FENCED"


def as_fenced(error: redis.ResponseError) -> Exception:
    """The error to raise for a script's error reply: Fenced for a refused write, the error itself otherwise."""
    text = str(error)
    return Fenced(f"a write was refused by the fencing token: {text.removeprefix(FENCED_PREFIX).strip()}; another "
                  "kvmanager has claimed the prefix since") if text.startswith(FENCED_PREFIX) else error


def fenced_call(client: redis.Redis, owner_key: str, token: int, *command):
    """``command`` (e.g. "HSET", key, field, value) run only while ``owner_key`` still holds ``token``; its reply.
    Raises Fenced when another kvmanager has claimed the prefix since, redis errors as the command would."""
    try:
        return client.eval(FENCED_CALL, 1, owner_key, str(token), *command)
    except redis.ResponseError as e:
        raise as_fenced(e) from e


def rpush_command(owner_key: str, token: int, key: str, values) -> tuple:
    """The fenced RPUSH as a raw command, for a caller that sends it itself (connection.send_command) and reads
    the reply later (read_fenced_reply)."""
    return ("EVAL", FENCED_RPUSH, 2, owner_key, key, str(token), *values)


def fenced_rpush(client: redis.Redis, owner_key: str, token: int, key: str, values) -> int:
    """RPUSH key *values, only while ``owner_key`` holds ``token``; the list's length. Raises Fenced."""
    try:
        return client.execute_command(*rpush_command(owner_key, token, key, values))
    except redis.ResponseError as e:
        raise as_fenced(e) from e


def read_fenced_reply(connection):
    """connection.read_response() of a command sent with rpush_command; raises Fenced for a refused write."""
    try:
        return connection.read_response()
    except redis.ResponseError as e:
        raise as_fenced(e) from e


@contextmanager
def fenced_pipeline(client: redis.Redis, owner_key: str, token: int):
    """A MULTI/EXEC pipeline that commits only while ``owner_key`` holds ``token``: yields it after WATCH and
    MULTI; queue the commands, and the exit runs EXEC. Raises Fenced (nothing written) when the token is not
    the latest, before or during the transaction."""
    with client.pipeline(transaction=True) as pipe:
        pipe.watch(owner_key)
        owner = _token_of(pipe.get(owner_key))
        if owner != token:
            raise Fenced(f"a write was refused by the fencing token: the prefix is claimed by {owner}, not {token}; "
                         "another kvmanager has claimed the prefix since")
        pipe.multi()
        yield pipe
        try:
            pipe.execute()
        except redis.WatchError as e:
            # redis-py raises WatchError too when the connection drops while watching: not a claim, a failure
            if _token_of(client.get(owner_key)) == token:
                raise redis.ConnectionError(f"the transaction failed: {e}") from e
            raise Fenced(f"a write was refused by the fencing token {token}: another kvmanager claimed the prefix "
                         "during the transaction") from e


def _token_of(value) -> int | None:
    return None if value is None else int(value)
