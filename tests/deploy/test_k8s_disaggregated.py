"""The disaggregated Component (k8s/disaggregated/): rendered over the base, the workers' StatefulSet becomes two,
kvserve-worker-prefill and kvserve-worker-decode, whose pods are the base's worker pod but for the role (so the
same image, model, pool and KV format, as the kvmanager requires of pools that hand pages to each other), are
reachable at the addresses they join with, and may pull pages from each other through the NetworkPolicies.
Schema validation of the rendering is test_k8s_schema.py's."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
from k8s_manifests import (
    DISAGGREGATED_DIR,
    K8S_DIR,
    ROOT,
    cli_env_names,
    container,
    env,
    kubectl_kustomize,
    kustomization,
    kustomize_with_component,
    of_kind,
    one,
    ports,
    selected_workloads,
)
from test_k8s_hardening import ANYONE, TLS_ENV, TLS_SECRET, admitted

from kvserve.services.cli import build_parser

ROLES = ("prefill", "decode")
ROLE_LABEL = "kvserve.io/worker-role"
ROLE_ENV = "KVSERVE_ROLE"
BASE_WORKER = "kvserve-worker"
ROLE_WORKERS = {role: f"kvserve-worker-{role}" for role in ROLES}
WORKER_PORT = 50061
METRICS_PORT = 9100


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return kustomize_with_component(tmp_path_factory.mktemp("disaggregated"), "disaggregated")


@pytest.fixture(scope="module")
def base() -> list[dict]:
    return kubectl_kustomize(K8S_DIR)


def _without_role(template: dict) -> dict:
    """A role pod's template less what its role adds: the role label and KVSERVE_ROLE."""
    template = copy.deepcopy(template)
    del template["metadata"]["labels"][ROLE_LABEL]
    c = container({"spec": {"template": template}}, "worker")
    c["env"] = [e for e in c["env"] if e["name"] != ROLE_ENV]
    return template


def test_the_component_is_off_by_default_and_says_how_to_turn_it_on() -> None:
    component = kustomization(DISAGGREGATED_DIR)
    assert component["kind"] == "Component"
    assert "components" not in kustomization()
    text = (K8S_DIR / "kustomization.yaml").read_text()
    assert "`- disaggregated`" in text


