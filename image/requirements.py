"""Prints a pip requirements file that pins every wheel in a folder by version and sha256, for pip's
hash-checking mode (--require-hashes): the image installs exactly the wheelhouse it was given.
Usage: python image/requirements.py WHEEL_DIR > requirements.txt"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from packaging.utils import parse_wheel_filename


def pins(wheel_dir: Path) -> list[str]:
    lines = []
    for wheel in sorted(wheel_dir.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        lines.append(f"{name}=={version} --hash=sha256:{hashlib.sha256(wheel.read_bytes()).hexdigest()}")
    return lines


if __name__ == "__main__":
    print("\n".join(pins(Path(sys.argv[1]))))
