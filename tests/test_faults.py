"""Operating-system faults end in one line and leave nothing behind; an overwrite or a crash never loses the output.

Real faults where this machine allows them (a full tmpfs and a read-only remount inside a user and
mount namespace, a chmod-555 directory for a process without root's privileges), and OSErrors
injected at the lowest level (os.write, os.copy_file_range, tempfile.mkdtemp, os.rename, os.open).
"""

from __future__ import annotations

import errno
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import tree_digest
from safetensors import SafetensorError
from tiny import FAMILIES, build
from typer.testing import CliRunner

import posextend
from posextend import DestinationError, SourceError
from posextend.files import atomic, copying
from posextend.files.oserrors import output_errors
from posextend.cli import app

NEW = 64
CLI = [sys.executable, "-m", "posextend.cli", "resize-model"]


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return build(FAMILIES["gpt2"], tmp_path_factory.mktemp("faults") / "src")


def _left(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def _run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=120, check=False, **kwargs)


def _n_positions(path: Path) -> int:
    return json.loads((path / "config.json").read_text())["n_positions"]


# ------------------------------------------------------------------ real faults, through the CLI


@functools.cache
def _namespace_missing() -> str | None:
    """Why a tmpfs cannot be mounted (and remounted read-only) in a user and mount namespace here; None if it can."""
    if not shutil.which("unshare"):
        return "unshare (util-linux) is not installed"
    with tempfile.TemporaryDirectory() as d:
        r = _run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                  'mount -t tmpfs -o size=1m tmpfs "$1" && mount -o remount,ro "$1"', "sh", d])
    return None if r.returncode == 0 else f"no tmpfs in a user+mount namespace here: {r.stderr.strip()}"


def _in_namespace(script: str, *args) -> subprocess.CompletedProcess:
    """``script`` (sh; $1... are ``args``) as root of a new user and mount namespace: its mounts end with it."""
    if reason := _namespace_missing():
        pytest.skip(reason)
    return _run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh", *args])


@functools.cache
def _unprivileged() -> tuple[str, ...] | str:
    """A command prefix that runs this interpreter without root's privileges, or why there is none.

    uid 65534 where that user can run this interpreter; otherwise (an interpreter under a private
    home, /root mode 700) root with every capability dropped: without CAP_DAC_OVERRIDE a mode-555
    directory refuses root as it refuses its owner.
    """
    if os.geteuid() != 0:
        return ()  # already unprivileged
    if not shutil.which("setpriv"):
        return "setpriv (util-linux) is not installed"
    for prefix in (("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"),
                   ("setpriv", "--bounding-set=-all", "--inh-caps=-all")):
        if _run([*prefix, sys.executable, "-c", "import posextend.cli"], cwd="/").returncode == 0:
            return prefix
    return "setpriv cannot run this interpreter without privileges"


@pytest.mark.parametrize("full, message", [
    ("size=1m", "needs 6.5 MiB, but its file system has only 1.0 MiB free"),  # known before writing: refused at once
    ("size=64m,nr_inodes=5", "no space left"),  # the bytes are free, the inodes run out while writing
])
def test_full_disk_is_one_line_and_leaves_nothing(src, tmp_path, full, message):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = _in_namespace(f'mount -t tmpfs -o {full} tmpfs "$1" || exit 99; "$2" -m posextend.cli resize-model "$3" "$1/out" '
                      '-n 64; echo "exit $?"; ls -A "$1"', mnt, sys.executable, src)
    assert r.stdout.split() == ["exit", "1"], (r.stdout, r.stderr)  # nothing listed on the tmpfs: no DST, no temp
    line = _one_line(r.stderr)
    assert line.startswith("Error:") and message in line and f"{mnt}/out" in line


