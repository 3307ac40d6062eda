"""The public surface: exactly the names in __all__, each documented, errors in one hierarchy."""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import devicekit as dk


def test_all_is_sorted_and_names_exactly_what_the_package_defines_for_its_users() -> None:
    assert dk.__all__ == sorted(dk.__all__)
    public = {  # dir(): the names imported on first use too
        name
        for name in dir(dk)
        if not name.startswith("_") and not isinstance(getattr(dk, name), types.ModuleType)
    }
    assert set(dk.__all__) == public | {"__version__"}  # nothing left out, nothing extra
    for name in public:  # defined by devicekit, not re-exported from elsewhere
        assert getattr(dk, name).__module__.startswith("devicekit"), name
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", dk.__version__)


def test_every_public_name_is_documented_with_an_example() -> None:
    for name in dk.__all__:
        if name != "__version__":
            assert ">>>" in (getattr(dk, name).__doc__ or ""), name


def test_errors_derive_from_one_base_and_say_they_are_devicekit_s() -> None:
    for error in (dk.DeviceUnavailableError, dk.DeviceMismatchError, dk.TransferError):
        assert issubclass(error, dk.DeviceKitError)
        assert error.__module__ == "devicekit"
        assert error.__doc__
    assert issubclass(dk.DeviceKitError, RuntimeError)


def test_the_error_rule_as_the_api_page_states_it(tmp_path: Path) -> None:
    # Device problems are DeviceKitErrors; wrong arguments and files are Python's own.
    with pytest.raises(dk.DeviceUnavailableError):
        dk.to_device(torch.ones(1), "gpu")
    with pytest.raises(dk.DeviceMismatchError):
        dk.check_same_device(torch.ones(1), torch.ones(1, device="meta"))
    with pytest.raises(ValueError, match=r"^Expected policy to be one of"):
        dk.DeviceManager(policy="fastest")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^Cannot save to"):
        dk.save(torch.nn.Linear(1, 1), tmp_path / "model.pt")
    with pytest.raises(FileNotFoundError):
        dk.save({"step": 1}, tmp_path / "missing" / "state.pt")
    (tmp_path / "junk.pt").write_bytes(b"junk")
    with pytest.raises(ValueError, match=r"^Expected a file written by torch\.save"):
        dk.load(tmp_path / "junk.pt")
    for error in (ValueError, FileNotFoundError):
        assert not issubclass(error, dk.DeviceKitError)
    page = (Path(__file__).parent.parent / "docs" / "api.rst").read_text()
    assert "A device problem (" in page
    assert "an argument of the wrong\ntype is a :class:`TypeError`" in page


def test_importing_devicekit_creates_no_cuda_context() -> None:
    code = "import devicekit, torch; print(torch.cuda.is_initialized())"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"
