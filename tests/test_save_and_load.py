"""dk.save is torch.save made atomic and nothing more; dk.load reads back what it wrote onto
the device asked for and never hangs. Running a pickle's code is advised only as the way to
save and load a whole object on purpose (weights_only=False), for a file one trusts: never
for a file that is no checkpoint or calls what runs commands."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import errno
import io
import json
import os
import pickle
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import textwrap
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import devicekit as dk
from devicekit._core import _tree
from devicekit._files import _atomic, _checkpoint, _weights_only

from .helpers import META, own_safe_globals  # noqa: F401 - a fixture, used by name

ROOT = Path(__file__).resolve().parent.parent
NOT_A_CHECKPOINT = "Expected a file written by torch.save, but "
AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="needs root, as in most ML containers")
UNNAMED = getattr(os, "O_TMPFILE", 0)  # Linux's unnamed temporary files
NOBODY = 65534  # a user with a name (nobody) on most systems
NAMELESS = 12345  # a user with no name here


def _unnamed(flags: int) -> bool:
    return bool(UNNAMED) and flags & UNNAMED == UNNAMED


def _unnamed_files_work(folder: Path) -> bool:
    try:
        os.close(os.open(folder, UNNAMED | os.O_WRONLY, 0o600))
    except (OSError, ValueError):
        return False
    return UNNAMED != 0 and Path("/proc/self/fd").is_dir()


@pytest.fixture
def shared_folder() -> Iterator[Path]:
    """A folder other users can reach: pytest's tmp_path is root's alone (mode 0700)."""
    folder = Path(tempfile.mkdtemp(prefix="devicekit-test-"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder)


def _as_user(uid: int, action: Callable[[], object]) -> str:
    """How ``action`` ends in a child forked as user ``uid``: "ok", or "Error: message".

    Forked, not started anew: the child has devicekit loaded and needs to read no file
    of the checkout as that user. Run under the watchdog: a child that hangs is killed.
    """
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: it never returns into pytest
        outcome = "ok"
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            action()
        except BaseException as err:  # everything is reported to the parent
            outcome = f"{type(err).__name__}: {err}"
        finally:
            data = outcome.encode()
            while data:
                data = data[os.write(write, data) :]
            os._exit(0)
    os.close(write)
    try:
        with os.fdopen(read, "rb") as pipe:
            return pipe.read().decode()
    finally:
        if os.waitpid(pid, os.WNOHANG) == (0, 0):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def _no_advice_to_run_code(message: str) -> None:
    assert "weights_only=False" not in message
    assert "weights_only` set to `False" not in message
    assert "\x1b" not in message  # no terminal escape codes


# Saving to a path.


def test_a_save_loads_back_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    dk.save({"weight": torch.arange(3.0), "step": 4}, path)
    loaded = dk.load(path, "cpu")
    assert torch.equal(loaded["weight"], torch.arange(3.0))
    assert loaded["step"] == 4
    dk.save({"weight": torch.zeros(1)}, str(path))  # over the last one, by a str path
    assert torch.equal(dk.load(path, "cpu", mmap=True)["weight"], torch.zeros(1))
    assert os.listdir(tmp_path) == ["model.pt"]


@pytest.mark.parametrize(
    "failure",
    [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()],
    ids=["disk-full", "ctrl-c"],
)
def test_a_save_that_dies_half_way_keeps_the_last_good_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: BaseException
) -> None:
    path = tmp_path / "model.pt"
    dk.save({"epoch": 1}, path)

    def dies_half_way(obj: Any, f: Any, **options: Any) -> None:
        f.write(b"PK\x03\x04 half a checkpoint")
        raise failure

    monkeypatch.setattr(_checkpoint.torch, "save", dies_half_way)
    with pytest.raises(type(failure)):
        dk.save({"epoch": 2}, path)
    monkeypatch.undo()
    assert dk.load(path, "cpu") == {"epoch": 1}
    assert os.listdir(tmp_path) == ["model.pt"]


def test_a_full_disk_says_so_and_names_the_path_not_the_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The temporary's writes go to /dev/full, where the operating system refuses each one
    # as a full disk does.
    path = tmp_path / "model.pt"
    dk.save({"epoch": 1}, path)
    real_fdopen = os.fdopen

    def onto_a_full_disk(descriptor: int, mode: str = "r", *args: Any) -> Any:
        os.close(descriptor)
        return real_fdopen(os.open("/dev/full", os.O_WRONLY), mode, *args)

    monkeypatch.setattr(_atomic.os, "fdopen", onto_a_full_disk)
    with pytest.raises(
        OSError, match=re.escape(f"Cannot save to '{path}': the disk holding")
    ) as raised:
        dk.save({"weight": torch.zeros(100_000)}, path)
    message = str(raised.value)
    assert raised.value.errno == errno.ENOSPC
    assert "is full (No space left on device); the file there is unchanged." in message
    assert ".tmp" not in message
    assert "enforce fail" not in message
    monkeypatch.undo()
    assert dk.load(path, "cpu") == {"epoch": 1}
    assert os.listdir(tmp_path) == ["model.pt"]


def test_a_missing_folder_is_named_not_the_temporary(tmp_path: Path) -> None:
    path = tmp_path / "runs" / "model.pt"
    with pytest.raises(FileNotFoundError) as raised:
        dk.save({"epoch": 1}, path)
    assert str(raised.value) == (
        f"[Errno 2] Cannot save to '{path}': the folder '{path.parent}' does not exist "
        "(No such file or directory); nothing was written there."
    )


def test_a_folder_that_is_not_writable_is_named_not_the_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As root every folder is writable: a stand-in refuses the temporary as the OS would,
    # named or unnamed (O_TMPFILE, opened on the folder).
    real_open = os.open

    def refused(path: Any, flags: int, mode: int = 0o777, **kw: Any) -> int:
        if str(path).endswith(".tmp") or _unnamed(flags):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(_atomic.os, "open", refused)
    with pytest.raises(PermissionError) as raised:
        dk.save({"epoch": 1}, tmp_path / "model.pt")
    assert f"the folder '{tmp_path}' is not writable (Permission denied)" in str(raised.value)
    assert ".tmp" not in str(raised.value)


@AS_ROOT
@pytest.mark.usefixtures("watchdog")
def test_a_folder_another_user_cannot_write_in_is_named_for_that_user(
    shared_folder: Path,
) -> None:
    path = shared_folder / "model.pt"  # root's folder, mode 755
    outcome = _as_user(NOBODY, lambda: dk.save({"epoch": 1}, path))
    assert outcome == (
        f"PermissionError: [Errno 13] Cannot save to '{path}': the folder '{shared_folder}' is "
        "not writable (Permission denied); nothing was written there."
    )
    assert os.listdir(shared_folder) == []


@pytest.mark.parametrize(
    ("given", "error", "said"),
    [
        (
            "checkpoints/",
            IsADirectoryError,
            (
                "a path that ends with '/' names a folder, and there is no folder '{folder}/"
                "checkpoints'. Name a file in it once it exists"
            ),
        ),
        (
            "ck.pt/",
            NotADirectoryError,
            (
                "a path that ends with '/' names a folder, but '{folder}/ck.pt' is a file. To "
                "replace it, name it without the slash: '{folder}/ck.pt'; it is unchanged."
            ),
        ),
        (
            "ck.pt/.",
            NotADirectoryError,
            "a path that ends with '/.' names a folder, but '{folder}/ck.pt' is a file.",
        ),
    ],
    ids=["missing-folder", "a-file", "a-file-dot"],
)
def test_a_path_that_ends_with_a_slash_names_a_folder_and_nothing_changes(
    tmp_path: Path, given: str, error: type[OSError], said: str
) -> None:
    dk.save({"epoch": 1}, tmp_path / "ck.pt")
    path = f"{tmp_path}/{given}"  # a str: pathlib would drop the slash itself
    with pytest.raises(RuntimeError, match="invalid file name"):
        torch.save({"epoch": 2}, path)  # as torch.save refuses it
    with pytest.raises(error) as raised:
        dk.save({"epoch": 2}, path)
    assert str(raised.value).startswith(f"[Errno {raised.value.errno}] Cannot save to '{path}': ")
    assert said.format(folder=tmp_path) in str(raised.value)
    assert os.listdir(tmp_path) == ["ck.pt"]
    assert dk.load(tmp_path / "ck.pt", "cpu") == {"epoch": 1}


# The folder's fsync makes the rename durable; it decides nothing. A folder this user
# may write and enter but not list (0733) cannot be opened for it, and the save stands.


@AS_ROOT
@pytest.mark.usefixtures("watchdog")
def test_a_folder_that_can_be_written_but_not_listed_saves_and_says_nothing(
    shared_folder: Path,
) -> None:
    drop = shared_folder / "drop"
    drop.mkdir(mode=0o733)
    drop.chmod(0o733)  # mkdir's mode is cut by the umask
    path = drop / "model.pt"

    def save_twice() -> None:
        dk.save({"epoch": 1}, path)
        dk.save({"epoch": 2}, path)  # over its own file

    assert _as_user(NOBODY, save_twice) == "ok"
    assert os.listdir(drop) == ["model.pt"]
    assert dk.load(path, "cpu") == {"epoch": 2}


def test_a_folder_that_cannot_be_opened_to_flush_the_rename_still_saves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a 0733 folder does to another user than root, by a stand-in.
    real_open = os.open

    def unlistable(path: Any, flags: int, *args: Any, **kw: Any) -> int:
        if flags & os.O_DIRECTORY and not _unnamed(flags) and str(path) == str(tmp_path):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(_atomic.os, "open", unlistable)
    dk.save({"epoch": 1}, tmp_path / "model.pt")
    monkeypatch.undo()
    assert dk.load(tmp_path / "model.pt", "cpu") == {"epoch": 1}
    assert os.listdir(tmp_path) == ["model.pt"]


def test_a_folder_that_refuses_to_be_flushed_still_saves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Some FUSE and network mounts refuse fsync on a folder (EINVAL), after the rename.
    real_fsync = os.fsync
    refused: list[int] = []

    def no_folder_flush(descriptor: int) -> None:
        if stat.S_ISDIR(os.fstat(descriptor).st_mode):
            refused.append(descriptor)
            raise OSError(errno.EINVAL, "Invalid argument")
        real_fsync(descriptor)

    monkeypatch.setattr(_atomic.os, "fsync", no_folder_flush)
    dk.save({"epoch": 1}, tmp_path / "model.pt")
    dk.save({"epoch": 2}, tmp_path / "model.pt")
    monkeypatch.undo()
    assert len(refused) == 2  # the folder was asked, and refused, each time
    assert dk.load(tmp_path / "model.pt", "cpu") == {"epoch": 2}
    assert os.listdir(tmp_path) == ["model.pt"]


# Another user's checkpoint: replacing it would make it this user's, which only root can
# undo, so it is refused before anything is written.


@AS_ROOT
@pytest.mark.usefixtures("watchdog")
@pytest.mark.parametrize(
    ("mode", "file_mode"),
    [(0o1777, 0o666), (0o777, 0o666), (0o777, 0o644)],
    ids=["sticky-like-tmp", "open-to-all", "theirs-to-write"],
)
def test_another_user_s_checkpoint_is_refused_naming_its_owner_and_kept(
    shared_folder: Path, mode: int, file_mode: int
) -> None:
    shared = shared_folder / "shared"
    shared.mkdir()
    shared.chmod(mode)
    path = shared / "model.pt"
    dk.save({"epoch": 1}, path)
    path.chmod(file_mode)  # 666: anyone may write it, so nothing but the owner stops a save
    os.chown(path, NOBODY, NOBODY)
    outcome = _as_user(NAMELESS, lambda: dk.save({"epoch": 2}, path))
    assert outcome == (
        f"PermissionError: [Errno 1] Cannot save to '{path}': the file there belongs to user "
        f"nobody (uid {NOBODY}), and a checkpoint put in its place would belong to this "
        f"process's user (uid {NAMELESS}): only root can give a file to another user. Save "
        "under another name, or remove the file first (or ask its owner to); it is unchanged."
    )
    assert path.stat().st_uid == NOBODY
    assert stat.S_IMODE(path.stat().st_mode) == file_mode
    assert dk.load(path, "cpu") == {"epoch": 1}
    assert os.listdir(shared) == ["model.pt"]


@AS_ROOT
def test_root_replaces_another_user_s_checkpoint_and_gives_it_back(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    dk.save({"epoch": 1}, path)
    os.chown(path, NAMELESS, NAMELESS)
    dk.save({"epoch": 2}, path)
    assert (path.stat().st_uid, path.stat().st_gid) == (NAMELESS, NAMELESS)
    assert dk.load(path, "cpu") == {"epoch": 2}
    os.chown(path, os.geteuid(), NAMELESS)  # root's file, a team's group
    dk.save({"epoch": 3}, path)
    assert (path.stat().st_uid, path.stat().st_gid) == (os.geteuid(), NAMELESS)
    assert os.listdir(tmp_path) == ["model.pt"]


@AS_ROOT
def test_root_that_may_not_give_files_away_refuses_another_user_s_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Root in a user namespace, or on a disk that squashes root, by a stand-in.
    path = tmp_path / "model.pt"
    dk.save({"epoch": 1}, path)
    os.chown(path, NOBODY, NOBODY)

    def refused(descriptor: int, uid: int, gid: int) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(_atomic.os, "fchown", refused)
    msg = f"Cannot save to '{path}': the file there belongs to user nobody (uid {NOBODY}), and"
    with pytest.raises(PermissionError, match=re.escape(msg)):
        dk.save({"epoch": 2}, path)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["model.pt"]
    assert path.stat().st_uid == NOBODY
    assert dk.load(path, "cpu") == {"epoch": 1}


@pytest.mark.parametrize("sticky", [True, False], ids=["sticky", "plain"])
def test_a_refused_rename_names_the_path_and_removes_the_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sticky: bool
) -> None:
    # The kernel's refusal of the rename (a sticky folder over a file that is not this
    # user's, an immutable file), by a stand-in that words it as the kernel does.
    path = tmp_path / "model.pt"
    dk.save({"epoch": 1}, path)
    if sticky:
        tmp_path.chmod(0o1777)

    def refused(source: str, target: str) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted", source, target)

    monkeypatch.setattr(_atomic.os, "replace", refused)
    why = (
        f"the folder '{tmp_path}' is sticky, where only a file's owner may replace it"
        if sticky
        else f"the folder '{tmp_path}' does not let this user replace it"
    )
    msg = f"Cannot save to '{path}': {why} (Operation not permitted); the file there is unchanged."
    with pytest.raises(PermissionError, match=re.escape(msg)) as raised:
        dk.save({"epoch": 2}, path)
    assert ".tmp" not in str(raised.value)
    monkeypatch.undo()
    tmp_path.chmod(0o700)
    assert os.listdir(tmp_path) == ["model.pt"]
    assert dk.load(path, "cpu") == {"epoch": 1}


def test_a_new_checkpoint_gets_the_umask_s_mode_and_a_replaced_one_keeps_its_own(
    tmp_path: Path,
) -> None:
    before = os.umask(0o027)
    try:
        dk.save({"epoch": 1}, tmp_path / "new.pt")
    finally:
        os.umask(before)
    assert stat.S_IMODE((tmp_path / "new.pt").stat().st_mode) == 0o640  # as torch.save's
    shared = tmp_path / "shared.pt"
    dk.save({"epoch": 1}, shared)
    shared.chmod(0o664)  # teammates read it
    dk.save({"epoch": 2}, shared)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o664


def test_a_read_only_checkpoint_is_refused_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "release.pt"
    dk.save({"epoch": 1}, path)
    path.chmod(0o444)
    with pytest.raises(PermissionError, match=re.escape("it is read-only (mode 444)")):
        dk.save({"epoch": 2}, path)
    assert dk.load(path, "cpu") == {"epoch": 1}


def test_a_symlink_s_target_is_replaced_and_the_link_stays(tmp_path: Path) -> None:
    (tmp_path / "big").mkdir()
    target = tmp_path / "big" / "ckpt-100.pt"
    dk.save({"step": 100}, target)
    latest = tmp_path / "latest.pt"
    latest.symlink_to(target)
    dk.save({"step": 101}, latest)
    assert latest.is_symlink()
    assert dk.load(target, "cpu") == {"step": 101}
    assert os.listdir(tmp_path / "big") == ["ckpt-100.pt"]  # the temporary was beside it
    dangling = tmp_path / "next.pt"
    dangling.symlink_to(tmp_path / "big" / "ckpt-200.pt")
    dk.save({"step": 200}, dangling)
    assert dangling.is_symlink()
    assert dk.load(tmp_path / "big" / "ckpt-200.pt", "cpu") == {"step": 200}


@pytest.mark.usefixtures("watchdog")
def test_a_fifo_is_written_in_place_as_torch_save_does(tmp_path: Path) -> None:
    fifo = tmp_path / "stream"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()))
    reader.start()
    dk.save({"weight": torch.ones(3)}, fifo)
    reader.join()
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    assert torch.equal(dk.load(io.BytesIO(received[0]), "cpu")["weight"], torch.ones(3))


@AS_ROOT
def test_a_device_node_is_written_in_place_not_replaced(tmp_path: Path) -> None:
    # A null device of its own: dk.save(model, "/dev/null") as root must not replace it.
    node = tmp_path / "null"
    os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    dk.save({"weight": torch.ones(1000)}, node)
    assert stat.S_ISCHR(node.lstat().st_mode)
    assert os.listdir(tmp_path) == ["null"]


def test_a_directory_is_refused_with_a_file_to_name(tmp_path: Path) -> None:
    with pytest.raises(IsADirectoryError, match=re.escape("it is a directory. Name a file in it")):
        dk.save({"epoch": 1}, tmp_path)


@pytest.mark.parametrize(
    ("f", "hint"),
    [(b"model.pt", "give the path as a str"), (7, "os.fdopen(7, 'wb')")],
    ids=["bytes", "descriptor"],
)
def test_bytes_paths_and_descriptors_get_a_sentence(f: Any, hint: str) -> None:
    with pytest.raises(
        TypeError, match=re.escape("Expected a path (str or os.PathLike)")
    ) as raised:
        dk.save({"epoch": 1}, f)
    assert hint in str(raised.value)


def test_saving_to_a_file_object_writes_in_place() -> None:
    buffer = io.BytesIO()
    dk.save([torch.ones(2)], buffer)
    buffer.seek(0)
    assert torch.equal(dk.load(buffer, "cpu")[0], torch.ones(2))


# A file object cannot be replaced: what a weights-only load would refuse is refused
# before a byte reaches it (a dry pass), and then torch.save writes to it directly.


def test_a_refused_save_writes_nothing_to_the_file_object() -> None:
    buffer = io.BytesIO(b"kept")
    buffer.seek(0, io.SEEK_END)
    with pytest.raises(
        ValueError,
        match=re.escape("Cannot save to the file object: ['model'] is torch.nn.modules.linear"),
    ):
        dk.save({"model": torch.nn.Linear(2, 2)}, buffer)
    assert buffer.getvalue() == b"kept"  # not the 674 bytes of an empty archive


def test_what_torch_save_refuses_while_pickling_leaves_the_file_object_as_it_was() -> None:
    weight = torch.zeros(4)
    buffer = io.BytesIO(b"kept")
    buffer.seek(0, io.SEEK_END)
    with pytest.raises(RuntimeError, match=re.escape("view the same data as different types")):
        dk.save({"weight": weight, "bits": weight.view(torch.int32)}, buffer)
    assert buffer.getvalue() == b"kept"


class _Recording(io.RawIOBase):
    """A raw stream that keeps the size of every write it is given."""

    def __init__(self) -> None:
        self.writes: list[int] = []

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.writes.append(len(memoryview(data).cast("B")))
        return self.writes[-1]


def test_a_file_object_is_written_as_torch_save_writes_it_with_no_copy_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A copy made first (in memory, or in $TMPDIR past a size) would reach the stream in
    # chunks of the copy's, and would need a temporary folder: neither is there.
    def no_temporary_files(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a save to a file object made a temporary file")

    state = {"weight": torch.arange(300_000.0), "step": 7}
    expected = _Recording()
    torch.save(state, expected)
    monkeypatch.setattr(tempfile, "SpooledTemporaryFile", no_temporary_files)
    monkeypatch.setattr(tempfile, "TemporaryFile", no_temporary_files)
    saved = _Recording()
    dk.save(state, saved)
    assert saved.writes == expected.writes


@pytest.mark.usefixtures("watchdog")
def test_a_refused_save_to_a_fifo_does_not_wait_for_a_reader(tmp_path: Path) -> None:
    # Opened for writing, a FIFO waits for a reader: it is opened once the check has passed.
    fifo = tmp_path / "stream"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=re.escape(f"Cannot save to '{fifo}': ['model'] is")):
        dk.save({"model": torch.nn.Linear(2, 2)}, fifo)


def test_what_torch_save_writes_before_its_pickle_is_checked_is_held_until_it_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # None today: a PyTorch that wrote a header first must neither lose it nor leave it.
    real_save = torch.save

    def with_a_header(obj: Any, f: Any, **options: Any) -> None:
        f.write(b"head")
        real_save(obj, f, **options)

    monkeypatch.setattr(_checkpoint.torch, "save", with_a_header)
    saved, refused = io.BytesIO(), io.BytesIO()
    dk.save({"weight": torch.ones(2)}, saved)
    with pytest.raises(ValueError, match=re.escape("Cannot save to the file object: ['model']")):
        dk.save({"model": torch.nn.Linear(2, 2)}, refused)
    assert saved.getvalue().startswith(b"headPK\x03\x04")
    assert refused.getvalue() == b""


_SLOW_SAVE = textwrap.dedent(
    """
    import errno, os, sys, threading, time
    from pathlib import Path
    import torch, devicekit as dk

    path, started, where, temporaries = sys.argv[1:]

    class Slow:  # pickled half-way through the save, while the temporary is open
        def __reduce__(self):
            Path(started).write_text("writing")
            time.sleep(60)
            return (int, ())

    if temporaries == "named":  # a file system that refuses O_TMPFILE (NFS, some FUSE)
        real_open = os.open

        def no_unnamed(file, flags, *args, **kwargs):
            if flags & os.O_TMPFILE == os.O_TMPFILE:
                raise OSError(errno.EOPNOTSUPP, "Operation not supported")
            return real_open(file, flags, *args, **kwargs)

        os.open = no_unnamed

    def save():
        dk.save({"weight": torch.ones(10), "slow": Slow()}, path)

    if where == "thread":  # a checkpointing thread: Python runs no signal handler there
        saver = threading.Thread(target=save)
        saver.start()
        saver.join()
    else:
        save()
    """
)


@pytest.mark.parametrize(
    ("where", "temporaries"),
    [("main", "named"), ("main", "unnamed"), ("thread", "unnamed")],
    ids=["main-thread-named-temporary", "main-thread-unnamed", "background-thread-unnamed"],
)
def test_sigterm_mid_save_leaves_no_temporary_and_ends_the_process(
    tmp_path: Path, where: str, temporaries: str, fresh_python: str
) -> None:
    if temporaries == "unnamed" and not _unnamed_files_work(tmp_path):
        pytest.skip("this file system has no unnamed temporary files (O_TMPFILE)")
    path = tmp_path / "model.pt"
    dk.save({"epoch": 1}, path)
    started = tmp_path.parent / f"{tmp_path.name}-started"
    job = subprocess.Popen(
        [fresh_python, "-c", _SLOW_SAVE, str(path), str(started), where, temporaries], cwd=ROOT
    )
    try:  # the deadlines and the final kill are this test's watchdog
        deadline = time.monotonic() + 60
        while not started.exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started.exists(), "the save never started"
        seen = sorted(os.listdir(tmp_path))
        if temporaries == "named":
            assert len(seen) == 2
            assert seen[0].startswith(".model.pt.")
            assert seen[0].endswith(".tmp")
        else:  # written, and nameless until whole
            assert seen == ["model.pt"]
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=30) == -signal.SIGTERM  # ended by the signal, as it would be
    finally:
        job.kill()
        job.wait(timeout=10)
    assert os.listdir(tmp_path) == ["model.pt"]
    assert dk.load(path, "cpu") == {"epoch": 1}


# Under a process group, or RANK in the environment: save writes where it is called.


def test_rank_in_the_environment_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "1")  # a leftover export, without torchrun or a group
    dk.save({"epoch": 1}, tmp_path / "model.pt")
    assert dk.load(tmp_path / "model.pt", "cpu") == {"epoch": 1}


_TWO_RANKS = textwrap.dedent(
    """
    import datetime, json, os, sys
    import torch, torch.distributed as dist
    import devicekit as dk

    folder, rank = sys.argv[1], int(sys.argv[2])
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=30),
    )
    dk.save({"rank": rank, "shard": torch.full((2,), rank)}, f"{folder}/shard-{rank}.pt")
    if rank == 0:  # the tutorials' idiom: only rank 0 saves, and nobody waits for it
        dk.save({"model": torch.ones(2)}, f"{folder}/model.pt")
    dist.barrier()
    with open(f"{folder}/rank{rank}.json", "w") as out:
        json.dump(sorted(os.listdir(folder)), out)
    dist.barrier()
    dist.destroy_process_group()
    """
)


def test_every_rank_writes_its_shard_and_rank_0_alone_saves_without_a_hang(
    tmp_path: Path,
    fresh_python: str,
) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(_TWO_RANKS)
    folder = tmp_path / "run"
    folder.mkdir()
    ranks = [
        subprocess.Popen(
            [fresh_python, str(script), str(folder), str(rank)],
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for rank in (0, 1)
    ]
    try:
        for rank in ranks:
            _, stderr = rank.communicate(timeout=120)
            assert rank.returncode == 0, stderr[-3000:]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                os.killpg(rank.pid, signal.SIGKILL)
                rank.wait(timeout=10)
    for rank in (0, 1):
        shard = dk.load(folder / f"shard-{rank}.pt", "cpu")
        assert shard["rank"] == rank
        assert torch.equal(shard["shard"], torch.full((2,), rank))
        seen = json.loads((folder / f"rank{rank}.json").read_text())
        assert {"shard-0.pt", "shard-1.pt", "model.pt"} <= set(seen)
    assert torch.equal(dk.load(folder / "model.pt", "cpu")["model"], torch.ones(2))


# What save writes, load reads back by default.


def test_numpy_values_a_namespace_and_paths_load_back_by_default(tmp_path: Path) -> None:
    allowed_before = set(torch.serialization.get_safe_globals())
    args = argparse.Namespace(lr=3e-4, out=Path("/runs/7"), layers=[64, 64])
    state = {
        "args": args,
        "best_loss": np.float64(0.25),
        "steps": np.int64(1000),
        "numpy_rng": np.random.default_rng(0).bit_generator.state,
        "legacy_rng": np.random.get_state(),
        "histogram": np.arange(4, dtype=np.float32),
    }
    path = tmp_path / "ckpt.pt"
    dk.save(state, path)
    loaded = dk.load(path, "cpu")
    assert loaded["args"] == args
    assert loaded["best_loss"] == np.float64(0.25)
    assert type(loaded["steps"]) is np.int64
    assert loaded["numpy_rng"] == state["numpy_rng"]
    assert np.array_equal(loaded["legacy_rng"][1], state["legacy_rng"][1])
    assert np.array_equal(loaded["histogram"], state["histogram"])
    assert set(torch.serialization.get_safe_globals()) == allowed_before  # nothing left there


class Config:
    def __init__(self) -> None:
        self.lr = 0.1


@dataclasses.dataclass
class Settings:
    model: Any


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.Adam(torch.nn.Linear(2, 2).parameters())


def _stepped_optimizer() -> torch.optim.Optimizer:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()  # its state, a defaultdict, now holds items
    return optimizer


_STUCK = "allowing would not do"


def _saved_whole(name: str) -> str:
    """The last sentence of every refusal of dk.save: how to save ``name`` whole anyway."""
    return (
        f" Or, to save it whole, write dk.save({name}, path, weights_only=False) and load it "
        "with dk.load(path, weights_only=False) where its classes can be imported; only load "
        "such a file if you trust it, since unpickling it can execute arbitrary code."
    )


def _looped_namespace() -> argparse.Namespace:
    args = argparse.Namespace(model=torch.nn.Linear(2, 2))
    args.me = args  # a cycle through attributes
    return args


@pytest.mark.parametrize(
    ("state", "where", "fix", "allowed"),
    [
        (
            {"config": Config()},
            "['config'] is tests.test_save_and_load.Config",
            "vars(...)",
            "Config",
        ),
        (
            {"model": torch.nn.Linear(2, 2)},
            "['model'] is torch.nn.modules.linear.Linear",
            "Save its state_dict() instead",
            None,
        ),
        (
            {"loss": torch.nn.MSELoss},
            "['loss'] is torch.nn.modules.loss.MSELoss",
            "its name as a str",
            "MSELoss",
        ),
        (
            [{"deep": [Config()]}],
            "[0]['deep'][0] is tests.test_save_and_load.Config",
            "vars(...)",
            "Config",
        ),
        (
            _optimizer(),
            "the object at the top level is torch.optim.adam.Adam,",
            "Save its state_dict() instead: dk.save(optimizer.state_dict(), path).",
            None,  # an optimizer has a state_dict: that, or saved whole
        ),
        (
            torch.optim.lr_scheduler.StepLR(_optimizer(), 1),
            "the object at the top level is torch.optim.lr_scheduler.StepLR,",
            "Save its state_dict() instead: dk.save(obj.state_dict(), path).",
            None,
        ),
        (
            _stepped_optimizer(),
            "the object at the top level is torch.optim.sgd.SGD,",
            "Save its state_dict() instead",
            None,
        ),
        (
            {"counts": collections.defaultdict(list, a=[1])},
            "['counts'] is collections.defaultdict,",
            "Save it as a plain dict instead (dict(...))",
            _STUCK,  # a weights-only load fills no defaultdict, allowed or not
        ),
        (
            {"counts": collections.defaultdict(list)},
            "['counts'] is collections.defaultdict,",
            "Save it as a plain dict instead (dict(...))",
            "defaultdict, list",  # the load refuses builtins.list, a global as any other
        ),
        (
            {"settings": Settings(torch.nn.Linear(2, 2))},
            "['settings'] is tests.test_save_and_load.Settings,",
            "dataclasses.asdict(...)",
            "Settings",
        ),
        (
            {"args": _looped_namespace()},
            "['args'].model is torch.nn.modules.linear.Linear,",
            "Save its state_dict() instead",
            None,
        ),
    ],
    ids=[
        "own-class",
        "module",
        "a-class",
        "nested",
        "optimizer",
        "scheduler",
        "stepped-optimizer",
        "defaultdict",
        "empty-defaultdict",
        "dataclass",
        "in-attributes",
    ],
)
@pytest.mark.usefixtures("own_safe_globals")
def test_what_a_weights_only_load_would_refuse_is_refused_at_save_naming_where(
    tmp_path: Path, state: Any, where: str, fix: str, allowed: str | None
) -> None:
    path = tmp_path / "ckpt.pt"
    with pytest.raises(ValueError, match=re.escape(f"Cannot save to '{path}': {where}")) as raised:
        dk.save(state, path)
    message = str(raised.value)
    assert fix in message
    if allowed is None:
        assert "add_safe_globals" not in message
        assert "Allowing its classes" not in message
    elif allowed is _STUCK:
        assert "add_safe_globals" not in message
        assert (
            "Allowing its classes would not do: a weights-only load refuses to build it even "
            'then (PyTorch: "Can only SETITEM for dict, collections.OrderedDict, '
            "collections.Counter, but got <class 'collections.defaultdict'>\")."
        ) in message
    else:
        assert f"torch.serialization.add_safe_globals([{allowed}" in message
    name = "checkpoint" if isinstance(state, dict) else "obj"
    name = "optimizer" if isinstance(state, torch.optim.Optimizer) else name
    assert message.endswith(_saved_whole(name))  # the other way out, always
    assert os.listdir(tmp_path) == []  # nothing written, no temporary


_ADVISED = re.compile(r"add_safe_globals\(\[([^]]*)\]\)")


@pytest.mark.parametrize(
    "state",
    [
        {"config": Config()},
        {"model": torch.nn.Linear(2, 2)},
        _optimizer(),
        torch.optim.lr_scheduler.StepLR(_optimizer(), 1),
        _stepped_optimizer(),
        {"counts": collections.defaultdict(list, a=[1])},
        {"counts": collections.defaultdict(list)},
        {"settings": Settings(torch.nn.Linear(2, 2))},
    ],
    ids=[
        "own-class",
        "module",
        "optimizer",
        "scheduler",
        "stepped-optimizer",
        "defaultdict",
        "empty-defaultdict",
        "dataclass",
    ],
)
@pytest.mark.usefixtures("own_safe_globals")
def test_the_classes_a_refusal_advises_to_allow_make_the_save_load_back(state: Any) -> None:
    # What the advice names, allowed, is all a weights-only load needs: where allowing
    # would not do (a defaultdict that holds items), nothing is advised.
    with pytest.raises(ValueError, match=re.escape("Cannot save to the file object")) as raised:
        dk.save(state, io.BytesIO())
    advised = _ADVISED.search(str(raised.value))
    if advised is None:
        return
    known = {
        kind.__name__: kind
        for kind in (
            Config,
            Settings,
            torch.nn.Linear,
            torch.optim.Adam,
            torch.optim.lr_scheduler.StepLR,
            collections.defaultdict,
            dict,
            list,
        )
    }
    allowed = [known[name] for name in advised.group(1).split(", ")]
    buffer = io.BytesIO()
    with torch.serialization.safe_globals(allowed):
        dk.save(state, buffer)
        buffer.seek(0)
        loaded = dk.load(buffer, "cpu")
    assert type(loaded) is type(state)


def test_the_search_for_what_is_refused_keeps_to_the_depth_rule() -> None:
    # Deeper than pickle itself goes: the search is handed such data only by a caller
    # of its own, and refuses it as every walk of devicekit's does, with the path.
    deep: Any = [torch.nn.Linear(1, 1)]
    for _ in range(_tree.MAX_DEPTH):
        deep = [deep]
    refusal = "Unsupported global: GLOBAL torch.nn.modules.linear.Linear was not an allowed global"
    message = _weights_only.save_refusal(deep, refusal, "'ckpt.pt'")
    assert message.startswith(
        "Cannot save to 'ckpt.pt': a weights-only load, dk.load's default, would refuse to "
        "build torch.nn.modules.linear.Linear (building it could run code the file names). "
        "Where it is could not be found: Expected data nested at most 10,000 containers deep, "
        "but data[0][0][0][0][0][0][0][0]...<9,984 more levels>...[0][0][0][0][0][0][0][0] "
        "goes deeper. Save tensors and plain data,"
    )
    assert message.endswith(_saved_whole("obj"))


def _nested(value: Any, levels: int) -> Any:
    for _ in range(levels):
        value = [value]
    return value


def test_the_search_counts_containers_and_attributes_together_against_the_depth_rule() -> None:
    # 9,995 lists, an attribute, then 20 more: each walk alone is shallow enough.
    args = argparse.Namespace(table=_nested(torch.nn.Linear(1, 1), 20))
    refusal = "Unsupported global: GLOBAL torch.nn.modules.linear.Linear was not an allowed global"
    message = _weights_only.save_refusal(_nested(args, 9_995), refusal, "'ckpt.pt'")
    assert (
        "Where it is could not be found: Expected data nested at most 10,000 containers deep, "
        "but data[0][0][0][0][0][0][0][0]...<9,984 more levels>...[0][0][0].table[0][0][0][0] "
        "goes deeper. Save tensors"
    ) in message


def test_the_search_finds_what_is_refused_within_the_depth_rule() -> None:
    args = argparse.Namespace(table=_nested(torch.nn.Linear(1, 1), 3))
    refusal = "Unsupported global: GLOBAL torch.nn.modules.linear.Linear was not an allowed global"
    message = _weights_only.save_refusal({"run": _nested(args, 2)}, refusal, "'ckpt.pt'")
    assert "['run'][0][0].table[0][0][0] is torch.nn.modules.linear.Linear" in message


@pytest.mark.usefixtures("watchdog")
def test_a_refused_object_in_data_with_a_cycle_is_refused_without_a_hang() -> None:
    state: dict[str, Any] = {"model": torch.nn.Linear(1, 1)}
    state["self"] = state  # pickle saves it, and a weights-only load reads it back
    with pytest.raises(ValueError) as raised:
        dk.save(state, io.BytesIO())
    message = str(raised.value)
    assert "would refuse to build torch.nn.modules.linear.Linear (building it" in message
    assert (
        "Where it is could not be found: Expected data without reference cycles, but "
        "data['self'] is the dict data itself, which contains it. Save tensors"
    ) in message


class RNNModel(torch.nn.Module):
    """PyTorch's word language model (examples/word_language_model), small: saved whole."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = torch.nn.Dropout(0.2)
        self.encoder = torch.nn.Embedding(10, 4)
        self.rnn = torch.nn.LSTM(4, 4)
        self.decoder = torch.nn.Linear(4, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        output, _ = self.rnn(self.drop(self.encoder(tokens)))
        return self.decoder(self.drop(output))


_MODEL_CLASSES = (
    f"{__name__}.RNNModel, torch.nn.modules.dropout.Dropout, torch.nn.modules.sparse.Embedding, "
    "torch.nn.modules.rnn.LSTM, torch.nn.modules.linear.Linear"
)


@pytest.mark.usefixtures("own_safe_globals")
def test_a_whole_model_is_refused_naming_every_class_at_once_with_both_ways_out(
    tmp_path: Path,
) -> None:
    # Issue 35: each try named one class more (RNNModel, Dropout, ...): five rounds.
    path = tmp_path / "model.pt"
    msg = (
        f"Cannot save to '{path}': the object at the top level is {__name__}.RNNModel, which "
        "a weights-only load, dk.load's default, refuses to build (building it could run code "
        f"the file names). The load refuses all 5 of these: {_MODEL_CLASSES}. Save its "
        "state_dict() instead: dk.save(model.state_dict(), path)." + _saved_whole("model")
    )
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        dk.save(RNNModel(), path)
    assert os.listdir(tmp_path) == []


@pytest.mark.usefixtures("own_safe_globals")
def test_every_refused_object_is_named_with_its_path_at_once() -> None:
    state = {"model": RNNModel(), "optimizer": _optimizer(), "epoch": 3}
    with pytest.raises(ValueError) as raised:
        dk.save(state, io.BytesIO())
    message = str(raised.value)
    assert message.startswith(
        f"Cannot save to the file object: ['model'] is {__name__}.RNNModel and ['optimizer'] "
        "is torch.optim.adam.Adam, which a weights-only load, dk.load's default, refuses to "
        f"build (building them could run code the file names). The load refuses all 8 of "
        f"these: {_MODEL_CLASSES}, torch.optim.adam.Adam, collections.defaultdict, builtins.dict."
        " For ['model'] and ['optimizer'], save their state_dict() instead."
    )
    assert message.endswith(_saved_whole("checkpoint"))


def test_many_refused_objects_are_counted_past_the_first_three() -> None:
    configs = {name: Config() for name in "abcde"}
    with pytest.raises(ValueError) as raised:
        dk.save(configs, io.BytesIO())
    config = f"{__name__}.Config"
    assert str(raised.value).startswith(
        f"Cannot save to the file object: ['a'] is {config}, ['b'] is {config}, ['c'] is "
        f"{config} and 2 more, which a weights-only load, dk.load's default, refuses to build "
        "(building them could run code the file names). For ['a'], ['b'], ['c'] and 2 more, "
        "save their fields as dicts instead (vars(...) or dataclasses.asdict(...)). Or, where "
        "the class is yours and safe to build, allow it before saving and before loading: "
        "torch.serialization.add_safe_globals([Config])."
    )


def test_a_model_saved_whole_on_request_loads_back_whole_onto_the_device(
    tmp_path: Path,
) -> None:
    model = RNNModel().eval()
    tokens = torch.randint(10, (5, 2))
    path = tmp_path / "model.pt"
    path.write_bytes(b"the last good checkpoint")
    dk.save(model, path, weights_only=False)
    assert os.listdir(tmp_path) == ["model.pt"]  # replaced, no temporary left
    loaded = dk.load(path, "cpu", weights_only=False)
    assert type(loaded) is RNNModel
    assert torch.equal(loaded(tokens), model(tokens))
    assert dk.load(path, map_location="meta", weights_only=False).decoder.weight.is_meta
    with dk.DeviceManager("meta"):
        assert dk.load(path, weights_only=False).rnn.weight_hh_l0.is_meta
    buffer = io.BytesIO()
    dk.save(model, buffer, weights_only=False)  # a file object too
    buffer.seek(0)
    assert torch.equal(dk.load(buffer, "cpu", weights_only=False)(tokens), model(tokens))


def test_a_failed_save_on_request_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(b"the last good checkpoint")
    with pytest.raises((pickle.PicklingError, AttributeError)):
        dk.save({"step": lambda: 0}, path, weights_only=False)  # no pickle has a lambda
    assert path.read_bytes() == b"the last good checkpoint"
    assert os.listdir(tmp_path) == ["model.pt"]


@pytest.mark.usefixtures("own_safe_globals")
def test_a_model_saved_whole_is_refused_by_the_default_load_with_the_way_to_load_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "model.pt"
    dk.save(RNNModel(), path, weights_only=False)
    msg = (
        f"Cannot load '{path}' as weights and plain data: it holds {_MODEL_CLASSES}, which a "
        "weights-only load, dk.load's default, does not build or call, since that could run "
        "code the file chooses." + _LOAD_WHOLE  # modules: allowing them is no advice
    )
    with pytest.raises(pickle.UnpicklingError, match=f"^{re.escape(msg)}$"):
        dk.load(path, "cpu")
    with (
        path.open("rb") as stream,
        pytest.raises(pickle.UnpicklingError, match=re.escape(_LOAD_WHOLE)),
    ):
        dk.load(stream, "cpu")  # from a file object: the pickle is read where it starts


@pytest.mark.parametrize("value", [0, 1, "no", None])
def test_save_s_weights_only_takes_true_or_false_only(value: object) -> None:
    buffer = io.BytesIO()
    msg = f"Expected weights_only to be True or False, got {value!r}."
    with pytest.raises(TypeError, match=re.escape(msg)):
        dk.save(RNNModel(), buffer, weights_only=value)  # type: ignore[arg-type]
    assert buffer.getvalue() == b""


def test_a_class_allowed_with_add_safe_globals_saves_and_loads(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    with torch.serialization.safe_globals([Config]):
        dk.save({"config": Config()}, path)
        assert dk.load(path, "cpu")["config"].lr == 0.1


def test_a_checkpoint_a_weights_only_load_refuses_gets_devicekit_s_sentence(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    torch.save({"config": Config()}, path)  # torch.save checks nothing
    with pytest.raises(pickle.UnpicklingError) as raised:
        dk.load(path, "cpu")
    message = str(raised.value)
    assert message == (
        f"Cannot load '{path}' as weights and plain data: it holds "
        f"{__name__}.Config, which a weights-only load, dk.load's default, does not build or "
        "call, since that could run code the file chooses."
        + _LOAD_WHOLE
        + " Or, if you know it is a class of yours that is safe to build, allow it first: "
        "torch.serialization.add_safe_globals([Config])."
    )


_LOAD_WHOLE = (
    " If you trust the file, load it whole with dk.load(path, weights_only=False) where its "
    "classes can be imported; only load a file you trust, since unpickling it can execute "
    "arbitrary code."
)


class _WritesAFile:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.path), "w"))