def test_read_only_destination_is_one_line_and_leaves_nothing(src, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = _in_namespace('mount -t tmpfs tmpfs "$1" && mkdir "$1/models" && mount -o remount,ro "$1" || exit 99; '
                      '"$2" -m posextend.cli resize-model "$3" "$1/models/new/out" -n 64; echo "exit $?"; ls -A "$1/models"',
                      mnt, sys.executable, src)
    assert r.stdout.split() == ["exit", "1"], (r.stdout, r.stderr)
    line = _one_line(r.stderr)
    assert "read-only" in line and f"{mnt}/models/new/out" in line and "Choose another directory" in line


def test_permission_denied_is_one_line_and_leaves_nothing(src):
    prefix = _unprivileged()
    if isinstance(prefix, str):
        pytest.skip(prefix)
    root = Path(tempfile.mkdtemp(prefix="posextend-faults-"))  # pytest's tmp_path is mode 700: other users cannot enter
    locked = root / "locked"
    try:
        root.chmod(0o755)
        shutil.copytree(src, root / "src")
        for f in (root / "src").iterdir():
            f.chmod(0o644)
        locked.mkdir(mode=0o555)
        r = _run([*prefix, *CLI, root / "src", locked / "out", "-n", "64"], cwd="/", env={**os.environ, "HOME": str(root)})
        assert r.returncode == 1, r.stderr
        line = _one_line(r.stderr)
        assert "permission denied" in line and str(locked / "out") in line and "Check its permissions" in line
        assert _left(locked) == []
    finally:
        locked.chmod(0o755)
        shutil.rmtree(root)


# ------------------------------------------------------------- injected faults, in the library

WRITE_FAULTS = [(errno.ENOSPC, "no space left"), (errno.EDQUOT, "quota exceeded"), (errno.EFBIG, "too large"),
                (errno.EROFS, "read-only")]


def _raiser(code: int, filename: str | None = None):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code), *([filename] if filename else []))
    return fail


def _check_destination_error(message: str, dst: Path, words: str) -> None:
    assert str(dst) in message and words in message, message
    assert "--" not in message  # library messages never name CLI flags


@pytest.mark.parametrize("code, words", WRITE_FAULTS, ids=lambda v: errno.errorcode.get(v, v))
@pytest.mark.parametrize("where", ["copy_file_range", "write"])
def test_write_faults_name_the_destination_and_leave_nothing(src, tmp_path, monkeypatch, where, code, words):
    if where == "write":  # no kernel copy across these files (EXDEV): the plain copy's write fails
        monkeypatch.setattr(os, "copy_file_range", _raiser(errno.EXDEV))
    monkeypatch.setattr(os, where, _raiser(code))
    dst = tmp_path / "out"
    with pytest.raises(DestinationError) as info:
        posextend.resize_checkpoint(src, dst, NEW)
    _check_destination_error(str(info.value), dst, words)
    assert isinstance(info.value.__cause__, OSError)  # --debug still shows the system's error
    assert _left(tmp_path) == []


@pytest.mark.parametrize("refusal", [errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, None],
                         ids=lambda v: errno.errorcode.get(v, "no copy_file_range"))
def test_a_refused_kernel_copy_writes_the_same_bytes_in_small_buffers(src, tmp_path, monkeypatch, refusal):
    """Where a file system refuses copy_file_range (or the platform lacks it), the plain copy writes the same
    files, reading at most BUFFER bytes at a time."""
    posextend.resize_checkpoint(src, tmp_path / "kernel", NEW, seed=0)
    asked, reads, real_pread = [], [], os.pread
    if refusal is None:
        monkeypatch.delattr(os, "copy_file_range")
    else:
        monkeypatch.setattr(os, "copy_file_range", lambda *args: asked.append(args) or _raiser(refusal)())
    monkeypatch.setattr(copying, "BUFFER", 4096)
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: reads.append(n) or real_pread(fd, n, offset))
    posextend.resize_checkpoint(src, tmp_path / "plain", NEW, seed=0)
    assert tree_digest(tmp_path / "plain") == tree_digest(tmp_path / "kernel")
    assert max(reads) == 4096 and len(reads) > 1
    assert bool(asked) == (refusal is not None)


@pytest.mark.parametrize("code, words", [(errno.EROFS, "read-only"), (errno.EACCES, "permission denied"),
                                         (errno.EPERM, "permission denied"), (errno.ENOSPC, "no space left")],
                         ids=lambda v: errno.errorcode.get(v, v))
