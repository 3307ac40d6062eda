"""dk.save writes atomically, with one writer under torchrun; dk.load never advises
running a pickle's code for a file that is no checkpoint."""

from __future__ import annotations

import errno
import io
import os
import pickle
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import devicekit as dk
from devicekit import _checkpoint

NOT_A_CHECKPOINT = "Expected a file written by torch.save, but "


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

    def dies_half_way(obj: Any, f: Any) -> None:
        f.write(b"PK\x03\x04 half a checkpoint")
        raise failure

    monkeypatch.setattr(_checkpoint.torch, "save", dies_half_way)
    with pytest.raises(type(failure)):
        dk.save({"epoch": 2}, path)
    monkeypatch.undo()
    assert dk.load(path, "cpu") == {"epoch": 1}
    assert os.listdir(tmp_path) == ["model.pt"]


def test_only_global_rank_0_writes_under_torchrun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "1")
    dk.save({"epoch": 1}, tmp_path / "model.pt")
    assert os.listdir(tmp_path) == []
    monkeypatch.setenv("RANK", "0")
    dk.save({"epoch": 1}, tmp_path / "model.pt")
    assert os.listdir(tmp_path) == ["model.pt"]


@pytest.fixture
def process_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("process_group")
def test_with_a_process_group_rank_0_writes_and_every_rank_hears_how_it_went(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    told: list[object] = []
    broadcast = dist.broadcast_object_list

    def recording(objects: list[object], src: int = 0, **kwargs: Any) -> None:
        broadcast(objects, src=src, **kwargs)
        told.append(objects[0])

    monkeypatch.setattr(dist, "broadcast_object_list", recording)
    dk.save({"epoch": 1}, tmp_path / "model.pt")
    assert told == [None]  # the barrier, saying rank 0 wrote it
    assert dk.load(tmp_path / "model.pt", "cpu") == {"epoch": 1}
    with pytest.raises(IsADirectoryError):
        dk.save({"epoch": 2}, tmp_path)  # a directory cannot be replaced by a file
    assert len(told) == 2
    assert "IsADirectoryError" in str(told[1])  # what the other ranks raise with


def test_saving_to_a_file_object_writes_in_place() -> None:
    buffer = io.BytesIO()
    dk.save([torch.ones(2)], buffer)
    buffer.seek(0)
    assert torch.equal(dk.load(buffer, "cpu")[0], torch.ones(2))


def _written(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


def _checkpoint_bytes() -> bytes:
    buffer = io.BytesIO()
    torch.save({"weight": torch.ones(64)}, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (os.urandom(64), "is not one (it begins with b'"),
        (b"x", "is not one (it begins with b'x')"),
        (pickle.dumps({"weight": 1}), "is not one (it begins with b'\\x80"),
        (b"", "is empty"),
        (_checkpoint_bytes()[:300], "is cut short, damaged, or a zip archive"),
    ],
    ids=["random-bytes", "one-byte", "plain-pickle", "empty", "truncated"],
)
def test_a_file_that_is_no_checkpoint_is_refused_without_advice_to_run_code(
    tmp_path: Path, content: bytes, why: str
) -> None:
    path = _written(tmp_path / "checkpoint.pt", content)
    with pytest.raises(ValueError, match=re.escape(NOT_A_CHECKPOINT)) as info:
        dk.load(path, "cpu")
    assert why in str(info.value)
    assert "weights_only" not in str(info.value)


def test_a_zip_archive_that_is_no_checkpoint_is_a_value_error(tmp_path: Path) -> None:
    path = tmp_path / "data.zip"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("notes.txt", "hello")
    with pytest.raises(ValueError, match="a zip archive that is not a checkpoint"):
        dk.load(path, "cpu")


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