def test_a_pickle_that_would_run_code_is_refused(tmp_path: Path) -> None:
    planted = tmp_path / "planted.txt"
    payload = tmp_path / "payload.pt"
    torch.save({"weights": torch.ones(1), "surprise": _WritesAFile(planted)}, payload)
    assert not planted.exists()
    with pytest.raises(pickle.UnpicklingError) as raised:
        dk.load(payload, "cpu")
    assert not planted.exists()  # nor by the words of the refusal: nothing built or called
    assert str(raised.value) == (
        f"Cannot load '{payload}' as weights and plain data: it holds io.open, which a "
        "weights-only load, dk.load's default, does not build or call, since that could run "
        "code the file chooses." + _LOAD_WHOLE  # a function: never advised to be allowed
    )


# Loading onto the device asked for.


def _relocate(path: Path, location: str) -> None:
    """Rewrite a saved checkpoint as if its tensors had been saved on `location`."""

    class Call:
        """A rebuild call read from the pickle, written back as it was, not run."""

        def __init__(self, function: object, *args: object) -> None:
            self.function, self.args = function, args

        def __reduce__(self) -> tuple[object, tuple[object, ...]]:
            return self.function, self.args

    class Reader(pickle.Unpickler):
        def persistent_load(self, pid: object) -> object:
            return pid

        def find_class(self, module: str, name: str) -> object:
            found = super().find_class(module, name)
            if module == "torch._utils":
                return lambda *args: Call(found, *args)
            return found

    class Writer(pickle.Pickler):
        def persistent_id(self, obj: object) -> object:
            if isinstance(obj, tuple) and obj and obj[0] == "storage":
                return (*obj[:3], location, *obj[4:])
            return None

    with zipfile.ZipFile(path) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    name = next(name for name in members if name.endswith("data.pkl"))
    data = Reader(io.BytesIO(members[name])).load()
    out = io.BytesIO()
    Writer(out, protocol=2).dump(data)
    members[name] = out.getvalue()
    with zipfile.ZipFile(path, "w") as archive:
        for member, content in members.items():
            archive.writestr(member, content)


