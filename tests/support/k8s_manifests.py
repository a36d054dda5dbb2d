"""Reads k8s/ for the manifest tests (test_k8s*.py): the resources a kustomization lists, the workloads, their
containers, env and ports, the ConfigMaps its generators make, and the CLI's environment variables."""

from __future__ import annotations

import ast
import functools
import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "k8s"
AUTOSCALING_DIR = K8S_DIR / "autoscaling"
DISAGGREGATED_DIR = K8S_DIR / "disaggregated"
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
# The CLI module that defines each service subcommand's flags; kvserve/services/cli_flags.py adds the shared ones.
CLI_MODULES = {"kvmanager": "cli_kvmanager.py", "worker": "cli_worker.py", "gateway": "cli_gateway.py"}
SHARED_CLI_MODULE = "cli_flags.py"


def kustomization(directory: Path = K8S_DIR) -> dict:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def load_docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.load_all(path.read_text(), Loader=_LOADER) if doc is not None]


def resources(directory: Path = K8S_DIR) -> list[dict]:
    """Every document of every file the kustomization in ``directory`` lists under resources (read once per
    test session: the tests only read them)."""
    return _resources(directory)


@functools.cache
def _resources(directory: Path) -> list[dict]:
    docs: list[dict] = []
    for name in kustomization(directory)["resources"]:
        docs += load_docs(directory / name)
    return docs


def of_kind(kind: str, docs: list[dict] | None = None) -> list[dict]:
    return [doc for doc in (resources() if docs is None else docs) if doc["kind"] == kind]


def one(kind: str, name: str, docs: list[dict] | None = None) -> dict:
    found = [doc for doc in of_kind(kind, docs) if doc["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def workloads(docs: list[dict] | None = None) -> list[dict]:
    """The Deployments and StatefulSets of ``docs`` (default: the base's resources)."""
    return [doc for doc in (resources() if docs is None else docs) if doc["kind"] in WORKLOAD_KINDS]


def workload(name: str) -> dict:
    """The Deployment or StatefulSet of that name, whichever kind it is."""
    found = [doc for doc in workloads() if doc["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one workload {name}, found {[doc['kind'] for doc in found]}"
    return found[0]


def pod_labels(workload_doc: dict) -> dict:
    return workload_doc["spec"]["template"]["metadata"]["labels"]


def selected_workloads(selector: dict, docs: list[dict] | None = None) -> list[dict]:
    """The workloads (of ``docs``, default the base's) whose pods carry every label of ``selector`` (a Service's
    or a matchLabels)."""
    return [w for w in workloads(docs) if selector.items() <= pod_labels(w).items()]


def all_containers(workload_doc: dict) -> list[dict]:
    pod_spec = workload_doc["spec"]["template"]["spec"]
    return pod_spec.get("initContainers", []) + pod_spec["containers"]


def container(workload_doc: dict, name: str | None = None) -> dict:
    """The workload's one container, or its container (init containers included) called ``name``."""
    if name is None:
        (only,) = workload_doc["spec"]["template"]["spec"]["containers"]
        return only
    (found,) = [c for c in all_containers(workload_doc) if c["name"] == name]
    return found


def container_port(c: dict, port: int | str) -> int:
    """Resolves a Service targetPort or probe port (number or port name) against the container's ports."""
    if isinstance(port, int):
        assert port in [p["containerPort"] for p in c["ports"]], f"port {port} is no container port"
        return port
    named = {p["name"]: p["containerPort"] for p in c["ports"] if "name" in p}
    assert port in named, f"port name {port!r} not among the container's ports {sorted(named)}"
    return named[port]


def env(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def env_value(c: dict, name: str) -> str:
    return env(c)[name]["value"]


def ports(c: dict) -> dict[str, int]:
    """The container's ports by name."""
    return {p["name"]: p["containerPort"] for p in c["ports"]}


def pod_dns_names(statefulset: dict) -> list[str]:
    """<statefulset>-<ordinal>.<serviceName> for every replica: the pods' names through the headless Service."""
    spec = statefulset["spec"]
    return [f"{statefulset['metadata']['name']}-{i}.{spec['serviceName']}" for i in range(spec["replicas"])]


def generated_config_maps(directory: Path = K8S_DIR) -> list[dict]:
    """The ConfigMaps the kustomization's configMapGenerator makes (not resources: no file of their own)."""
    return kustomization(directory).get("configMapGenerator", [])


def generator_files(generator: dict) -> dict[str, str]:
    """A generator's files as {ConfigMap key: file path}; an entry is `path` or `key=path`."""
    files: dict[str, str] = {}
    for entry in generator.get("files", []):
        key, _, path = entry.rpartition("=")
        files[key or Path(path).name] = path
    return files


def config_map_files(name: str) -> dict[str, Path]:
    """The generated ConfigMap ``name`` as {key: the file on disk it is made from}."""
    (generator,) = [g for g in generated_config_maps() if g["name"] == name]
    return {key: K8S_DIR / path for key, path in generator_files(generator).items()}


def kubectl_kustomize(directory: Path) -> list[dict]:
    assert shutil.which("kubectl"), "kubectl is not on PATH"
    out = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc is not None]


def copy_of_k8s(tmp_path: Path) -> Path:
    """A copy of k8s/ at tmp_path/k8s, to edit or to put an overlay beside."""
    return Path(shutil.copytree(K8S_DIR, tmp_path / "k8s"))


def kustomize_with_component(tmp_path: Path, component: str, *more: str) -> list[dict]:
    """The base with the Component k8s/<component> (and the ``more`` after it, in that order), as an overlay of
    one's own would apply it (kustomize refuses paths that leave the overlay's root by an absolute path, so a
    copy of the base and the overlay sit side by side)."""
    copy_of_k8s(tmp_path)
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(
        {"resources": ["../k8s"], "components": [f"../k8s/{name}" for name in (component, *more)]}))
    return kubectl_kustomize(overlay)


def cli_env_names(command: str) -> set[str]:
    """Every KVSERVE_<NAME> that `kvserve COMMAND`'s flags fall back to: the literal first argument of each
    ``_env(...)`` / ``env_default(...)`` / ``env_switch(...)`` call in its CLI module and in the shared flags
    module, read from the source (not by parsing), so a variable that only a code path far from argparse reads
    counts too."""
    names: set[str] = set()
    for module in (CLI_MODULES[command], SHARED_CLI_MODULE):
        tree = ast.parse((ROOT / "kvserve" / "services" / module).read_text())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("_env", "env_default", "env_switch") and node.args
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                names.add(f"KVSERVE_{node.args[0].value.upper()}")
    return names