def test_temp_dir_faults_leave_not_even_the_parents_made(src, tmp_path, monkeypatch, code, words):
    def mkdtemp(suffix=None, prefix=None, dir=None):
        raise OSError(code, os.strerror(code), os.path.join(dir, f"{prefix}abcd1234"))

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    dst = tmp_path / "made" / "for" / "out"
    with pytest.raises(DestinationError) as info:
        posextend.resize_checkpoint(src, dst, NEW)
    _check_destination_error(str(info.value), dst, words)
    assert _left(tmp_path) == []  # made/for/ were created for the output and removed again


def test_final_rename_fault_leaves_nothing(src, tmp_path, monkeypatch):
    dst = tmp_path / "out"
    monkeypatch.setattr(atomic, "_libc_renameat2", lambda: None)  # the plain rename
    real_rename = os.rename

    def rename(a, b, *args, **kwargs):
        if Path(b) == dst:
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(a), None, str(b))
        return real_rename(a, b, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(DestinationError, match="permission denied") as info:
        posextend.resize_checkpoint(src, dst, NEW)
    assert str(dst) in str(info.value)
    assert _left(tmp_path) == []


def _one_shard_per_tensor(src: Path, out: Path) -> list[Path]:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out, ignore=shutil.ignore_patterns("model.safetensors"))
    state = load_file(src / "model.safetensors")
    names = [f"model-{i:05d}-of-{len(state):05d}.safetensors" for i in range(1, len(state) + 1)]
    for name, (key, tensor) in zip(names, sorted(state.items())):
        save_file({key: tensor}, out / name, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {key: name for name, key in zip(names, sorted(state))}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return [out / name for name in names]


def test_source_shards_deleted_mid_read_are_a_source_error(src, tmp_path):
    """Real deletion: once the first bytes are written, every shard not yet opened is gone."""
    shards = _one_shard_per_tensor(src, tmp_path / "src")
    assert len(shards) > 6  # more than the copying threads (4) and the rewrite can have open at once

    def progress(done, total):
        for shard in shards:
            shard.unlink(missing_ok=True)

    dst = tmp_path / "out"
    with pytest.raises(SourceError, match=r"model-\d+-of-\d+\.safetensors disappeared while it was being read") as info:
        posextend.resize_checkpoint(tmp_path / "src", dst, NEW, progress=progress)
    assert "the source changed while reading" in str(info.value) and "Re-run" in str(info.value)
    assert _left(tmp_path) == ["src"]


def test_unreadable_source_shard_is_a_source_error(src, tmp_path, monkeypatch):
    weights = src / "model.safetensors"
    real_open = os.open

    def os_open(path, *args, **kwargs):
        if Path(path) == weights:
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", os_open)
    with pytest.raises(SourceError, match="permission denied") as info:
        posextend.resize_checkpoint(src, tmp_path / "out", NEW)
    assert str(weights) in str(info.value)
    assert _left(tmp_path) == []


def test_output_errors_tell_the_sides_apart(tmp_path):
    dst = tmp_path / "out"
    with pytest.raises(SourceError, match="elsewhere.json disappeared"), output_errors(dst):
        (tmp_path / "elsewhere.json").read_text()
    with pytest.raises(DestinationError, match="Input/output error"), output_errors(dst):  # a file of the output
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(tmp_path / ".out.posextend-1-abcd1234" / "x"))
    with pytest.raises(DestinationError, match="no space left"), output_errors(dst):  # shutil names the source
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "src" / "tokenizer.json"))
    with pytest.raises(DestinationError, match="no space left"), output_errors(dst):  # Rust libraries' I/O errors
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    with pytest.raises(ValueError, match="not an OS error"), output_errors(dst):  # anything else passes through
        raise ValueError("not an OS error")


def test_write_file_is_whole_or_nothing(tmp_path, monkeypatch):
    path = atomic.write_file(tmp_path / "reports" / "eval.json", "{}\n")
    assert path.read_text() == "{}\n" and _left(path.parent) == ["eval.json"]
    reference = tmp_path / "reference"
    reference.write_text("")
    assert path.stat().st_mode == reference.stat().st_mode  # the usual mode, not a temporary file's 0600
    monkeypatch.setattr(os, "fsync", _raiser(errno.EDQUOT))
    with pytest.raises(DestinationError, match="quota exceeded") as info:
        atomic.write_file(tmp_path / "reports" / "other.json", "{}")
    assert str(tmp_path / "reports" / "other.json") in str(info.value)
    assert _left(path.parent) == ["eval.json"]