def test_a_checkpoint_from_another_device_loads_onto_the_target(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    torch.save({"weight": torch.arange(4.0), "step": 7}, path)
    _relocate(path, "cuda:3")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(path, weights_only=True)  # what devicekit spares its users
    loaded = dk.load(path, "cpu")
    assert torch.equal(loaded["weight"], torch.arange(4.0))
    assert loaded["step"] == 7
    assert dk.load(path, "meta")["weight"].device == META
    with dk.DeviceManager("meta"):
        assert dk.load(path)["weight"].device == META


def test_loading_a_checkpoint_of_meta_tensors_onto_a_real_device_says_so() -> None:
    buffer = io.BytesIO()
    torch.save({"fc.weight": torch.ones(2, device="meta"), "step": 3}, buffer)
    buffer.seek(0)
    msg = (
        "Expected a checkpoint with data to load onto cpu, but it holds meta tensors: "
        "['fc.weight']; tensors on the meta device have shapes but no data."
    )
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        dk.load(buffer, "cpu")
    buffer.seek(0)
    assert dk.load(buffer, "meta")["fc.weight"].is_meta  # onto meta it is what was asked


# Loading: what it is given.


def test_map_location_is_taken_as_the_device(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    dk.save({"weight": torch.ones(2)}, path)
    assert dk.load(path, map_location="meta")["weight"].is_meta
    assert dk.load(path, "meta", map_location=torch.device("meta"))["weight"].is_meta
    with pytest.raises(TypeError, match="got device='cpu' and map_location='meta': give one"):
        dk.load(path, "cpu", map_location="meta")
    with pytest.raises(
        TypeError, match=re.escape("every tensor on one device. For a mapping per device")
    ):
        dk.load(path, map_location={"cuda:0": "cpu"})  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [0, 1, "yes", None, 0.0])
def test_weights_only_takes_true_or_false_only(value: object) -> None:
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(1)}, buffer)
    buffer.seek(0)
    msg = f"Expected weights_only to be True or False, got {value!r}."
    with pytest.raises(TypeError, match=re.escape(msg)):
        dk.load(buffer, "cpu", weights_only=value)  # type: ignore[arg-type]


