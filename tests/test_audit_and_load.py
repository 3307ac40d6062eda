"""track_transfers and load on the CPU, with meta as the second device."""

from __future__ import annotations

import inspect
import io
import pickle
import re
import zipfile
from pathlib import Path

import pytest
import torch

import devicekit as dk

META = torch.device("meta")


def test_track_transfers_counts_exactly_the_copies_inside_it() -> None:
    torch.ones(3).to("meta")  # outside: not counted
    with dk.track_transfers() as log:
        dk.to_device({"a": torch.ones(4), "b": [torch.ones(2, dtype=torch.float64)]}, "meta")
        target = torch.empty(3, device="meta")
        target.copy_(torch.ones(3))
        torch.ones(2).to("cpu")  # same device: no transfer
    torch.ones(3).to("meta")
    assert log.count == 3
    assert log.bytes == 16 + 16 + 12
    assert [(e.source, e.target, e.operation) for e in log.events] == [
        (torch.device("cpu"), META, "to"),
        (torch.device("cpu"), META, "to"),
        (torch.device("cpu"), META, "copy_"),
    ]
    assert all(e.filename == __file__ for e in log.events)


def test_the_summary_groups_by_direction() -> None:
    with dk.track_transfers() as log:
        torch.ones(256).to("meta")
    line = inspect.currentframe().f_lineno - 1  # type: ignore[union-attr]
    assert str(log) == (
        "1 transfer(s) between devices, 1.0 KiB in all:\n"
        f"  cpu -> meta: 1 (1.0 KiB), first at test_audit_and_load.py:{line} in "
        "test_the_summary_groups_by_direction"
    )
    with dk.track_transfers() as empty:
        pass
    assert str(empty) == "No transfers between devices."


def test_strict_mode_points_at_the_line() -> None:
    def step() -> None:
        torch.ones(2).to("meta")

    line = inspect.getsourcelines(step)[1] + 1
    msg = f"but test_audit_and_load.py:{line} in step copies 8 bytes from cpu to meta (to)."
    with pytest.raises(dk.TransferError, match=re.escape(msg)), dk.track_transfers(strict=True):
        step()


# load.


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
    with pytest.raises(pickle.UnpicklingError, match="which a weights-only load does not build"):
        dk.load(payload, "cpu")
    assert not planted.exists()
