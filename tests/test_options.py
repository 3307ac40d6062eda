"""Every option of every public call, checked one way: one rule per kind of option.

A row of :data:`OPTIONS` names a public call, one of its options and the option's kind
(a flag, "auto" or a flag, a whole number, a size), with a function that makes the call
with the option set and reads back what the option became, where that can be read. The
test runs every row with every value of :data:`VALUES` and expects what the kind's rule,
written here once more (:func:`expected`), says: the value taken, as Python's bool or int,
or the one error class and the one sentence of every option of that kind, which the
call's Raises section lists. Adding an option is one row.

``testing.stand_in`` is read through ``_start._asked``, the check it makes before it
starts anything: starting the stand-in here would change the whole test process.
"""

from __future__ import annotations

import inspect
import io
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, NamedTuple

import numpy as np
import pytest
import torch
from hypothesis.errors import InvalidArgument

import devicekit as dk
import devicekit.testing as dkt
from devicekit.testing._stand_in import _start

from .helpers import CPU, META
from .test_public_api import _public_callables, _raises

FLAG: Final = "flag"
AUTO: Final = "'auto' or a flag"
WHOLE: Final = "whole number"
SIZE: Final = "size"

UNREAD: Final[Any] = object()
"""What a row's call returns where what the option became cannot be read back."""

TAKEN: Final = "taken"

VALUES: Final = (
    True,
    False,
    np.True_,
    np.False_,
    0,
    1,
    2,
    -1,
    0.0,
    1.0,
    2.0,
    np.int64(3),
    "auto",
    "yes",
    "2KiB",
    None,
)

SIZES: Final = {"2KiB": 2048}  # the strings of VALUES that read as a size
SAID_SIZE: Final = "as a number of bytes or a size such as '8GiB', '500MB' or '1.5 GB', got"


class Option(NamedTuple):
    call: str  # the public call, as test_public_api names it
    name: str
    kind: str
    run: Callable[[Any, Path], Any]  # the call made with the option (and tmp_path): what it became
    least: int = 0  # a whole number's
    optional: bool = False  # None: not given
    refused_as: type[Exception] | None = None  # raised for every refusal, in the same words
    seen: Callable[[Any], Any] = lambda taken: taken  # what reading back shows of the value


def expected(option: Option, value: object) -> tuple[object, object]:
    """``(TAKEN, what the option becomes)``, or ``(error class, message)``: the rule of its kind."""
    name = option.name
    if value is None and option.optional:
        return TAKEN, None
    flag = isinstance(value, bool | np.bool_)
    number = None if flag or not isinstance(value, int | np.integer) else int(value)
    if option.kind in (FLAG, AUTO):
        if flag:
            return TAKEN, bool(value)
        if option.kind == AUTO and value == "auto":
            return TAKEN, "auto"
        words = "True or False" if option.kind == FLAG else "'auto', True or False"
        return TypeError, f"Expected {name} to be {words}, got {value!r}."
    if option.kind == WHOLE:
        said = f"Expected {name} to be a whole number of {option.least} or more, got"
        if number is None:
            return TypeError, f"{said} {value!r}."
        return (TAKEN, number) if number >= option.least else (ValueError, f"{said} {number}.")
    assert option.kind == SIZE
    said = f"Expected {name} {SAID_SIZE}"
    if number is not None:
        return (TAKEN, number) if number >= 0 else (ValueError, f"{said} {number}.")
    if isinstance(value, str):
        return (TAKEN, SIZES[value]) if value in SIZES else (ValueError, f"{said} {value!r}.")
    return TypeError, f"{said} {value!r}."


# The calls, each cheap: nothing iterated, started or claimed; every object made is closed.


class _Probe:
    """A leaf whose transfer rule records what to_device tells it."""


