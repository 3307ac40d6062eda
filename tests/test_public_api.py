"""The public surface: exactly the names in __all__, each documented, errors in one hierarchy."""

from __future__ import annotations

import builtins
import importlib
import inspect
import io
import re
import subprocess
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

import devicekit as dk
import devicekit.testing as dkt


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


def test_importing_devicekit_creates_no_cuda_context(fresh_python: str) -> None:
    code = "import devicekit, torch; print(torch.cuda.is_initialized())"
    result = subprocess.run([fresh_python, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


# The public callables that raise nothing on purpose, and so have no Raises section. Each
# was read down its callees: what can come out of them is Python's or PyTorch's own error
# (a bug, an interrupt), never one devicekit raises. A name that gains a raise must gain a
# Raises section and leave this list; the test below fails for a name listed here that has
# one, so the list stays true.
RAISES_NOTHING = frozenset(
    {
        # Records: generated constructors that store their fields, and what reads them.
        "BatchFit",
        "BatchFit.Try",
        "BatchFit.explain",
        "DeviceInfo",
        "GpuProcess",
        "LoaderStats",
        "TransferEvent",
        "TransferEvent.where",
        "TransferLog",
        "TransferLog.bytes",
        "TransferLog.count",
        "testing.FrozenRecord",
        "testing.Pair",
        "testing.Record",
        # The errors: each docstring says when it is raised; making one raises nothing.
        "DeviceKitError",
        "DeviceMismatchError",
        "DeviceUnavailableError",
        "TransferError",
        # A protocol the user implements: what its members raise is the implementer's.
        "Backend",
        "Backend.device_type",
        "Backend.devices",
        "Backend.name",
        # Readers of what a made object holds, and giving back a claim or hooks.
        "DeviceDataLoader.close",
        "DeviceDataLoader.device",
        "DeviceDataLoader.stats",
        "DeviceManager.close",
        "DeviceManager.close_all",
        "DeviceManager.device",
        "DeviceManager.device_id",
        "DeviceManager.devices",
        "DeviceManager.explain",
        "DeviceManager.notes",
        "DeviceManager.reason",
        "GuardHandle.remove",
        "testing.still_pinned",
    }
)


def _public_callables() -> dict[str, object]:
    """Each public function and class (its docstring documents the constructor), and each
    public method, property and nested class of a public class, by its dotted name."""
    found: dict[str, object] = {}
    for module, prefix in ((dk, ""), (dkt, "testing.")):
        for name in module.__all__:
            value = getattr(module, name)
            if callable(value):  # not __version__ or CONTAINER_KINDS
                found[prefix + name] = value
    classes = [(name, value) for name, value in found.items() if inspect.isclass(value)]
    while classes:  # nested classes (BatchFit.Try) too
        owner, cls = classes.pop()
        for attribute, member in vars(cls).items():
            if attribute.startswith("_"):
                continue
            documented = member
            if isinstance(member, property):
                documented = member.fget
            elif isinstance(member, classmethod | staticmethod):
                documented = member.__func__
            elif inspect.isclass(member):
                classes.append((f"{owner}.{attribute}", member))
            elif not inspect.isfunction(member):
                continue  # a field's default, a NamedTuple's field reader
            found[f"{owner}.{attribute}"] = documented
    return found


def _raises(documented: object) -> list[str] | None:
    """The exception names of the Google-style Raises section; None where there is none."""
    # A class's own docstring, never one inherited from its base.
    doc = vars(documented).get("__doc__") if inspect.isclass(documented) else documented.__doc__
    lines = inspect.cleandoc(doc or "").splitlines()
    if "Raises:" not in lines:
        return None
    names = []
    for line in lines[lines.index("Raises:") + 1 :]:
        if line and not line.startswith(" "):  # the next section
            break
        entry = re.match(r"    ([\w.]+): \S", line)
        if entry:
            names.append(entry.group(1))
    return names


def _exception(name: str) -> object:
    """The class a Raises entry names: a builtin, a devicekit error, or a dotted name."""
    if "." in name:
        module, _, attribute = name.rpartition(".")
        return getattr(importlib.import_module(module), attribute)
    return getattr(builtins, name, None) or getattr(dk, name)


def test_every_public_callable_lists_what_it_raises_on_purpose_or_is_known_to_raise_nothing() -> (
    None
):
    found = _public_callables()
    assert {"DeviceManager.from_env", "testing.assert_on_device", "BatchFit.Try"} <= set(found)
    without = {name for name, value in found.items() if _raises(value) is None}
    assert sorted(without - RAISES_NOTHING) == []  # raises on purpose, says nothing of it
    assert sorted(RAISES_NOTHING - without) == []  # listed here, yet has a Raises section
    assert set(found) >= RAISES_NOTHING  # no name that is gone
    for name, value in found.items():
        for listed in _raises(value) or []:
            error = _exception(listed)
            assert isinstance(error, type), (name, listed)
            assert issubclass(error, BaseException), (name, listed)


def test_every_public_signature_s_annotations_evaluate() -> None:
    # autodoc shows the evaluated types; a name an annotation or an alias's string uses
    # that its module does not define (an import under TYPE_CHECKING) stays a string,
    # which the documentation's nitpicky build refuses as a reference to nothing.
    unresolved = {}
    for name, value in _public_callables().items():
        function = value.__init__ if inspect.isclass(value) else value
        if not inspect.isfunction(function) or not function.__module__.startswith("devicekit"):
            continue
        try:
            typing.get_type_hints(function)
        except NameError as error:
            unresolved[name] = str(error)
    assert unresolved == {}


def _cycle() -> list[object]:
    data: list[object] = []
    data.append(data)
    return data


def _used_up_loader() -> None:
    loader = dk.DeviceDataLoader(iter([torch.ones(1)]), "cpu")
    list(loader)
    list(loader)


def _track_a_copy() -> None:
    with dk.track_transfers(strict=True):
        torch.ones(1).to("meta")


def _from_env_naming_no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEVICEKIT_DEVICE", "gpu")
    dk.DeviceManager.from_env()


class _BadCall(NamedTuple):
    documented: str  # whose Raises section must list the error
    call: Callable[[pytest.MonkeyPatch, Path], object]  # given monkeypatch and tmp_path
    error: type[BaseException]  # exactly what it raises
    start: str  # how its message begins


_NO_DEVICE = "Expected a device such as 'cpu', "
_BAD_CALLS = [
    _BadCall(
        "to_device",
        lambda m, p: dk.to_device(torch.ones(1), "gpu"),
        dk.DeviceUnavailableError,
        _NO_DEVICE,
    ),
    _BadCall(
        "to_device",
        lambda m, p: dk.to_device(torch.ones(1), 2.5),  # type: ignore[arg-type]
        TypeError,
        "Expected a device as a torch.device",
    ),
    _BadCall(
        "DeviceManager",
        lambda m, p: dk.DeviceManager(claim=1),  # type: ignore[arg-type]
        TypeError,
        "Expected claim to be True or False",
    ),
    _BadCall(
        "DeviceManager.from_env",
        lambda m, p: _from_env_naming_no_device(m),
        dk.DeviceUnavailableError,
        "DEVICEKIT_DEVICE='gpu' cannot be used",
    ),
    _BadCall(
        "DeviceManager.from_env",
        lambda m, p: dk.DeviceManager.from_env(policy="fastest"),
        ValueError,
        "Expected policy to be one of",
    ),
    _BadCall(
        "DeviceDataLoader",
        lambda m, p: dk.DeviceDataLoader([1], "gpu"),
        dk.DeviceUnavailableError,
        _NO_DEVICE,
    ),
    _BadCall(
        "DeviceDataLoader",
        lambda m, p: _used_up_loader(),
        TypeError,
        "Expected a re-iterable loader for another epoch",
    ),
    _BadCall(
        "check_same_device",
        lambda m, p: dk.check_same_device(torch.ones(1), device="gpu"),
        dk.DeviceUnavailableError,
        _NO_DEVICE,
    ),
    _BadCall(
        "fit_batch",
        lambda m, p: dk.fit_batch(lambda size: None, device="gpu"),
        dk.DeviceUnavailableError,
        _NO_DEVICE,
    ),
    _BadCall("load", lambda m, p: dk.load(p / "missing.pt"), FileNotFoundError, "[Errno 2]"),
    _BadCall(
        "load",
        lambda m, p: dk.load(io.BytesIO(), map_location={}),  # type: ignore[arg-type]
        TypeError,
        "Expected map_location to be a device",
    ),
    _BadCall(
        "save",
        lambda m, p: dk.save({}, p / "missing" / "state.pt"),
        FileNotFoundError,
        "[Errno 2] Cannot save to",
    ),
    _BadCall(
        "materialize",
        lambda m, p: dk.materialize(torch.nn.Linear(1, 1, device="meta"), "meta"),
        ValueError,
        "Expected a device with storage",
    ),
    _BadCall(
        "unregister_transfer",
        lambda m, p: dk.unregister_transfer(int),
        KeyError,
        "'int has no transfer rule",
    ),
    _BadCall(
        "guard",
        lambda m, p: dk.guard("model"),  # type: ignore[arg-type]
        TypeError,
        "Expected a torch.nn.Module to guard",
    ),
    _BadCall(
        "track_transfers",
        lambda m, p: _track_a_copy(),
        dk.TransferError,
        "Expected no transfers between devices",
    ),
    _BadCall(
        "testing.assert_on_device",
        lambda m, p: dkt.assert_on_device(torch.ones(1), "gpu"),
        dk.DeviceUnavailableError,
        _NO_DEVICE,
    ),
    _BadCall(
        "testing.assert_same_structure",
        lambda m, p: dkt.assert_same_structure(_cycle(), _cycle()),
        dk.TransferError,
        "Expected data without reference cycles",
    ),
    _BadCall(
        "testing.batches",
        lambda m, p: dkt.batches(containers=("sets",)),
        ValueError,
        "Expected containers among",
    ),
]


@pytest.mark.parametrize(
    "case", _BAD_CALLS, ids=[f"{case.documented}-{case.error.__name__}" for case in _BAD_CALLS]
)
def test_a_bad_call_raises_an_error_its_raises_section_lists(
    case: _BadCall, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with pytest.raises(case.error, match="^" + re.escape(case.start)) as raised:
        case.call(monkeypatch, tmp_path)
    assert type(raised.value) is case.error
    listed = _raises(_public_callables()[case.documented]) or []
    # Listed by its own name or a base's (FileNotFoundError as OSError).
    names = {name.rpartition(".")[2] for name in listed}
    assert {cls.__name__ for cls in case.error.__mro__} & names, (case.documented, listed)
