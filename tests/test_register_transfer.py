"""register_transfer and unregister_transfer: what a rule applies to, and what is refused.

A rule applies to every call that starts after it is registered, in every walk and every
thread, until it is unregistered. meta is the second device on CPU machines.
"""

from __future__ import annotations

import abc
import collections
import re
import sys
import threading
import time
import typing
from collections import UserList, deque
from pathlib import Path
from typing import Any

import pytest
import torch

import devicekit as dk

from .helpers import CPU, META
from .programs import run_program


class Bag:
    """A user type holding a tensor, with no rule until a test registers one."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SmallBag(Bag):
    pass


@pytest.fixture
def bag_rule() -> Any:
    def register() -> None:
        @dk.register_transfer(Bag)
        def move_bag(bag: Bag, device: torch.device, **options: Any) -> Bag:
            return Bag(bag.tensor.to(device))

    yield register
    dk.unregister_transfer(Bag)


class Boxes:
    """A user type that moves with its own .to()."""

    def __init__(self, xyxy: torch.Tensor) -> None:
        self.xyxy = xyxy

    def to(self, device: Any, *, non_blocking: bool = False) -> Boxes:
        return Boxes(self.xyxy.to(device, non_blocking=non_blocking))


# What a rule applies to, and from when.


def test_a_rule_registered_after_first_use_reaches_every_walk(
    bag_rule: Any, stand_in_device: torch.device
) -> None:
    batch = {"bag": Bag(torch.ones(1)), "raw": Bag(torch.ones(1))}
    # First use: every walk decides that a Bag is a leaf that stays where it is.
    assert dk.find_devices(batch) == {}
    assert dk.to_device(batch, META, skip_keys={"raw"})["bag"] is batch["bag"]
    bag_rule()
    assert dk.find_devices(batch) == {CPU: ["['bag'].tensor", "['raw'].tensor"]}
    moved = dk.to_device(batch, META, skip_keys={"raw"})
    assert moved["bag"].tensor.device == META
    assert moved["raw"] is batch["raw"]
    on_accelerator = dk.to_device([batch["bag"]] * 12, stand_in_device)  # its walk too
    assert on_accelerator[0].tensor.device == stand_in_device
    assert on_accelerator[0].tensor.tolist() == [1.0]


def test_a_rule_for_an_abc_applies_to_the_builtins_it_covers() -> None:
    seen: list[type] = []

    @dk.register_transfer(collections.abc.Sequence)
    def move_sequence(obj: Any, device: torch.device, **options: Any) -> Any:
        seen.append(type(obj))
        return obj

    try:
        dk.to_device({"a": [torch.ones(1)], "b": UserList([1])}, META)
    finally:
        dk.unregister_transfer(collections.abc.Sequence)
    assert seen == [list, UserList]


@pytest.mark.parametrize(
    ("abc", "batch"),
    [
        (collections.abc.Sequence, [torch.ones(1), torch.ones(1)]),
        (collections.abc.Sequence, (torch.ones(1), torch.ones(1))),
        (collections.abc.Mapping, {"x": torch.ones(1), "y": torch.ones(1)}),
    ],
    ids=["list", "tuple", "dict"],
)
def test_a_rule_for_an_abc_takes_a_flat_batch_on_the_accelerator_path_too(
    abc: type, batch: Any, stand_in_device: torch.device
) -> None:
    # The accelerator path packs a flat batch of tensors in one step: it must still ask
    # the table first, as the host path does (it took such a batch past the rule).
    seen: list[type] = []

    @dk.register_transfer(abc)
    def move_whole(obj: Any, device: torch.device, **options: Any) -> Any:
        seen.append(type(obj))
        return obj

    try:
        moved = dk.to_device(batch, stand_in_device)
    finally:
        dk.unregister_transfer(abc)
    assert seen == [type(batch)]
    assert moved is batch


def test_a_rule_for_int_moves_numbers_until_it_is_unregistered() -> None:
    calls: list[int] = []

    @dk.register_transfer(int)
    def move_int(value: int, device: torch.device, **options: Any) -> int:
        calls.append(value)
        return value + 1

    try:
        assert dk.to_device([5, {"n": 6}], META) == [6, {"n": 7}]
        assert dk.to_device(5, META) == 6
        assert calls == [5, 6, 5]
    finally:
        dk.unregister_transfer(int)
    assert dk.to_device([5], META) == [5]


def test_a_rule_must_return_an_instance_of_the_class_it_was_registered_for() -> None:
    @dk.register_transfer(Bag)
    def move_bag(bag: Bag, device: torch.device, **options: Any) -> Any:
        return 42 if bag.tensor.numel() == 2 else Bag(bag.tensor.to(device))

    try:
        msg = (
            "Cannot move data['b']: the rule registered for Bag returned a int for the Bag "
            "there, not a Bag, so it is not the moved object."
        )
        with pytest.raises(dk.TransferError, match=re.escape(msg)):
            dk.to_device({"b": Bag(torch.ones(2))}, META)
        # A Bag for a SmallBag is what a rule for Bag may well return.
        moved = dk.to_device({"b": SmallBag(torch.ones(1))}, META)["b"]
        assert type(moved) is Bag
        assert moved.tensor.device == META
    finally:
        dk.unregister_transfer(Bag)


# Registering while other threads move data.


def test_registering_while_other_threads_move_data_raises_nothing() -> None:
    errors: list[BaseException] = []
    stop = threading.Event()

    def move() -> None:
        batch = {"a": [torch.ones(1), (torch.zeros(1), "x")], "b": deque([1])}
        try:
            while not stop.is_set():
                dk.to_device(batch, META)
        except BaseException as error:
            errors.append(error)

    class Marker:
        pass

    movers = [threading.Thread(target=move) for _ in range(2)]
    for thread in movers:
        thread.start()
    try:
        for _ in range(300):
            dk.register_transfer(Marker)(lambda obj, device, **options: obj)
            dk.unregister_transfer(Marker)
    finally:
        stop.set()
        for thread in movers:
            thread.join()
    assert errors == []


def test_a_rule_registered_while_other_threads_move_data_applies_at_once() -> None:
    # The table's decisions are made under the registry's lock: one made from the
    # registry as it was before a change can no longer be stored after it.
    stop = threading.Event()
    errors: list[BaseException] = []
    current: list[type] = [Bag]

    def move() -> None:
        try:
            while not stop.is_set():
                dk.to_device([current[0](torch.ones(1)), {"k": current[0](torch.ones(1))}], META)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=move) for _ in range(2)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads take turns often: the race has its chances
    for thread in threads:
        thread.start()
    ignored = 0
    try:
        for trial in range(1000):
            kind = type(f"Bag{trial}", (Bag,), {})
            current[0] = kind
            time.sleep(0)  # the movers meet the new type, and decide it, meanwhile
            marker = kind(torch.zeros(0))  # what the rule returns: no move makes it
            dk.register_transfer(kind)(lambda obj, device, marker=marker, **options: marker)
            ignored += dk.to_device([kind(torch.ones(1))], META)[0] is not marker
            dk.unregister_transfer(kind)
            ignored += dk.to_device([kind(torch.ones(1))], META)[0] is marker
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        sys.setswitchinterval(interval)
    assert errors == []
    assert ignored == 0


# What cannot be registered.


def test_register_transfer_refuses_what_is_not_a_user_class() -> None:
    with pytest.raises(TypeError, match=re.escape("Expected a class to register")):
        dk.register_transfer("Boxes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=re.escape("Register a tensor subclass instead.")):
        dk.register_transfer(torch.Tensor)


def test_registering_object_or_a_non_callable_or_twice_is_refused() -> None:
    msg = "Expected a type narrower than object: a rule for object would take every leaf"
    with pytest.raises(TypeError, match=re.escape(msg)):
        dk.register_transfer(object)
    msg = "Expected a function fn(obj, device, **options) to register for Boxes, got int 5."
    with pytest.raises(TypeError, match=re.escape(msg)):
        dk.register_transfer(Boxes)(5)  # type: ignore[type-var]

    @dk.register_transfer(Boxes)
    def first(obj: Boxes, device: torch.device, **options: Any) -> Boxes:
        return obj

    try:
        msg = (
            "Boxes already has a transfer rule (tests.test_register_transfer.test_registering"
            "_object_or_a_non_callable_or_twice_is_refused.<locals>.first); "
            "call devicekit.unregister_transfer(Boxes) first to replace it."
        )
        with pytest.raises(ValueError, match=re.escape(msg)):
            dk.register_transfer(Boxes)(first)
    finally:
        dk.unregister_transfer(Boxes)
    msg = "Boxes has no transfer rule to unregister."
    with pytest.raises(KeyError, match=re.escape(msg)):
        dk.unregister_transfer(Boxes)


def test_registering_typing_any_is_refused() -> None:
    refusal = re.escape("got typing.Any, which no object is an instance of")
    with pytest.raises(TypeError, match=refusal):
        dk.register_transfer(typing.Any)


# Issue 46: ABCs whose registrations come later, and ABCs whose checks raise.


def test_a_class_registered_with_an_abc_after_first_use_takes_the_abcs_rule(
    stand_in_device: torch.device,
) -> None:
    class Holder(abc.ABC):  # noqa: B024 - a marker, which classes join by register()
        """An ABC that user types join by Holder.register."""

    class Early(Bag):
        pass

    class Late(Bag):
        pass

    seen: list[type] = []

    @dk.register_transfer(Holder)
    def move_holder(obj: Any, device: torch.device, **options: Any) -> Any:
        seen.append(type(obj))
        return obj

    try:
        Holder.register(Early)
        early, late = Early(torch.ones(1)), Late(torch.ones(1))
        # First use: Late is no Holder yet, a leaf that stays; every walk learns it so.
        assert dk.to_device({"early": early, "late": late}, META) == {"early": early, "late": late}
        assert seen == [Early]
        assert dk.find_devices({"late": late}) == {}
        Holder.register(Late)  # after to_device met Late: it must be seen all the same
        seen.clear()
        dk.to_device({"late": late}, META)
        dk.to_device({"late": late, "raw": 1}, META, skip_keys={"raw"})
        dk.to_device([late] * 12, stand_in_device)  # the accelerator's walk
        assert seen == [Late, Late, Late]
        assert dk.find_devices({"late": late}) == {CPU: ["['late'].tensor"]}
    finally:
        dk.unregister_transfer(Holder)


def test_a_class_registered_as_a_mapping_after_first_use_is_walked_as_one() -> None:
    class Table:
        """A read-only mapping that joins collections.abc.Mapping by register()."""

        def __init__(self, items: dict[str, Any]) -> None:
            self.items_ = items

        def __getitem__(self, key: str) -> Any:
            return self.items_[key]

        def __iter__(self) -> Any:
            return iter(self.items_)

        def __len__(self) -> int:
            return len(self.items_)

        def items(self) -> Any:
            return self.items_.items()

    table = Table({"x": torch.ones(1)})
    assert dk.find_devices(table) == {}  # a leaf: no Mapping yet
    collections.abc.Mapping.register(Table)
    assert dk.find_devices(table) == {CPU: ["['x']"]}
    assert dk.to_device(table, META)["x"].device == META


class Broken(abc.ABC):  # noqa: B024 - only its hook matters
    """An ABC whose __subclasshook__ raises, as a hook that reads what a class lacks does."""

    @classmethod
    def __subclasshook__(cls, other: type) -> bool:
        msg = f"the hook cannot read {other.__name__}"
        raise LookupError(msg)


def test_an_abc_whose_check_raises_names_itself_only_where_it_decides(
    stand_in_device: torch.device,
) -> None:
    @dk.register_transfer(Broken)
    def move_broken(obj: Any, device: torch.device, **options: Any) -> Any:
        return obj

    try:
        # Tensors, modules, plain scalars and containers are devicekit's own: not broken.
        batch = {"x": torch.ones(1), "n": 3, "s": "a", "rows": [torch.ones(1)], "t": (None,)}
        moved = dk.to_device(batch, META)
        assert moved["x"].device == moved["rows"][0].device == META
        model = torch.nn.Linear(1, 1)
        assert dk.to_device(model, META) is model
        assert model.weight.device == META
        optimizer = torch.optim.SGD(model.parameters())
        assert dk.to_device(optimizer, META) is optimizer
        assert dk.find_devices(batch) == {CPU: ["['x']", "['rows'][0]"]}
        on_accelerator = dk.to_device([torch.ones(1)] * 12, stand_in_device)
        assert on_accelerator[0].device == stand_in_device
        assert on_accelerator[0].tolist() == [1.0]
        # A type of the user's, which the rule might take, is refused with the reason.
        refusal = (
            "Cannot move data['bag'], a tests.test_register_transfer.Bag: devicekit asks "
            "whether it is a tests.test_register_transfer.Broken, which has a transfer rule, "
            "and issubclass(Bag, Broken) raised LookupError (the cause below). Make "
            "Broken.__subclasshook__ answer for Bag, or call "
            "devicekit.unregister_transfer(Broken)."
        )
        with pytest.raises(dk.TransferError, match=re.escape(refusal)) as info:
            dk.to_device({"bag": Bag(torch.ones(1))}, META)
        assert type(info.value.__cause__) is LookupError
        assert str(info.value.__cause__) == "the hook cannot read Bag"
        # The refusal is not kept: a hook that answers later is asked again.
        raising = Broken.__dict__["__subclasshook__"]
        Broken.__subclasshook__ = classmethod(lambda cls, other: NotImplemented)  # type: ignore[method-assign,assignment]
        try:
            bag = Bag(torch.ones(1))
            assert dk.to_device({"bag": bag}, META)["bag"] is bag
        finally:
            Broken.__subclasshook__ = raising  # type: ignore[method-assign]
    finally:
        dk.unregister_transfer(Broken)


_BROKEN_MAPPING = """
import collections.abc, sys, torch
sys.path.insert(0, {root!r})
import devicekit as dk

