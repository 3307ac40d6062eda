"""The public surface: exactly the names in __all__, each documented, errors in one hierarchy."""

from __future__ import annotations

import re
import subprocess
import sys
import types

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


def test_importing_devicekit_creates_no_cuda_context() -> None:
    code = "import devicekit, torch; print(torch.cuda.is_initialized())"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"