@pytest.mark.usefixtures("watchdog")
def test_a_named_pipe_is_read_once_without_a_hang(tmp_path: Path) -> None:
    # As `--ckpt <(aws s3 cp s3://... -)` gives it: a pipe whose writer writes it once.
    buffer = io.BytesIO()
    torch.save({"weight": torch.arange(3.0)}, buffer)
    fifo = tmp_path / "ckpt"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(buffer.getvalue()))
    writer.start()
    loaded = dk.load(fifo, "cpu")
    writer.join()
    assert torch.equal(loaded["weight"], torch.arange(3.0))
    with pytest.raises(ValueError, match="is a pipe: omit mmap"):
        dk.load(fifo, "cpu", mmap=True)


class _ReadOnlyStream:
    """A stream that reads and nothing else: no seek, no seekable, as a socket's file."""

    def __init__(self, data: bytes) -> None:
        self._data = io.BytesIO(data)

    def read(self, size: int = -1) -> bytes:
        return self._data.read(size)


def test_an_unseekable_stream_is_read_into_memory() -> None:
    buffer = io.BytesIO()
    torch.save({"weight": torch.ones(2)}, buffer)
    loaded = dk.load(_ReadOnlyStream(buffer.getvalue()), "cpu")  # type: ignore[arg-type]
    assert torch.equal(loaded["weight"], torch.ones(2))


