"""Protobuf <-> SamplingParams (common.proto's message, in every generation request and every step item)."""

from __future__ import annotations

from kvserve.common.wire.worker import SamplingParams
from kvserve.v1 import common_pb2


def sampling_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        seed=p.seed if p.HasField("seed") else None,
        top_logprobs=p.top_logprobs,
    )


def sampling_to_proto(s: SamplingParams) -> common_pb2.SamplingParams:
    p = common_pb2.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_logprobs=s.top_logprobs)
    if s.top_p != 1.0:
        p.top_p = s.top_p
    if s.seed is not None:
        p.seed = s.seed
    return p
