"""register_transfer and unregister_transfer: what a rule applies to, and what is refused.

A rule applies to every call that starts after it is registered, in every walk and every
thread, until it is unregistered. meta is the second device on CPU machines.
"""

from __future__ import annotations

import collections
import re
import sys
import threading
import time
import typing
from collections import UserList, deque
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit._transfer import as_accelerator

from .helpers import CPU, META


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


def test_a_rule_registered_after_first_use_reaches_every_walk(bag_rule: Any) -> None:
    batch = {"bag": Bag(torch.ones(1)), "raw": Bag(torch.ones(1))}
    # First use: every walk decides that a Bag is a leaf that stays where it is.
    assert dk.find_devices(batch) == {}
    assert dk.to_device(batch, META, skip_keys={"raw"})["bag"] is batch["bag"]
    bag_rule()
    assert dk.find_devices(batch) == {CPU: ["['bag'].tensor", "['raw'].tensor"]}
    moved = dk.to_device(batch, META, skip_keys={"raw"})
    assert moved["bag"].tensor.device == META
    assert moved["raw"] is batch["raw"]
    with as_accelerator("meta"):
        assert dk.to_device([batch["bag"]] * 12, META)[0].tensor.device == META


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
    abc: type, batch: Any
) -> None:
    # The accelerator path packs a flat batch of tensors in one step: it must still ask
    # the table first, as the host path does (it took such a batch past the rule).
    seen: list[type] = []

    @dk.register_transfer(abc)
    def move_whole(obj: Any, device: torch.device, **options: Any) -> Any:
        seen.append(type(obj))
        return obj

    try:
        with as_accelerator("meta"):
            moved = dk.to_device(batch, META)
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