@pytest.mark.parametrize(
    ("f", "hint"),
    [
        (b"model.pt", "give the path as a str, os.fsdecode(b'model.pt')"),
        (3, "os.fdopen(3, 'rb')"),
        (object(), "got object"),
    ],
    ids=["bytes", "descriptor", "no-read"],
)
def test_what_is_no_path_or_file_gets_a_sentence(f: Any, hint: str) -> None:
    with pytest.raises(
        TypeError, match=re.escape("Expected a path (str or os.PathLike)")
    ) as raised:
        dk.load(f, "cpu")
    assert hint in str(raised.value)


@AS_ROOT
def test_a_device_is_refused_not_read(tmp_path: Path) -> None:
    node = tmp_path / "zero"
    os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 5))  # /dev/zero would never end
    with pytest.raises(ValueError, match="is a device, not a file"):
        dk.load(node, "cpu")


def _checkpoint_bytes() -> bytes:
    buffer = io.BytesIO()
    torch.save({"weight": torch.ones(64)}, buffer)
    return buffer.getvalue()


def _written(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


@pytest.mark.parametrize("mmap", [False, True])
@pytest.mark.parametrize("kept", [0.5, 0.9, 0.999, -1], ids=["50%", "90%", "99.9%", "all-but-1"])
def test_a_checkpoint_cut_short_is_a_value_error_naming_the_file(
    tmp_path: Path, kept: float, mmap: bool
) -> None:
    whole = _checkpoint_bytes()
    end = len(whole) - 1 if kept == -1 else int(len(whole) * kept)
    path = _written(tmp_path / "model.pt", whole[:end])
    with pytest.raises(ValueError, match=re.escape(f"but '{path}' is cut short or damaged")):
        dk.load(path, "cpu", mmap=mmap)


def test_a_checkpoint_damaged_inside_is_a_value_error(tmp_path: Path) -> None:
    whole = bytearray(_checkpoint_bytes())
    whole[40:80] = bytes(40)  # the first record's header and name
    path = _written(tmp_path / "model.pt", bytes(whole))
    with pytest.raises(ValueError, match="is cut short or damaged"):
        dk.load(path, "cpu")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "is empty."),
        (b"hello, world", "is not one (it begins with b'hello, w')."),
    ],
)
def test_load_says_when_a_file_is_not_a_checkpoint(
    tmp_path: Path, content: bytes, message: str
) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(content)
    with pytest.raises(
        ValueError,
        match=re.escape(f"{NOT_A_CHECKPOINT}'{path}' {message}"),
    ):
        dk.load(path, "cpu")


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (os.urandom(64), "is not one (it begins with b"),  # b'...' or b"...": repr's choice
        (b"x", "is not one (it begins with b'x')"),
        (pickle.dumps({"weight": 1}), "is not one (it begins with b'\\x80"),
        (b"", "is empty"),
        (_checkpoint_bytes()[:300], "is cut short or damaged"),
    ],
    ids=["random-bytes", "one-byte", "plain-pickle", "empty", "truncated"],
)
def test_a_file_that_is_no_checkpoint_is_refused_without_advice_to_run_code(
    tmp_path: Path, content: bytes, why: str
) -> None:
    path = _written(tmp_path / "checkpoint.pt", content)
    with pytest.raises(ValueError) as info:
        dk.load(path, "cpu")
    assert why in str(info.value)
    assert "weights_only" not in str(info.value)


