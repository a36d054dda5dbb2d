"""The two Containerfiles stay in step (the CUDA worker's image cannot be built on these machines, so this is what
checks it), and image/requirements.py pins a wheelhouse for pip's hash-checking mode. `make image-test`
(tests/deploy/image/) builds and runs the CPU image itself."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CPU, CUDA = ROOT / "Containerfile", ROOT / "Containerfile.cuda"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined and comments left out."""
    logical, current = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        current += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            logical.append(current.strip())
            current = ""
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1]) for text in logical]


def env_of(path: Path) -> dict[str, str]:
    found = {}
    for kind, args in instructions(path):
        if kind == "ENV":
            found |= dict(re.findall(r"(\w+)=(\S+)", args))
    return found


def after_env(path: Path) -> list[tuple[str, str]]:
    """The layers after the system's: what both images must share, the CPU kernels' build aside."""
    steps = instructions(path)
    first = max(i for i, (kind, _) in enumerate(steps) if kind == "ENV") + 1
    return [step for step in steps[first:] if "cpu_paged" not in step[1]]


def test_both_images_install_the_same_layers_as_the_same_user_and_entrypoint():
    assert after_env(CUDA) == after_env(CPU)
    kinds = [kind for kind, _ in after_env(CPU)]
    assert kinds[-3:] == ["WORKDIR", "ENTRYPOINT", "CMD"] and "USER" in kinds


def test_the_cuda_image_has_the_cpu_images_environment_and_the_nvidia_toolkits():
    cpu, cuda = env_of(CPU), env_of(CUDA)
    assert {key: cuda.get(key) for key in cpu} == cpu
    assert set(cuda) - set(cpu) == {"NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES"}


def test_dependencies_are_installed_hash_checked_from_a_bind_mount_before_kvserve_and_the_model():
    steps = instructions(CPU)
    deps = next(i for i, (kind, args) in enumerate(steps) if kind == "RUN" and "--require-hashes" in args)
    assert steps[deps][1].startswith("--mount=type=bind,source=wheels,")  # the wheels leave no layer
    assert steps[deps - 1] == ("COPY", "requirements.txt /opt/kvserve/requirements.txt")  # the layer's cache key
    later = [args for _, args in steps[deps + 1:]]
    assert any(a.startswith("model ") for a in later) and any("kvserve-*.whl" in a for a in later)


def test_requirements_pins_every_wheel_by_version_and_sha256(tmp_path):
    wheels = {"torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl": b"torch bytes",
              "Redis_Py-8.1.0-py3-none-any.whl": b"redis bytes"}
    for name, data in wheels.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "notes.txt").write_text("not a wheel")
    out = subprocess.run([sys.executable, str(ROOT / "image" / "requirements.py"), str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == [f"redis-py==8.1.0 --hash=sha256:{hashlib.sha256(b'redis bytes').hexdigest()}",
                   f"torch==2.13.0+cpu --hash=sha256:{hashlib.sha256(b'torch bytes').hexdigest()}"]