def _told_non_blocking(value: object, _: Path) -> object:
    told = []

    @dk.register_transfer(_Probe)
    def move(probe: _Probe, device: torch.device, **options: Any) -> _Probe:
        told.append(options["non_blocking"])
        return probe

    try:
        dk.to_device(_Probe(), CPU, non_blocking=value)  # type: ignore[arg-type]
    finally:
        dk.unregister_transfer(_Probe)
    return told[0]


def _copied(value: object, _: Path) -> bool:
    tensor = torch.ones(1)
    return dk.to_device(tensor, CPU, copy=value) is not tensor  # type: ignore[arg-type]


def _strict(value: object, _: Path) -> bool:
    try:
        dk.to_device([object()], CPU, strict=value)  # type: ignore[arg-type]
    except dk.TransferError:
        return True
    return False


def _loader(**options: Any) -> dk.DeviceDataLoader[Any]:
    loader = dk.DeviceDataLoader([torch.ones(1)], META, **options)
    loader.close()
    return loader


def _manager(**options: Any) -> dk.DeviceManager:
    manager = dk.DeviceManager("cpu", **options)
    manager.close()
    return manager


def _fit(**options: Any) -> dk.BatchFit:
    return dk.fit_batch(lambda size: None, device=CPU, **options)


def _fitted_to(target: object, _: Path) -> object:
    _fit(limit=8, target=target)  # the accumulation to reach it depends on more than it
    return UNREAD


def _refused_at_load(value: object, path: Path) -> bool:
    buffer = io.BytesIO()
    torch.save(torch.nn.Linear(1, 1), buffer)  # a module: a weights-only load refuses it
    buffer.seek(0)
    try:
        dk.load(buffer, CPU, weights_only=value)  # type: ignore[arg-type]
    except pickle.UnpicklingError:
        return True
    return False


def _mapped(value: object, path: Path) -> object:
    torch.save({"weight": torch.ones(2)}, path / "state.pt")
    loaded = dk.load(path / "state.pt", CPU, mmap=value)  # type: ignore[arg-type]
    assert torch.equal(loaded["weight"], torch.ones(2))
    return UNREAD


def _refused_at_save(value: object, _: Path) -> bool:
    try:
        dk.save(torch.nn.Linear(1, 1), io.BytesIO(), weights_only=value)  # type: ignore[arg-type]
    except ValueError as refused:
        return "weights-only load" in str(refused)
    return False


def _guarded_layers(value: object, _: Path) -> bool:
    model = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Linear(1, 1))
    with dk.guard(model, recurse=value) as each:  # type: ignore[arg-type]
        layers = len(each._handles)
    with dk.guard(model) as once:
        return layers > len(once._handles)  # each layer's, not the Sequential's alone


def _strict_tracking(value: object, _: Path) -> bool:
    try:
        with dk.track_transfers(strict=value):  # type: ignore[arg-type]
            torch.ones(1).to("meta")
    except dk.TransferError:
        return True
    return False


def _validated(strategy: Any) -> object:
    strategy.validate()  # Hypothesis checks its own arguments here, at the first draw
    return UNREAD