def test_a_zip_archive_that_is_no_checkpoint_is_a_value_error(tmp_path: Path) -> None:
    path = tmp_path / "data.zip"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("notes.txt", "hello")
    with pytest.raises(ValueError, match="a zip archive that is not a checkpoint"):
        dk.load(path, "cpu")


def _without(records: tuple[str, ...]) -> bytes:
    """A checkpoint of torch.save's, its ``records`` left out, the others as they were."""
    whole = zipfile.ZipFile(io.BytesIO(_checkpoint_bytes()))
    rewritten = io.BytesIO()
    with zipfile.ZipFile(rewritten, "w") as archive:
        for name in whole.namelist():
            if name.partition("/")[2] not in records:
                archive.writestr(name, whole.read(name))
    return rewritten.getvalue()


@pytest.mark.parametrize(
    ("records", "lacks"),
    [
        (("version",), "the 'version' record"),
        (("data.pkl",), "the 'data.pkl' record"),
        (("data.pkl", "version"), "the 'data.pkl' and 'version' records"),
    ],
)
@pytest.mark.parametrize("weights_only", [True, False])
def test_an_archive_without_a_record_torch_load_reads_first_is_a_value_error_naming_it(
    tmp_path: Path, records: tuple[str, ...], lacks: str, weights_only: bool
) -> None:
    path = _written(tmp_path / "model.pt", _without(records))
    message = (
        f"{NOT_A_CHECKPOINT}'{path}' is a zip archive without {lacks} that torch.save writes "
        "and torch.load reads first: it holds "
    )
    with pytest.raises(ValueError, match=re.escape(message)) as raised:
        dk.load(path, "cpu", weights_only=weights_only)
    first = zipfile.ZipFile(path).namelist()[0].partition("/")[2]
    assert f"it holds {first!r}" in str(raised.value)  # what it does hold, from the first
    in_memory = message.replace(f"'{path}'", "the file object")
    with pytest.raises(ValueError, match=re.escape(in_memory)):
        dk.load(io.BytesIO(path.read_bytes()), "cpu", weights_only=weights_only)


