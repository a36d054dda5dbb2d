"""Generates the protobuf and gRPC Python modules from protos/kvserve/v1/*.proto.

    python -m kvserve.services.protogen [--out DIR]

Runs grpc_tools' bundled protoc with `-I<repo>/protos` (plus grpc_tools' own include folder for the
google/protobuf/*.proto files) and writes `*_pb2.py`, `*_pb2.pyi` and `*_pb2_grpc.py` into DIR/kvserve/v1/.
DIR defaults to the repository's protos/ folder, where the generated modules are committed; `make protos`
calls this, and tests/repo/test_protos.py regenerates into a temporary folder to check they are not stale.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

# kvserve/services/../../protos, found from this file so the command works from any working directory.
PROTOS_DIR = Path(__file__).resolve().parents[2] / "protos"
# The versioned proto package, as a folder under PROTOS_DIR.
PACKAGE_SUBDIR = Path("kvserve") / "v1"
# What protoc writes per .proto file.
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


class ProtocError(RuntimeError):
    """protoc exited non-zero; its own messages went to stderr."""


def proto_files(protos_dir: Path = PROTOS_DIR) -> list[Path]:
    """Returns every .proto of the versioned package, sorted, so generation order is stable."""
    return sorted((protos_dir / PACKAGE_SUBDIR).glob("*.proto"))


def is_generated(path: Path) -> bool:
    """Whether a file name is one protoc writes (as opposed to a .proto or a hand-written module)."""
    return path.name.endswith(GENERATED_SUFFIXES)


def _run_protoc(protos_dir: Path, out_args: list[str]) -> None:
    files = proto_files(protos_dir)
    if not files:
        raise ProtocError(f"no .proto files under {protos_dir / PACKAGE_SUBDIR}")
    include_dir = resources.files("grpc_tools") / "_proto"
    argv = ["grpc_tools.protoc", f"-I{protos_dir}", f"-I{include_dir}", *out_args, *map(str, files)]
    exit_code = protoc.main(argv)
    if exit_code != 0:
        names = ", ".join(path.name for path in files)
        raise ProtocError(f"protoc failed with exit code {exit_code} on {names} (its errors are above)")


def generate(out_dir: Path, protos_dir: Path = PROTOS_DIR) -> list[Path]:
    """Writes the generated modules into out_dir/kvserve/v1/ and returns their paths, sorted.

    Raises ProtocError when protoc rejects a .proto file.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    out = str(out_dir)
    _run_protoc(protos_dir, [f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}"])
    return sorted(path for path in (out_dir / PACKAGE_SUBDIR).iterdir() if is_generated(path))


def write_descriptor_set(path: Path, protos_dir: Path = PROTOS_DIR) -> Path:
    """Writes a FileDescriptorSet of every .proto, with source info (comments, locations) and imports.

    Raises ProtocError when protoc rejects a .proto file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    _run_protoc(protos_dir, ["--include_source_info", "--include_imports", f"--descriptor_set_out={path}"])
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvserve.services.protogen", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=PROTOS_DIR,
        help=f"output root; files land in OUT/{PACKAGE_SUBDIR} (default: {PROTOS_DIR})",
    )
    args = parser.parse_args(argv)
    try:
        written = generate(args.out)
    except ProtocError as error:
        print(f"protogen: {error}", file=sys.stderr)
        return 1
    print(f"protogen: wrote {len(written)} files into {args.out / PACKAGE_SUBDIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
