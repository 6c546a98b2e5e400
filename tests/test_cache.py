"""The on-disk kernel cache: loaded only from folders and entries no other user can write, read by
every user of a shared folder, and healed when an entry is damaged.  NVRTC is replaced by a fake
compiler that counts its calls, so these run anywhere in milliseconds."""

import hashlib
import json
import os
import stat
import warnings

import pytest

from cupyloss._core import source as _source

NAME = "cupyloss::scale_by_grad_output<float, 4>"


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """(shared folder, private folder, list of compiles): CUPYLOSS_CACHE_DIR and the private
    folder under tmp_path, and a compiler that returns a fresh binary on each call."""
    shared, private = tmp_path / "shared", tmp_path / "private"
    private.mkdir(mode=0o700)
    monkeypatch.setenv("CUPYLOSS_CACHE_DIR", str(shared))
    monkeypatch.setattr(_source, "private_dir", lambda: private)
    monkeypatch.setattr(_source, "_nvrtc_options", lambda gpu="": ("--std=c++17",))
    monkeypatch.setattr(_source, "nvrtc_build", lambda: "13.0 test")
    compiles = []

    def compile_(code, options, arch, names):
        compiles.append(arch)
        return b"\x7fELF" + os.urandom(64), {n: "_Z" + str(len(compiles)) for n in names}

    monkeypatch.setattr(_source, "_nvrtc", compile_)
    monkeypatch.setattr(_source, "_WARNED", set())
    return shared, private, compiles


def _plant(folder, key, binary=b"\x7fELFplanted"):
    """A whole, self-consistent entry written by someone else."""
    folder.mkdir(exist_ok=True)
    (folder / f"{key}.cubin").write_bytes(binary)
    (folder / f"{key}.json").write_text(json.dumps(
        {"names": {NAME: "_Zplanted"}, "sha256": hashlib.sha256(binary).hexdigest()}))


def _key(arch="90"):
    return _source._key("scale.cu", [NAME], arch, "")[0]


def test_a_folder_others_can_write_is_never_loaded_from(cache):
    """A cache folder of mode 0777 holding a planted entry (another local user's code) is passed
    over with a warning: the kernel is compiled and kept in the user's own folder."""
    shared, private, compiles = cache
    _plant(shared, _key())
    os.chmod(shared, 0o777)
    with pytest.warns(_source.CacheWarning, match="no one else can write"):
        path, binary, mangled = _source.load("scale.cu", [NAME], "90")
    assert path.parent == private and mangled[NAME] != "_Zplanted" and compiles == ["90"]
    assert not binary.startswith(b"\x7fELFplanted")


def test_a_folder_owned_by_another_user_is_never_loaded_from(cache):
    shared, private, compiles = cache
    _plant(shared, _key())
    try:
        os.chown(shared, 54321, 54321)
    except PermissionError:
        pytest.skip("only root can give a folder to another user here")
    if os.getuid() == 54321:
        pytest.skip("this test's other user is the one running it")
    with pytest.warns(_source.CacheWarning, match="owned by you or root"):
        path, _, mangled = _source.load("scale.cu", [NAME], "90")
    assert path.parent == private and mangled[NAME] != "_Zplanted"


@pytest.mark.parametrize("mode", [0o666, 0o646, 0o664])
def test_an_entry_others_can_write_is_compiled_again(cache, mode):
    shared, _, compiles = cache
    shared.mkdir(mode=0o755)
    _plant(shared, _key())
    os.chmod(shared / f"{_key()}.cubin", mode)
    path, _, mangled = _source.load("scale.cu", [NAME], "90")
    assert mangled[NAME] != "_Zplanted" and compiles == ["90"]
    assert path.parent == shared          # rewritten in place, closed to others this time
    assert not os.stat(path).st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def test_a_linked_entry_is_not_followed(cache, tmp_path):
    shared, _, compiles = cache
    shared.mkdir(mode=0o755)
    _plant(tmp_path / "elsewhere", _key())
    for suffix in (".cubin", ".json"):
        os.symlink(tmp_path / "elsewhere" / f"{_key()}{suffix}", shared / f"{_key()}{suffix}")
    _, _, mangled = _source.load("scale.cu", [NAME], "90")
    assert mangled[NAME] != "_Zplanted" and compiles == ["90"]