# PyTorch 2.13 deprecates TorchScript: its warnings, not devicekit's.
@pytest.mark.filterwarnings("ignore:`torch.jit.save` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")
def test_a_torchscript_archive_is_a_value_error_naming_torch_jit_load(tmp_path: Path) -> None:
    path = tmp_path / "scripted.pt"
    model = torch.nn.Linear(2, 1)
    torch.jit.save(torch.jit.script(model), str(path))
    message = (
        f"{NOT_A_CHECKPOINT}'{path}' is a TorchScript archive, written by torch.jit.save: "
        f"load it with torch.jit.load('{path}', map_location='cpu')."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        dk.load(path, "cpu")
    with pytest.raises(ValueError, match=re.escape("load it with torch.jit.load(f, map_location=")):
        dk.load(io.BytesIO(path.read_bytes()), "meta")
    loaded = torch.jit.load(str(path), map_location="cpu")  # the advice works
    assert torch.equal(loaded.weight, model.weight)


def test_a_checkpoint_that_names_torchscript_s_record_is_no_torchscript_archive() -> None:
    buffer = io.BytesIO()
    dk.save({"constants.pkl": torch.ones(2)}, buffer)  # the name in the archive's last bytes
    buffer.seek(0)
    assert torch.equal(dk.load(buffer, "cpu")["constants.pkl"], torch.ones(2))


class _FailingStream(io.RawIOBase):
    """A raw stream whose writes raise ``error`` once ``after`` bytes have been written."""

    def __init__(self, error: BaseException, after: int) -> None:
        self.error, self.after, self.written = error, after, 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        size = len(memoryview(data).cast("B"))
        if self.written + size > self.after:
            raise self.error
        self.written += size
        return size


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "disk full"),
        ValueError("I/O operation on closed file"),
        KeyboardInterrupt(),
    ],
    ids=["disk-full", "closed", "ctrl-c"],
)
@pytest.mark.parametrize("after", [0, 100, 5_000])
def test_a_stream_that_fails_midway_through_a_save_raises_its_own_error(
    error: BaseException, after: int
) -> None:
    stream = _FailingStream(error, after)
    with pytest.raises(type(error)) as raised:
        dk.save({"weight": torch.ones(4_000)}, stream)
    assert raised.value is error
    assert raised.value.__suppress_context__ or raised.value.__context__ is None
    assert stream.written > 0 or after == 0  # it failed midway, not at the start


