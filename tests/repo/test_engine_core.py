"""The engine core's boundaries, read from the code: the scheduler's fields are written by the scheduler alone
(the core and the loop ask it through its methods), and the core has no threads.

A write is an assignment, augmented assignment or ``del`` of ``<x>.scheduler.<field>`` or ``scheduler.<field>``
(or of an item of one), or a mutating call on one (``.pop``, ``.clear``, ``.append``, ...); rebuilding the
scheduler (``<x>.scheduler = ...`` outside an ``__init__``) counts too. Checked in every module of the package
and of bench/.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCHEDULER = ROOT / "kvserve" / "services" / "gateway" / "scheduler.py"
CORE = ROOT / "kvserve" / "services" / "gateway" / "core.py"
MUTATORS = {"append", "appendleft", "extend", "extendleft", "insert", "pop", "popleft", "popitem", "remove", "clear",
            "update", "setdefault", "add", "discard", "sort", "reverse", "rotate", "__setitem__", "__delitem__"}


def scheduler_fields() -> set[str]:
    """The attributes Scheduler's methods assign on ``self``."""
    tree = ast.parse(SCHEDULER.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Scheduler")
    return {t.attr for node in ast.walk(cls) for t in _targets(node)
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        out = []
        for t in node.targets:
            out += t.elts if isinstance(t, ast.Tuple) else [t]
        return out
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    if isinstance(node, ast.Delete):
        return list(node.targets)
    return []


def _is_scheduler(expr: ast.expr) -> bool:
    return (isinstance(expr, ast.Name) and expr.id == "scheduler") or (
        isinstance(expr, ast.Attribute) and expr.attr == "scheduler")


def _field_of(expr: ast.expr, fields: set[str]) -> str | None:
    """The scheduler field ``expr`` is or is an item of (``x.scheduler.requests[k]`` -> "requests"), if any."""
    while isinstance(expr, ast.Subscript):
        expr = expr.value
    if isinstance(expr, ast.Attribute) and expr.attr in fields and _is_scheduler(expr.value):
        return expr.attr
    return None


def writes(source: str, fields: set[str]) -> list[str]:
    """Where ``source`` writes a scheduler field, as "line: what", in line order."""
    tree = ast.parse(source)
    inits = [(f.lineno, f.end_lineno) for f in ast.walk(tree)
             if isinstance(f, ast.FunctionDef) and f.name == "__init__"]
    found = []
    for node in ast.walk(tree):
        for t in _targets(node):
            field = _field_of(t, fields)
            if field is not None:
                found.append((node.lineno, f"writes scheduler.{field}"))
            elif (isinstance(t, ast.Attribute) and _is_scheduler(t)
                  and not any(a <= node.lineno <= b for a, b in inits)):
                found.append((node.lineno, "replaces the scheduler"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            field = _field_of(node.func.value, fields)
            if field is not None:
                found.append((node.lineno, f"{node.func.attr}() on scheduler.{field}"))
    return [f"{line}: {what}" for line, what in sorted(found)]


def _modules() -> list[Path]:
    folders = ("kvserve", "bench")
    return [p for folder in folders for p in sorted((ROOT / folder).rglob("*.py")) if p != SCHEDULER]


def test_no_module_outside_the_scheduler_writes_its_fields():
    fields = scheduler_fields()
    assert {"waiting", "running", "requests", "pending_frees", "num_available_pages"} <= fields
    found = [f"{p.relative_to(ROOT)}:{w}" for p in _modules() for w in writes(p.read_text(), fields)]
    assert not found, "scheduler fields written outside scheduler.py:\n" + "\n".join(found)


def test_the_check_sees_each_kind_of_write():
    fields = scheduler_fields()
    source = ("class Loop:\n"
              "    def __init__(self):\n"
              "        self.scheduler = Scheduler(cfg)\n"  # building it is not a write
              "    def run(self, scheduler):\n"
              "        self.scheduler.requests.pop('a')\n"
              "        self.scheduler.waiting.clear()\n"
              "        self.core.scheduler.num_available_pages += 1\n"
              "        scheduler.running = []\n"
              "        del self.scheduler.requests['b']\n"
              "        self.scheduler = Scheduler(self.scheduler.cfg)\n"
              "        n = len(self.scheduler.running) + self.scheduler.num_queued\n")
    assert writes(source, fields) == [
        "5: pop() on scheduler.requests", "6: clear() on scheduler.waiting",
        "7: writes scheduler.num_available_pages", "8: writes scheduler.running", "9: writes scheduler.requests",
        "10: replaces the scheduler"]


def test_the_engine_core_has_no_threads_and_no_locks():
    tree = ast.parse(CORE.read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"threading", "_thread", "multiprocessing", "asyncio"}