def test_cli_turns_a_stray_os_error_into_one_line(monkeypatch, tmp_path):
    import posextend.resize.on_disk

    monkeypatch.setattr(posextend.resize.on_disk, "resize_checkpoint", _raiser(errno.EIO, "/data/model.safetensors"))
    args = ["resize-model", str(tmp_path / "src"), str(tmp_path / "out"), "-n", "64"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 1
    assert _one_line(r.stderr) == "Error: /data/model.safetensors: Input/output error"
    r = CliRunner().invoke(app, ["--debug", *args])
    assert isinstance(r.exception, OSError)  # --debug: the traceback


# ---------------------------------------------------------------------- overwrite and durability


@functools.cache
def _exchange_missing(where: str) -> str | None:
    """Why renameat2(RENAME_EXCHANGE) does not work in ``where``; None if it does."""
    if atomic._libc_renameat2() is None:
        return "no renameat2 in this libc"
    with tempfile.TemporaryDirectory(dir=where) as d:
        (Path(d) / "a").mkdir()
        (Path(d) / "b").mkdir()
        if not atomic._renameat2(Path(d) / "a", Path(d) / "b", atomic._RENAME_EXCHANGE):
            return "this file system cannot exchange names (RENAME_EXCHANGE)"
    return None


def test_overwrite_swaps_without_dst_ever_missing(src, tmp_path, monkeypatch):
    if reason := _exchange_missing(str(tmp_path.parent)):
        pytest.skip(reason)
    dst = tmp_path / "out"
    posextend.resize_checkpoint(src, dst, 50)
    events = []
    real_renameat2, real_rename = atomic._renameat2, os.rename

    def renameat2(a, b, flags):
        events.append(("renameat2", flags, _n_positions(dst)))  # dst whole right before ...
        done = real_renameat2(a, b, flags)
        events.append(("done", done, _n_positions(dst)))  # ... and right after
        return done

    def rename(*args, **kwargs):
        events.append(("rename", *args))
        return real_rename(*args, **kwargs)

    monkeypatch.setattr(atomic, "_renameat2", renameat2)
    monkeypatch.setattr(os, "rename", rename)
    posextend.resize_checkpoint(src, dst, NEW, overwrite=True)
    assert events == [("renameat2", atomic._RENAME_EXCHANGE, 50), ("done", True, NEW)]  # one exchange, no plain rename
    assert _left(tmp_path) == ["out"]


def _fake_renameat2(code: int):
    import ctypes

    def renameat2(*args):
        ctypes.set_errno(code)
        return -1
    return renameat2


@pytest.mark.parametrize("libc", ["without renameat2", "EINVAL", "ENOSYS"])
def test_overwrite_falls_back_to_two_renames(src, tmp_path, monkeypatch, libc):
    fake = None if libc.startswith("without") else _fake_renameat2(getattr(errno, libc))
    monkeypatch.setattr(atomic, "_libc_renameat2", lambda: fake)
    dst = tmp_path / "out"
    posextend.resize_checkpoint(src, dst, 50)
    renames, real_rename = [], os.rename

    def rename(a, b, *args, **kwargs):
        renames.append((Path(a).relative_to(tmp_path).parts, Path(b).relative_to(tmp_path).parts))
        return real_rename(a, b, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    posextend.resize_checkpoint(src, dst, NEW, overwrite=True)
    (old, parked), (new, final) = renames
    assert old == ("out",) and parked[0].startswith(".out.posextend-old-") and parked[1] == "old"
    assert new[0].startswith(".out.posextend-") and final == ("out",)
    assert _n_positions(dst) == NEW and _left(tmp_path) == ["out"]


def test_failed_second_rename_puts_the_old_output_back(src, tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "_libc_renameat2", lambda: None)
    dst = tmp_path / "out"
    posextend.resize_checkpoint(src, dst, 50)
    before = tree_digest(dst)
    real_rename = os.rename

    def rename(a, b, *args, **kwargs):
        if Path(b) == dst and Path(a).name.startswith(".out.posextend-") and "-old-" not in str(a):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(a), None, str(b))
        return real_rename(a, b, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(DestinationError, match="Input/output error"):
        posextend.resize_checkpoint(src, dst, NEW, overwrite=True)
    assert tree_digest(dst) == before and _left(tmp_path) == ["out"]


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def _crash_between_renames(dst: Path) -> Path:
    """What a power cut between the fallback's two renames leaves: the old output parked, no ``dst``, a whole temp."""
    pid = _dead_pid()
    holder = dst.parent / f".{dst.name}.posextend-old-{pid}-abcd1234"
    holder.mkdir()
    os.rename(dst, holder / "old")
    new = dst.parent / f".{dst.name}.posextend-{pid}-efgh5678"
    new.mkdir()
    (new / "config.json").write_text("{}")
    return holder


def test_crash_between_fallback_renames_is_recovered(src, tmp_path, monkeypatch):
    dst = tmp_path / "out"
    posextend.resize_checkpoint(src, dst, 50)
    before = tree_digest(dst)
    holder = _crash_between_renames(dst)
    # A next run that cannot put the old output back (here: the rename fails) never deletes it.
    monkeypatch.setattr(os, "rename", _raiser(errno.EACCES, str(holder / "old")))
    with pytest.raises(DestinationError):
        posextend.resize_checkpoint(src, dst, NEW)
    assert tree_digest(holder / "old") == before
    monkeypatch.undo()
    # The next run puts it back, and without overwrite=True keeps it.
    with pytest.raises(DestinationError, match="put back from an earlier overwrite that was interrupted"):
        posextend.resize_checkpoint(src, dst, NEW)
    assert tree_digest(dst) == before and _left(tmp_path) == ["out"]
    # With overwrite=True: put back, then replaced.
    _crash_between_renames(dst)
    posextend.resize_checkpoint(src, dst, NEW, overwrite=True)
    assert _n_positions(dst) == NEW and _left(tmp_path) == ["out"]


def test_stale_holders_go_only_when_dst_is_there_and_their_writer_is_dead(src, tmp_path):
    dst = tmp_path / "out"
    posextend.resize_checkpoint(src, dst, 50)
    before = tree_digest(dst)
    finished = tmp_path / f".out.posextend-old-{_dead_pid()}-abcd1234"  # died after the second rename
    shutil.copytree(dst, finished / "old")
    running = tmp_path / f".out.posextend-old-{os.getpid()}-efgh5678"  # a live writer's
    shutil.copytree(dst, running / "old")
    assert atomic._remove_stale_temps(dst) is False
    assert _left(tmp_path) == [running.name, "out"] and tree_digest(dst) == before


def _fsynced(monkeypatch) -> list[tuple[str, str]]:
    """Record fsyncs (the path synced) and renames, in order."""
    events = []
    real_fsync, real_renameat2, real_rename = os.fsync, atomic._renameat2, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def renameat2(a, b, flags):
        events.append(("rename", str(b)))
        return real_renameat2(a, b, flags)

    def rename(a, b, *args, **kwargs):
        events.append(("rename", str(b)))
        return real_rename(a, b, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(atomic, "_renameat2", renameat2)
    monkeypatch.setattr(os, "rename", rename)
    return events


def test_every_file_and_directory_is_fsynced_before_the_rename(tmp_path, monkeypatch):
    events = _fsynced(monkeypatch)
    dst = tmp_path / "out"
    with atomic.atomic_output(dst) as tmp:
        (tmp / "config.json").write_text("{}")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "weights.bin").write_bytes(b"x" * 4096)
    assert events[-2] == ("rename", str(dst))
    before = {str(Path(path).relative_to(tmp)) for _, path in events[:-2]}
    assert before == {".", "config.json", "sub", "sub/weights.bin"}
    assert events[-1] == ("fsync", str(tmp_path))  # the parent, after the rename


def test_resize_fsyncs_every_written_file(src, tmp_path, monkeypatch):
    events = _fsynced(monkeypatch)
    dst = tmp_path / "out"
    posextend.resize_checkpoint(src, dst, NEW)
    cut = events.index(("rename", str(dst)))
    tmp = Path(events[cut - 1][1])  # the temporary directory itself, synced last
    synced = {str(Path(path).relative_to(tmp)) for _, path in events[:cut]}
    assert synced == {".", *(str(p.relative_to(dst)) for p in dst.rglob("*"))}
    assert events[cut + 1:] == [("fsync", str(tmp_path))]
