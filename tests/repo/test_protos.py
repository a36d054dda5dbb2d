"""The protos: committed generated modules are fresh, every element is documented, the services import."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from kvserve.services import protogen

GENERATED_DIR = protogen.PROTOS_DIR / protogen.PACKAGE_SUBDIR
F = descriptor_pb2.FileDescriptorProto
M = descriptor_pb2.DescriptorProto
E = descriptor_pb2.EnumDescriptorProto
S = descriptor_pb2.ServiceDescriptorProto

# service -> (module, RPC names): the surface later issues build on.
SERVICES = {
    "WorkerService": ("worker", {"Step", "Info", "PullPages", "ReadPages"}),
    "KVManagerService": ("kvmanager", {"RegisterWorker", "StepPages", "Place", "JoinWorker", "Heartbeat",
                                       "LeaveWorker", "ListWorkers", "ReportTier"}),
    "KVAdminService": (
        "kvmanager",
        {
            "Stats",
            "ListTenants",
            "InspectTenant",
            "Probe",
            "EvictTenant",
            "Pin",
            "Unpin",
            "GetPageTable",
            "Reset",
            "ForgetWorker",
        },
    ),
    "GatewayService": ("gateway", {"Generate", "Complete"}),
}


def _generated_files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in folder.iterdir() if protogen.is_generated(path)}


def test_committed_generated_modules_are_fresh(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvserve.services.protogen", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    fresh = _generated_files(tmp_path / protogen.PACKAGE_SUBDIR)
    committed = _generated_files(GENERATED_DIR)
    assert len(fresh) == 3 * len(protogen.proto_files())

    stale = sorted(name for name in fresh.keys() & committed.keys() if fresh[name] != committed[name])
    missing = sorted(fresh.keys() - committed.keys())
    extra = sorted(committed.keys() - fresh.keys())
    assert not (stale or missing or extra), (
        f"generated modules in {GENERATED_DIR} are out of date; run `make protos`. "
        f"stale: {stale}, missing: {missing}, extra: {extra}"
    )


def test_protoc_failure_raises_with_a_clear_message(tmp_path: Path) -> None:
    protos_dir = tmp_path / "protos"
    (protos_dir / protogen.PACKAGE_SUBDIR).mkdir(parents=True)
    (protos_dir / protogen.PACKAGE_SUBDIR / "broken.proto").write_text('syntax = "proto3";\nmessage {\n')
    with pytest.raises(protogen.ProtocError, match=r"protoc failed with exit code \d+ on broken.proto"):
        protogen.generate(tmp_path / "out", protos_dir=protos_dir)


def _undocumented(file: F, comments: dict[tuple[int, ...], str]) -> list[str]:
    """Services, RPCs, messages, fields, oneofs, enums and enum values without a leading comment."""
    found: list[str] = []

    def check(path: tuple[int, ...], name: str) -> None:
        if not comments.get(path, "").strip():
            found.append(f"{file.name}: {name}")

    def walk_enum(enum: E, path: tuple[int, ...], prefix: str) -> None:
        check(path, f"enum {prefix}{enum.name}")
        for i, value in enumerate(enum.value):
            check((*path, E.VALUE_FIELD_NUMBER, i), f"enum value {prefix}{enum.name}.{value.name}")

    def walk_message(message: M, path: tuple[int, ...], prefix: str) -> None:
        if message.options.map_entry:  # synthetic, documented by its map field
            return
        name = f"{prefix}{message.name}"
        check(path, f"message {name}")
        for i, field in enumerate(message.field):
            check((*path, M.FIELD_FIELD_NUMBER, i), f"field {name}.{field.name}")
        for i, oneof in enumerate(message.oneof_decl):
            synthetic = all(
                f.proto3_optional for f in message.field if f.HasField("oneof_index") and f.oneof_index == i
            )
            if not synthetic:  # `optional` fields get a synthetic oneof with no source of its own
                check((*path, M.ONEOF_DECL_FIELD_NUMBER, i), f"oneof {name}.{oneof.name}")
        for i, nested in enumerate(message.nested_type):
            walk_message(nested, (*path, M.NESTED_TYPE_FIELD_NUMBER, i), f"{name}.")
        for i, enum in enumerate(message.enum_type):
            walk_enum(enum, (*path, M.ENUM_TYPE_FIELD_NUMBER, i), f"{name}.")

    for i, message in enumerate(file.message_type):
        walk_message(message, (F.MESSAGE_TYPE_FIELD_NUMBER, i), "")
    for i, enum in enumerate(file.enum_type):
        walk_enum(enum, (F.ENUM_TYPE_FIELD_NUMBER, i), "")
    for i, service in enumerate(file.service):
        check((F.SERVICE_FIELD_NUMBER, i), f"service {service.name}")
        for j, method in enumerate(service.method):
            check((F.SERVICE_FIELD_NUMBER, i, S.METHOD_FIELD_NUMBER, j), f"rpc {service.name}.{method.name}")
    return found


def test_every_rpc_message_and_field_has_a_leading_comment(tmp_path: Path) -> None:
    descriptor_set = descriptor_pb2.FileDescriptorSet()
    descriptor_set.ParseFromString(protogen.write_descriptor_set(tmp_path / "kvserve.pb").read_bytes())
    ours = [file for file in descriptor_set.file if file.package == "kvserve.v1"]
    assert sorted(Path(file.name).name for file in ours) == [path.name for path in protogen.proto_files()]

    undocumented: list[str] = []
    for file in ours:
        comments = {tuple(loc.path): loc.leading_comments for loc in file.source_code_info.location}
        undocumented += _undocumented(file, comments)
    assert not undocumented, "missing leading comments:\n" + "\n".join(undocumented)


def test_every_generated_module_imports() -> None:
    names = sorted(
        path.name.removesuffix(".py") for path in GENERATED_DIR.glob("*.py") if protogen.is_generated(path)
    )
    assert names, f"no generated modules in {GENERATED_DIR}"
    for name in names:
        module = importlib.import_module(f"kvserve.v1.{name}")
        if name.endswith("_pb2"):
            assert module.DESCRIPTOR.package == "kvserve.v1"


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_service_exists_with_its_rpcs(service: str) -> None:
    module_name, rpc_names = SERVICES[service]
    messages = importlib.import_module(f"kvserve.v1.{module_name}_pb2")
    stubs = importlib.import_module(f"kvserve.v1.{module_name}_pb2_grpc")
    assert hasattr(stubs, f"{service}Stub")
    assert hasattr(stubs, f"{service}Servicer")
    assert hasattr(stubs, f"add_{service}Servicer_to_server")
    methods = messages.DESCRIPTOR.services_by_name[service].methods_by_name
    assert set(methods) == rpc_names


def test_generate_streams_and_complete_is_unary() -> None:
    from kvserve.v1 import gateway_pb2

    methods = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].methods_by_name
    assert methods["Generate"].server_streaming and not methods["Generate"].client_streaming
    assert not methods["Complete"].server_streaming


def test_gateway_request_has_no_tenant_field() -> None:
    from kvserve.v1 import gateway_pb2

    fields = gateway_pb2.GenerateRequest.DESCRIPTOR.fields_by_name
    assert not [name for name in fields if "tenant" in name or "namespace" in name]