def test_ctrl_c_midway_through_a_save_to_a_path_is_a_keyboard_interrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "model.pt"
    dk.save({"epoch": 1}, path)
    real_fdopen = os.fdopen

    class Interrupted:
        """The temporary, written until Ctrl-C comes after its first 100 bytes."""

        def __init__(self, file: Any) -> None:
            self.file, self.written = file, 0

        def write(self, data: Any) -> int:
            self.written += len(memoryview(data).cast("B"))
            if self.written > 100:
                raise KeyboardInterrupt
            return int(self.file.write(data))

        def __getattr__(self, name: str) -> Any:
            return getattr(self.file, name)

        def __enter__(self) -> Interrupted:
            return self

        def __exit__(self, *exc_info: object) -> None:
            self.file.close()

    monkeypatch.setattr(_atomic.os, "fdopen", lambda *a, **k: Interrupted(real_fdopen(*a, **k)))
    with pytest.raises(KeyboardInterrupt):
        dk.save({"weight": torch.zeros(100_000)}, path)
    monkeypatch.undo()
    assert dk.load(path, "cpu") == {"epoch": 1}
    assert os.listdir(tmp_path) == ["model.pt"]


def test_a_file_opened_in_text_mode_is_refused_with_the_mode_to_use(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    dk.save({"epoch": 1}, path)
    with path.open() as text, pytest.raises(TypeError, match="open it with 'rb'"):
        dk.load(text, "cpu")
    with path.open("w") as text, pytest.raises(TypeError, match="open it with 'wb'"):
        dk.save({"epoch": 1}, text)


def test_the_legacy_format_still_loads() -> None:
    buffer = io.BytesIO()
    torch.save({"weight": torch.ones(2)}, buffer, _use_new_zipfile_serialization=False)
    buffer.seek(0)
    assert torch.equal(dk.load(buffer, "cpu")["weight"], torch.ones(2))
