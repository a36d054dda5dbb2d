"""The one check of what a generation request asks to compute, in the worker's own terms. Every front-end (the
gateway's gRPC and HTTP APIs, the CLI's --local) and the worker's Step run these same functions, so that what
the gateway admits is exactly what a worker computes: a value that is finite as a Python float but not as the
worker's float32 (temperature 1e308) is refused at the door, naming its field, and never reaches a step.

The wire types bound the rest: SamplingParams travel as float32, int32 and uint64 (common.proto).
"""

from __future__ import annotations

import math
from array import array

from kvserve.common.errors import InvalidRequest
from kvserve.common.wire.worker import SamplingParams

MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 256
INT32_MAX = (1 << 31) - 1
UINT64_MAX = (1 << 64) - 1


def as_float32(x: float) -> float:
    """``x`` as the worker computes with it: rounded to float32 (inf past +-3.4e38, 0 below 1.4e-45)."""
    return array("f", [x])[0]


def _fail(where: str, param: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{where}: {param} {message}" if where else f"{param} {message}", param=param)


def check_sampling(where: str, p: SamplingParams) -> None:
    """Raises InvalidRequest naming the first field the worker could not compute with (``where`` prefixes the
    message: the step item, or "" for a client's request)."""
    temperature = as_float32(p.temperature)
    if not math.isfinite(temperature) or temperature < 0:
        raise _fail(where, "temperature", f"must be finite and >= 0 as a float32 (at most 3.4e38), got "
                                          f"{p.temperature}")
    if not 0 <= p.top_k <= INT32_MAX:
        raise _fail(where, "top_k", f"must be >= 0 (0 disables it) and at most {INT32_MAX}, got {p.top_k}")
    top_p = as_float32(p.top_p)
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise _fail(where, "top_p", f"must lie in (0, 1] as a float32 (at least 1.4e-45), got {p.top_p}")
    if not 0 <= p.top_logprobs <= MAX_TOP_LOGPROBS:
        raise _fail(where, "top_logprobs", f"must lie in [0, {MAX_TOP_LOGPROBS}], got {p.top_logprobs}")
    if p.seed is not None and not 0 <= p.seed <= UINT64_MAX:
        raise _fail(where, "seed", f"must lie in [0, 2**64), got {p.seed}")


def check_stop(stop: tuple[str, ...]) -> None:
    """At most MAX_STOP_STRINGS stop strings of 1 to MAX_STOP_CHARS characters each, valid Unicode text."""
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", param="stop")
    for i, s in enumerate(stop):
        if not s or len(s) > MAX_STOP_CHARS:
            raise InvalidRequest(f"stop[{i}] must have 1 to {MAX_STOP_CHARS} characters, got {len(s)}",
                                 param="stop")
        check_text(f"stop[{i}]", s)


def check_text(param: str, text: str) -> None:
    """Text must be valid Unicode: a JSON body may carry a lone UTF-16 surrogate ("\\ud800") that no tokenizer
    can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(f"{param} holds {text[e.start]!r} at character {e.start}, a lone UTF-16 surrogate: "
                             "not valid Unicode text", param=param) from None
