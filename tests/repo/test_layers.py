"""The layers, read from the code itself: imports only point down, nothing cycles, and the cores know no gRPC.

    kvserve/services/   top: gateway (core, and its gRPC front-end in rpc/), client SDK, CLI
    kvserve/worker/  kvserve/kvmanager/   domains: neither imports the other
    kvserve/kernels/    paged attention
    kvserve/common/     plumbing shared by all of the above
    v1          generated protobuf modules (protos/kvserve/v1)

Every import counts, those inside functions included; only ``if TYPE_CHECKING:`` blocks do not (they never run).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"v1": ROOT / "protos" / "kvserve" / "v1", **{layer: ROOT / "kvserve" / layer for layer in
                                                          ("common", "kernels", "worker", "kvmanager", "services")}}
RANK = {"v1": 0, "common": 1, "kernels": 2, "worker": 3, "kvmanager": 3, "services": 4}
# The modules of a domain that may speak gRPC: its servicer, its server, its protobuf converters.
GRPC_GLUE = {"kvserve.worker.servicer", "kvserve.worker.server", "kvserve.kvmanager.servicer",
             "kvserve.kvmanager.server", "kvserve.kvmanager.convert",
             "kvserve.worker.membership",  # the worker's lease keeper: a client of the kvmanager, server wiring
             "kvserve.worker.peer_client"}  # the link page transfers read other workers over (transfer.py's PageReader)
TRANSPORT_FREE_CORES = ("kvserve.services.gateway.", "kvserve.kvmanager.", "kvserve.worker.", "kvserve.kernels.")


def _modules() -> dict[str, Path]:
    """kvserve module name -> file, for every module of every package."""
    out = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(("kvserve", package, *parts))] = path
    return out


MODULES = _modules()


def _runtime_nodes(tree: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def imports_of(module: str) -> set[str]:
    """The modules ``module`` imports (kvserve ones resolved to a module of MODULES; others by their name)."""
    found = set()
    for node in _runtime_nodes(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module
                      for alias in node.names}
    return found


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "kvserve" and len(parts) > 1 and parts[1] in PACKAGES else None


GRAPH = {m: {i for i in imports_of(m) if i in MODULES} for m in MODULES}


def test_every_import_between_packages_points_down():
    wrong = sorted(f"{m} -> {i}" for m, deps in GRAPH.items() for i in deps
                   if package_of(i) != package_of(m) and RANK[package_of(i)] >= RANK[package_of(m)])
    assert not wrong, "imports into the same or a higher layer:\n" + "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_packages_or_modules():
    packages = {}
    for m, deps in GRAPH.items():
        packages.setdefault(package_of(m), set()).update(package_of(i) for i in deps if package_of(i) != package_of(m))
    assert _cycles(packages) == []
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith(TRANSPORT_FREE_CORES)))
def test_cores_import_no_grpc_outside_their_glue(module):
    if module in GRPC_GLUE or module.startswith("kvserve.services.gateway.rpc"):
        return
    transport = sorted(i for i in imports_of(module)
                       if i.split(".")[0] in ("grpc", "grpc_health", "grpc_reflection") or i.startswith("kvserve.v1"))
    assert not transport, f"{module} imports {transport}"


def test_importing_the_cores_loads_no_grpc_and_no_generated_module():
    """In a fresh interpreter: the gateway's scheduler, engine and app, the kvmanager's manager and the worker's
    model import, and neither grpc nor any *_pb2 module was loaded on the way."""
    code = ("import sys\n"
            "import kvserve.services.gateway.scheduler, kvserve.services.gateway.engine, kvserve.services.gateway.app\n"
            "import kvserve.kvmanager.manager, kvserve.worker.model\n"
            "bad = [m for m in sys.modules if m.split('.')[0] == 'grpc' or m.endswith('_pb2')]\n"
            "assert 'kvserve.services.gateway.engine' in sys.modules\n"
            "print(sorted(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def importable_at(folder: Path) -> set[str]:
    """The top-level names a regular import would take from ``folder`` when it is on sys.path: modules and packages
    with an ``__init__.py`` (a folder without one is a namespace portion, which any installed package outranks)."""
    names = {p.stem for p in folder.glob("*.py")} | {p.parent.name for p in folder.glob("*/__init__.py")}
    return {name for name in names if name.isidentifier()}


def test_nothing_at_the_repository_root_shadows_an_installed_package():
    # `python -m pytest`, `python -m ...` and a REPL in a checkout put its root first on sys.path: a `kernels/` package
    # there once took the place of HF's `kernels`, and `import transformers` failed.
    assert importable_at(ROOT) == set()
    assert not (ROOT / "kvserve" / "__init__.py").exists()  # a namespace package, as the installed kvserve is


def test_the_shadow_check_sees_a_package_and_a_module(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").touch()
    (tmp_path / "namespace_only").mkdir()
    (tmp_path / "setup.py").touch()
    assert importable_at(tmp_path) == {"kernels", "setup"}