def test_entries_are_written_readable_by_everyone_the_umask_allows(cache):
    """A cache one user fills (an image built as root) must be readable by the others: the
    umask's mode, never group or world write."""
    shared, _, _ = cache
    old = os.umask(0o022)
    try:
        path = _source.cached("scale.cu", [NAME], "90")
    finally:
        os.umask(old)
    for p in (path, path.with_suffix(".json")):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o644
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o755
    old = os.umask(0o002)        # a group-sharing umask still gives no group write
    try:
        path = _source.cached("scale.cu", ["cupyloss::scale_by_grad_output<float, 1>"], "90")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644


def test_an_unreadable_entry_is_a_miss(cache, monkeypatch):
    shared, private, compiles = cache
    first = _source.cached("scale.cu", [NAME], "90")
    assert compiles == ["90"]
    real = type(first).read_bytes

    def read_bytes(self):
        if self.parent == shared:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(type(first), "read_bytes", read_bytes)
    _, binary, _ = _source.load("scale.cu", [NAME], "90")
    assert compiles == ["90", "90"] and binary.startswith(b"\x7fELF")


@pytest.mark.parametrize("damage", ["empty cubin", "truncated cubin", "empty json",
                                    "json without hash", "garbage json", "other cubin"])
def test_a_damaged_entry_heals(cache, damage):
    """A zero-byte or truncated file (power loss, a full disk, a half-restored CI cache) fails
    its hash: the kernel is compiled again and the entry rewritten whole."""
    shared, _, compiles = cache
    path = _source.cached("scale.cu", [NAME], "90")
    meta = path.with_suffix(".json")
    good = path.read_bytes()
    if damage == "empty cubin":
        path.write_bytes(b"")
    elif damage == "truncated cubin":
        path.write_bytes(good[:10])
    elif damage == "empty json":
        meta.write_bytes(b"")
    elif damage == "json without hash":
        meta.write_text(json.dumps({"names": {NAME: "_Z1"}}))
    elif damage == "garbage json":
        meta.write_bytes(b"{\"names\": {")
    else:
        path.write_bytes(b"\x7fELF" + os.urandom(64))
    _, binary, _ = _source.load("scale.cu", [NAME], "90")
    assert compiles == ["90", "90"]
    record = json.loads(meta.read_text())
    assert record["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert path.read_bytes() == binary
    _source.load("scale.cu", [NAME], "90")
    assert compiles == ["90", "90"]           # healed: a hit again


def test_a_failed_write_leaves_no_temporary_file(cache, monkeypatch):
    shared, private, _ = cache

    def replace(src, dst):
        raise OSError(28, "No space left on device", str(dst))

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="No space"):
        _source.load("scale.cu", [NAME], "90")
    for folder in (shared, private):
        assert [p.name for p in folder.iterdir()] == [] if folder.exists() else True


def test_the_key_holds_the_nvrtc_build(cache, monkeypatch):
    before = _key()
    monkeypatch.setattr(_source, "nvrtc_build", lambda: "13.0 another build")
    assert _key() != before


def test_the_private_folder_is_the_users_own(monkeypatch, tmp_path):
    """Under the user's cache home; where that is open to others, a fresh mkdtemp folder (never
    a predictable name under the temporary directory)."""
    monkeypatch.setattr(_source, "_PRIVATE", [])
    monkeypatch.setattr(_source, "_WARNED", set())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    folder = _source.private_dir()
    assert folder == tmp_path / "home" / "cupyloss"
    assert stat.S_IMODE(os.stat(folder).st_mode) & 0o077 == 0
    monkeypatch.setattr(_source, "_PRIVATE", [])
    os.chmod(folder, 0o777)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", _source.CacheWarning)
        other = _source.private_dir()
    assert other != folder and other.name.startswith("cupyloss-")
    assert stat.S_IMODE(os.stat(other).st_mode) == 0o700 and os.stat(other).st_uid == os.getuid()