class Odd(collections.abc.Mapping):  # its hook breaks issubclass(anything new, Mapping)
    @classmethod
    def __subclasshook__(cls, other):
        raise LookupError("the hook broke")

class Point:
    def __init__(self):
        self.x = torch.ones(1)

assert dk.to_device({{"x": torch.ones(1), "n": [1]}}, "meta")["x"].device.type == "meta"
try:
    dk.to_device({{"p": Point()}}, "meta")
except dk.TransferError as err:
    print(err)
    print(repr(err.__cause__))
"""


def test_a_mapping_subclass_whose_check_raises_is_named_not_passed_through(
    fresh_python: str,
) -> None:
    # In a fresh interpreter: such a subclass breaks every new issubclass(..., Mapping).
    root = str(Path(__file__).parent.parent)
    result = run_program([fresh_python, "-c", _BROKEN_MAPPING.format(root=root)], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    said, cause = result.stdout.splitlines()
    assert said == (
        "Cannot move data['p'], a __main__.Point: telling what kind of object it is raised "
        "LookupError (the cause below), as a failing __subclasshook__ of an abstract base "
        "class does. Fix that check, or register how to move it with "
        "@devicekit.register_transfer(Point)."
    )
    assert cause == "LookupError('the hook broke')"


def test_an_error_a_rule_raises_keeps_its_own_cause() -> None:
    # The walk re-raised it `from None`, which dropped the cause the rule gave it.
    @dk.register_transfer(Bag)
    def move_bag(bag: Bag, device: torch.device, **options: Any) -> Bag:
        try:
            {}["tensor"]
        except KeyError as err:
            msg = "the rule failed"
            raise ValueError(msg) from err
        return bag  # pragma: no cover - raised above

    try:
        with pytest.raises(ValueError, match="the rule failed") as info:
            dk.to_device({"bag": Bag(torch.ones(1))}, META)
    finally:
        dk.unregister_transfer(Bag)
    assert type(info.value.__cause__) is KeyError
    assert info.value.__notes__ == ["devicekit: raised while handling data['bag'] (Bag)."]