OPTIONS: Final = [
    Option("to_device", "non_blocking", AUTO, _told_non_blocking, seen=lambda v: v is True),
    Option("to_device", "copy", FLAG, _copied),
    Option("to_device", "strict", FLAG, _strict),
    Option("DeviceDataLoader", "pin_memory", AUTO, lambda v, p: _loader(pin_memory=v)._pin_memory),
    Option(
        "DeviceDataLoader",
        "non_blocking",
        AUTO,
        lambda v, p: _loader(non_blocking=v)._non_blocking,
    ),
    Option("DeviceDataLoader", "prefetch", WHOLE, lambda v, p: _loader(prefetch=v)._prefetch),
    Option(
        "DeviceDataLoader",
        "pin_memory_limit",
        SIZE,
        lambda v, p: _loader(pin_memory_limit=v)._pin_memory_limit,
        optional=True,
    ),
    Option("DeviceManager", "claim", FLAG, lambda v, p: _manager(claim=v)._claiming),
    Option(
        "DeviceManager",
        "min_free_memory",
        SIZE,
        lambda v, p: _manager(min_free_memory=v)._request.min_free,
        optional=True,
    ),
    Option("fit_batch", "start", WHOLE, lambda v, p: _fit(start=v).tries[0].batch_size, least=1),
    Option(
        "fit_batch",
        "limit",
        WHOLE,
        lambda v, p: _fit(start=1, limit=v).batch_size,
        least=1,
        optional=True,
        seen=lambda limit: 2**20 if limit is None else limit,  # the CPU's, where none is given
    ),
    Option(
        "fit_batch",
        "target",
        WHOLE,
        _fitted_to,
        least=1,
        optional=True,
    ),
    Option("load", "weights_only", FLAG, _refused_at_load),
    Option("load", "mmap", FLAG, _mapped, optional=True),
    Option("save", "weights_only", FLAG, _refused_at_save),
    Option("guard", "recurse", FLAG, _guarded_layers),
    Option("track_transfers", "strict", FLAG, _strict_tracking),
    Option(
        "testing.devices",
        "meta",
        FLAG,
        lambda v, p: _validated(dkt.devices(meta=v)),
        refused_as=InvalidArgument,
    ),
    Option(
        "testing.devices",
        "host",
        FLAG,
        lambda v, p: _validated(dkt.devices(host=v)),
        refused_as=InvalidArgument,
    ),
    Option(
        "testing.batches",
        "max_leaves",
        WHOLE,
        lambda v, p: _validated(dkt.batches(max_leaves=v)),
        least=1,
        refused_as=InvalidArgument,
    ),
    Option(
        "testing.stand_in", "devices", WHOLE, lambda v, p: _start._asked(v, None).count, least=1
    ),
    Option(
        "testing.stand_in",
        "memory",
        SIZE,
        lambda v, p: _start._asked(2, v).capacity,
        optional=True,
    ),
]


@pytest.mark.parametrize("value", VALUES, ids=repr)
@pytest.mark.parametrize("option", OPTIONS, ids=lambda option: f"{option.call}-{option.name}")
def test_an_option_takes_what_its_kind_takes_and_refuses_the_rest_in_its_kind_s_words(
    option: Option, value: object, tmp_path: Path
) -> None:
    outcome, said = expected(option, value)
    if outcome is TAKEN:
        got = option.run(value, tmp_path)
        if got is not UNREAD:
            wanted = option.seen(said)
            assert got == wanted
            assert type(got) is type(wanted)  # Python's bool and int, never numpy's
        return
    assert isinstance(outcome, type)
    assert isinstance(said, str)
    error = option.refused_as or outcome
    with pytest.raises(error) as refused:
        option.run(value, tmp_path)
    assert type(refused.value) is error
    assert str(refused.value) == said
    listed = {name.rpartition(".")[2] for name in _raises(_public_callables()[option.call]) or []}
    assert error.__name__ in listed, (option.call, listed)


_POSITIONAL_OPTIONS: Final = {"testing.stand_in": {"devices"}}  # options given by position


def test_every_public_option_of_a_checked_kind_has_a_row() -> None:
    # The options of these kinds, by their annotations: a new flag, count or size of a
    # public call that has no row fails here, with its name.
    kinds = {"bool", "bool | None", "PinMemory", "NonBlocking"}  # flags, "auto" or flags
    kinds |= {"int", "int | None", "int | str | None"}  # whole numbers, sizes
    found = set()
    for call, value in _public_callables().items():
        function = value.__init__ if isinstance(value, type) else value  # type: ignore[misc]
        try:
            parameters = inspect.signature(function).parameters.values()
        except (TypeError, ValueError):  # a builtin's
            continue
        for parameter in parameters:
            keyword = parameter.kind is parameter.KEYWORD_ONLY and parameter.annotation in kinds
            positional = parameter.name in _POSITIONAL_OPTIONS.get(call, ())
            if keyword or positional:
                found.add((call, parameter.name))
    assert found - {(option.call, option.name) for option in OPTIONS} == set()
