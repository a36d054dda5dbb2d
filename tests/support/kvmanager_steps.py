"""A kvmanager built and stepped in tests: registered pools, and one call with the invariants checked in full
after it (holes and page groups included)."""

from __future__ import annotations

from step_ids import step_id_for

from kvserve.common.wire.pages import PoolSpec, StepOps, StepResults
from kvserve.kvmanager.invariants import check_invariants
from kvserve.kvmanager.manager import KVManager


def manager_with(*specs: PoolSpec) -> KVManager:
    m = KVManager()
    for s in specs:
        m.register_worker(s)
    return m


def checked_step(m: KVManager, step_id=None, **ops) -> StepResults:
    """One call (``ops``: StepOps' fields, any iterables), then the invariants."""
    out = m.step(StepOps(step_id_for(m, step_id), **{k: tuple(v) for k, v in ops.items()}))
    check_invariants(m)
    return out
