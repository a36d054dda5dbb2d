"""Every manifest `kubectl kustomize` renders from k8s/ (the base, and the base with each Component) validates
against the OpenAPI schema of a named Kubernetes version, strictly (an unknown or misspelt field is an error,
as `kubectl apply --validate=strict` makes it), with kubernetes-validate, which ships those schemas and
validates offline. The structural checks of test_k8s*.py stay: a schema knows fields and types, not whether a
Service selects a pod."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
from k8s_manifests import K8S_DIR, kubectl_kustomize, kustomize_with_component, load_docs

# The oldest Kubernetes the manifests are written for (README, "Kubernetes"; gRPC probes are GA since 1.27), and
# the newest whose schema kubernetes-validate ships, so that a field removed since is caught too.
KUBERNETES_VERSIONS = ("1.31.0", kubernetes_validate.latest_version())
COMPONENTS = ("autoscaling", "tls", "disaggregated")
# Kinds outside Kubernetes' own schema, each with why it is not validated here.
NOT_IN_THE_SCHEMA = {
    # cert-manager's CRDs (k8s/tls/certificate.yaml, an example applied by hand where cert-manager runs);
    # test_k8s_hardening.py checks what the example must say.
    ("cert-manager.io/v1", "Certificate"),
    ("cert-manager.io/v1", "Issuer"),
}


def _render(tmp_path: Path, component: str | None) -> list[dict]:
    return kubectl_kustomize(K8S_DIR) if component is None else kustomize_with_component(tmp_path, component)


def _validate(doc: dict, version: str) -> None:
    name = f"{doc['kind']}/{doc['metadata']['name']}"
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = "/".join(str(p) for p in e.path)
        pytest.fail(f"{name} is invalid for Kubernetes {version} at {path or '/'}: {e.message}")
    except kubernetes_validate.SchemaNotFoundError as e:
        pytest.fail(f"{name}: {e.message}")


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("component", (None, *COMPONENTS))
def test_rendered_manifests_validate_against_the_kubernetes_schema(tmp_path: Path, component: str | None,
                                                                   version: str) -> None:
    rendered = _render(tmp_path, component)
    assert rendered
    for doc in rendered:
        assert (doc["apiVersion"], doc["kind"]) not in NOT_IN_THE_SCHEMA, "rendered, so it must validate"
        _validate(doc, version)


def test_the_validator_catches_a_misspelt_field() -> None:
    """The check is strict: a field the schema does not know (a typo in a manifest) fails it."""
    (service,) = [d for d in load_docs(K8S_DIR / "gateway-service.yaml") if d["kind"] == "Service"]
    _validate(service, KUBERNETES_VERSIONS[0])
    service["spec"]["selectr"] = service["spec"].pop("selector")
    with pytest.raises(pytest.fail.Exception, match="selectr"):
        _validate(service, KUBERNETES_VERSIONS[0])


def test_only_cert_manager_example_is_left_to_its_own_checks() -> None:
    kinds = {(d["apiVersion"], d["kind"]) for d in load_docs(K8S_DIR / "tls" / "certificate.yaml")}
    assert kinds == NOT_IN_THE_SCHEMA