def test_the_workers_are_one_statefulset_per_role(rendered: list[dict]) -> None:
    statefulsets = {s["metadata"]["name"]: s for s in of_kind("StatefulSet", rendered)}
    assert BASE_WORKER not in statefulsets, "replaced: a worker of role both would prefill too"
    for role, name in ROLE_WORKERS.items():
        s = statefulsets[name]
        assert s["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvserve"
        assert s["spec"]["replicas"] >= 1
        selector = s["spec"]["selector"]["matchLabels"]
        assert selector == {"app.kubernetes.io/name": BASE_WORKER, ROLE_LABEL: role}
        assert selector.items() <= s["spec"]["template"]["metadata"]["labels"].items()
        c = container(s, "worker")
        assert c["command"][:2] == ["kvserve", "worker"]
        assert env(c)[ROLE_ENV] == {"name": ROLE_ENV, "value": role}
    # Each StatefulSet owns its role's pods alone.
    for name in ROLE_WORKERS.values():
        selector = statefulsets[name]["spec"]["selector"]["matchLabels"]
        assert [w["metadata"]["name"] for w in selected_workloads(selector, rendered)] == [name]


@pytest.mark.parametrize("role", ROLES)
def test_a_role_pod_is_the_base_worker_pod_but_for_its_role(rendered: list[dict], base: list[dict],
                                                            role: str) -> None:
    """Same image, model, pool size, KV format, probes and resources as the base's workers (one source: the
    Component copies the base's pod template), and the same governing Service and pod management."""
    spec = one("StatefulSet", ROLE_WORKERS[role], rendered)["spec"]
    base_spec = one("StatefulSet", BASE_WORKER, base)["spec"]
    assert _without_role(spec["template"]) == base_spec["template"]
    assert (spec["serviceName"], spec["podManagementPolicy"]) == (base_spec["serviceName"],
                                                                   base_spec["podManagementPolicy"])


@pytest.mark.parametrize("role", ROLES)
def test_each_worker_pod_is_reachable_at_the_address_it_joins_with(rendered: list[dict], role: str) -> None:
    """A worker joins the kvmanager with its pod IP on its gRPC port (what the gateway and the decode workers
    dial) and its pod name as worker id; its StatefulSet's headless Service selects it, so it has a DNS name too
    (kvserve-worker-prefill-0.kvserve-worker), which the TLS certificate's *.kvserve-worker covers."""
    s = one("StatefulSet", ROLE_WORKERS[role], rendered)
    c = container(s, "worker")
    variables = env(c)
    names = [e["name"] for e in c["env"]]
    assert variables["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert names.index("POD_IP") < names.index("KVSERVE_ADVERTISE_ADDRESS")
    assert variables["KVSERVE_ADVERTISE_ADDRESS"]["value"] == f"$(POD_IP):{ports(c)['grpc']}"
    assert ports(c)["grpc"] == WORKER_PORT and c["command"][c["command"].index("--port") + 1] == str(WORKER_PORT)
    assert variables["KVSERVE_WORKER_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    service = one("Service", s["spec"]["serviceName"], rendered)
    assert service["spec"]["clusterIP"] == "None"
    assert s in selected_workloads(service["spec"]["selector"], rendered)


def test_workers_reach_each_other_on_the_grpc_port_alone(rendered: list[dict]) -> None:
    """A decode worker pulls a request's pages from a prefill worker (ReadPages on its gRPC port); any worker may
    pull from another (a prefix in a busy worker's pool). The gateway still reaches both roles; nothing else
    does, and no worker reaches another's metrics port. The rest of the stack admits both roles as it admitted
    the base's workers."""
    gw, km, ks = "kvserve-gateway", "kvserve-kvmanager", "kvserve-kv-store"
    prefill, decode = ROLE_WORKERS["prefill"], ROLE_WORKERS["decode"]
    allowed = admitted(rendered)
    to_workers = {(src, dst, port) for src, dst, port in allowed if dst in (prefill, decode)}
    assert to_workers == {(src, dst, WORKER_PORT) for src in (gw, prefill, decode) for dst in (prefill, decode)}
    assert (prefill, decode, METRICS_PORT) not in allowed and (decode, prefill, METRICS_PORT) not in allowed
    for worker in (prefill, decode):
        assert {(worker, km, 50051), (worker, ks, 6379)} <= allowed
        assert (ANYONE, worker, WORKER_PORT) not in allowed


def test_the_role_variable_is_the_worker_role_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVSERVE_ROLE is the env default of `kvserve worker --role` (kvserve/services/cli_worker.py; KVSERVE_<FLAG>, as
    for every variable of the manifests), and setting it parses as the flag does: a name the worker did not read
    would leave every pod of role both."""
    assert ROLE_ENV == "KVSERVE_" + "--role".removeprefix("--").replace("-", "_").upper()
    assert ROLE_ENV in cli_env_names("worker")
    for name in [n for n in os.environ if n.startswith("KVSERVE_")]:
        monkeypatch.delenv(name)
    assert build_parser().parse_args(["worker"]).role == "both"
    for role in ROLES:
        by_flag = build_parser().parse_args(["worker", "--role", role]).role
        monkeypatch.setenv(ROLE_ENV, role)
        assert build_parser().parse_args(["worker"]).role == by_flag == role


def test_tls_listed_before_it_reaches_both_roles(tmp_path: Path) -> None:
    """As the Component says: after tls/, the role pods are copies of the TLS-wired worker pod."""
    rendered = kustomize_with_component(tmp_path, "tls", "disaggregated")
    for name in ROLE_WORKERS.values():
        s = one("StatefulSet", name, rendered)
        c = container(s, "worker")
        volumes = {v["name"]: v for v in s["spec"]["template"]["spec"]["volumes"]}
        secrets = {key for key, v in volumes.items() if v.get("secret", {}).get("secretName") == TLS_SECRET}
        (mount,) = [m for m in c["volumeMounts"] if m["name"] in secrets]
        for variable, key in TLS_ENV.items():
            assert env(c)[variable]["value"] == f"{mount['mountPath']}/{key}", (name, variable)
        assert c["readinessProbe"] == {"tcpSocket": {"port": WORKER_PORT}, "periodSeconds": 5}


def test_the_scale_commands_name_the_rendered_statefulsets(rendered: list[dict]) -> None:
    docs = (ROOT / "docs" / "deploy" / "kubernetes.md").read_text()
    component = (DISAGGREGATED_DIR / "kustomization.yaml").read_text()
    for name in ROLE_WORKERS.values():
        one("StatefulSet", name, rendered)
        assert f"kubectl scale statefulset/{name} --replicas=" in component
        assert f"kubectl scale statefulset/{name} --replicas=" in docs
