"""devicekit.testing: its strategies cover every container kind, its assertions say where."""

from __future__ import annotations

import collections
import re
import subprocess
import sys
import traceback
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument, NoSuchExample, Unsatisfiable

import devicekit as dk
from devicekit.testing import (
    CONTAINER_KINDS,
    FrozenRecord,
    Pair,
    Record,
    _assertions,
    assert_batches_equal,
    assert_on_device,
    assert_same_structure,
    batches,
    devices,
    tensors,
)

from .helpers import tensor_leaves

KIND_TYPES: dict[str, type] = {
    "dict": dict,
    "OrderedDict": collections.OrderedDict,
    "defaultdict": collections.defaultdict,
    "list": list,
    "tuple": tuple,
    "namedtuple": Pair,
    "dataclass": Record,
    "frozen dataclass": FrozenRecord,
}


def _kinds(batch: Any) -> set[type]:
    found = {type(batch)}
    if isinstance(batch, dict):
        children = list(batch.values())
    elif isinstance(batch, list | tuple):
        children = list(batch)
    elif isinstance(batch, Record | FrozenRecord):
        children = [batch.features, batch.target]
    else:
        return found
    for child in children:
        found |= _kinds(child)
    return found


@pytest.mark.parametrize("kind", CONTAINER_KINDS)
def test_batches_generate_every_container_kind(kind: str) -> None:
    batch = find(
        batches(), lambda b: KIND_TYPES[kind] in _kinds(b), settings=settings(max_examples=2000)
    )
    assert KIND_TYPES[kind] in _kinds(batch)


@given(batches(containers=("list",), dtypes=(torch.int8, torch.float64)))
def test_batches_keep_to_the_kinds_and_dtypes_asked_for(batch: Any) -> None:
    assert _kinds(batch) <= {list, torch.Tensor, type(None), int, str, bool}
    for tensor in tensor_leaves(batch):
        assert tensor.dtype in (torch.int8, torch.float64)
        assert tensor.device == torch.device("cpu")


@given(batches(containers="list"))
def test_a_container_kind_named_alone_is_one_kind(batch: Any) -> None:
    assert _kinds(batch) <= {list, torch.Tensor, type(None), int, str, bool}


def test_batches_draw_every_dtype_asked_for() -> None:
    wanted = (torch.int8, torch.float64, torch.bool)
    for dtype in wanted:
        batch = find(
            batches(dtypes=wanted),
            lambda b, dtype=dtype: any(t.dtype == dtype for t in tensor_leaves(b)),
            settings=settings(max_examples=2000),
        )
        assert any(t.dtype == dtype for t in tensor_leaves(batch))


def test_an_unknown_container_kind_is_refused() -> None:
    msg = "Expected containers among ('dict', 'OrderedDict', 'defaultdict', 'list', 'tuple'"
    with pytest.raises(ValueError, match=re.escape(msg)):
        batches(containers=("set",))


def test_devices_are_the_cpu_meta_and_the_accelerators_torch_sees() -> None:
    # The expectation comes from torch itself, not from devicekit's own listing.
    expected = {torch.device("cpu"), torch.device("meta")}
    expected |= {torch.device("cuda", i) for i in range(torch.cuda.device_count())}
    if torch.backends.mps.is_available():
        expected.add(torch.device("mps", 0))
    found: set[torch.device] = set()
    while True:  # every device the strategy can draw, until it has no other
        try:
            found.add(
                find(devices(), lambda d: d not in found, settings=settings(max_examples=500))
            )
        except NoSuchExample:  # noqa: PERF203 - how the search ends
            break
    assert found == expected
    with pytest.raises(NoSuchExample):
        find(devices(meta=False), lambda d: d.type == "meta")


def test_devices_can_be_asked_for_accelerators_only() -> None:
    if torch.cuda.is_available():
        assert find(devices(host=False), lambda d: True).type == "cuda"
    else:
        with pytest.raises(Unsatisfiable):  # it draws nothing: no accelerator here
            find(devices(host=False), lambda d: True, settings=settings(max_examples=10))


@given(batches(), devices())
def test_moving_there_and_back_keeps_every_value(batch: Any, device: torch.device) -> None:
    moved = dk.to_device(batch, device)
    assert_on_device(moved, device)
    assert_same_structure(moved, batch)
    if device.type != "meta":
        assert_batches_equal(dk.to_device(moved, "cpu"), batch)


@given(tensors(dtypes=(torch.float16,), shapes=st.just((2, 1))))
def test_tensors_follow_their_arguments(tensor: torch.Tensor) -> None:
    assert tensor.dtype == torch.float16
    assert tensor.shape == (2, 1)


@given(tensors(shapes=(2, 3)))
def test_a_shape_given_as_a_tuple_is_that_shape(tensor: torch.Tensor) -> None:
    assert tensor.shape == (2, 3)


@pytest.mark.parametrize(
    ("check", "actual", "expected", "message"),
    [
        (
            assert_same_structure,
            {"a": [1]},
            {"a": (1,)},
            "data['a']: expected a tuple, got a list.",
        ),
        (assert_same_structure, {"a": 1}, {"b": 1}, "data: expected keys ['b'], got ['a']."),
        (
            assert_same_structure,
            [torch.ones(2)],
            [torch.ones(3)],
            (
                "data[0]: expected a torch.float32 tensor of shape (3,), got torch.float32 of "
                "shape (2,)."
            ),
        ),
        (
            assert_batches_equal,
            Pair(torch.ones(1), "x"),
            Pair(torch.zeros(1), "x"),
            "data.first: values differ: expected [0.0], got [1.0].",
        ),
        (
            assert_batches_equal,
            Record(1, "a"),
            Record(1, "b"),
            "data.target: expected 'b', got 'a'.",
        ),
    ],
)
def test_assertions_name_the_first_difference(
    check: Any, actual: Any, expected: Any, message: str
) -> None:
    with pytest.raises(AssertionError, match=re.escape(message)):
        check(actual, expected)


def test_meta_tensors_compare_by_shape_and_dtype() -> None:
    assert_batches_equal([torch.ones(2, device="meta")], [torch.zeros(2)])


def test_assert_on_device_names_what_is_elsewhere() -> None:
    msg = "Expected every tensor on meta, but cpu has ['x'][1]."
    with pytest.raises(AssertionError, match=re.escape(msg)):
        assert_on_device({"x": [torch.ones(1, device="meta"), torch.ones(1)]}, "meta")


# A user's first day: the assertions compare as Python and the user's own types do,
# and a strategy given bad arguments says so when it is made.


def test_dicts_compare_in_any_order_and_ordered_dicts_do_not() -> None:
    assert_batches_equal({"a": torch.ones(1), "b": 2}, {"b": 2, "a": torch.ones(1)})
    assert_same_structure({"a": 1, "b": 2}, {"b": 2, "a": 1})
    msg = "data: expected keys ['b', 'a'], got ['a', 'b']."
    with pytest.raises(AssertionError, match=re.escape(msg)):
        assert_batches_equal(collections.OrderedDict(a=1, b=2), collections.OrderedDict(b=2, a=1))
    with pytest.raises(AssertionError, match=re.escape("data: expected keys ['a', 'c']")):
        assert_batches_equal({"a": 1, "b": 2}, {"a": 1, "c": 2})


def test_batches_equal_takes_nan_for_nan_equal_refuses_cycles_and_takes_deques() -> None:
    nan = torch.tensor([float("nan"), 1.0])
    assert_batches_equal([nan.clone()], [nan.clone()])
    left: list[Any] = [torch.ones(1)]
    left.append(left)
    right: list[Any] = [torch.ones(1)]
    right.append(right)
    # Compared as to_device walks them: a batch with a cycle is not one it can move.
    msg = "Expected data without reference cycles, but data[1] is the list data itself"
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        assert_batches_equal(left, right)
    assert_batches_equal(collections.deque([torch.ones(2)]), collections.deque([torch.ones(2)]))
    with pytest.raises(AssertionError, match=re.escape("data[0]: values differ")):
        assert_batches_equal([torch.tensor([1.0])], [torch.tensor([float("nan")])])


def test_large_tensors_that_differ_are_described_by_their_first_differences_and_a_count() -> None:
    expected = torch.zeros(5_000_000)
    actual = expected.clone()
    actual[4_999_999] = 1.0
    msg = (
        "data['x']: values differ at 1 of 5,000,000 elements (the largest absolute "
        "difference 1.0): at [4999999] expected 0.0, got 1.0."
    )
    with pytest.raises(AssertionError, match=re.escape(msg)) as raised:
        assert_batches_equal({"x": actual}, {"x": expected})
    assert len(str(raised.value)) < 2_000  # not 50 MB of values
    labels = torch.full((1_000, 5_000), -128, dtype=torch.int8)
    msg = (
        "data: values differ at 5,000,000 of 5,000,000 elements (the largest absolute "
        "difference 255.0); the first 3: at [0, 0] expected -128, got 127; at [0, 1] "
        "expected -128, got 127; at [0, 2] expected -128, got 127."
    )
    with pytest.raises(AssertionError, match=re.escape(msg)):
        assert_batches_equal(torch.full_like(labels, 127), labels)  # no int8 overflow


def _sparse(values: list[float]) -> torch.Tensor:
    return torch.sparse_coo_tensor([[0, 2]], values, (3,), check_invariants=True)


def test_sparse_tensors_compare_by_the_values_they_stand_for() -> None:
    assert_batches_equal({"s": _sparse([1.0, 2.0])}, {"s": _sparse([1.0, 2.0]).coalesce()})
    msg = "data['s']: values differ: expected [2.0, 0.0, 4.0], got [1.0, 0.0, 2.0]."
    with pytest.raises(AssertionError, match=re.escape(msg)):
        assert_batches_equal({"s": _sparse([1.0, 2.0])}, {"s": _sparse([2.0, 4.0])})
    msg = "data['s']: expected a sparse_coo torch.float32 tensor of shape (3,), got strided"
    with pytest.raises(AssertionError, match=re.escape(msg)):
        assert_batches_equal({"s": torch.zeros(3)}, {"s": _sparse([1.0, 2.0])})


def test_numpy_arrays_compare_by_shape_dtype_and_values() -> None:
    array = np.array([1.0, np.nan])
    assert_batches_equal({"a": array}, {"a": array.copy()})  # NaN equals NaN, as for tensors
    for other in (np.array([1.0, 2.0]), np.array([1.0, np.nan], dtype=np.float32)):
        with pytest.raises(AssertionError, match=re.escape("data['a']: expected array(")):
            assert_batches_equal({"a": other}, {"a": array})


def test_sets_of_tensors_compare_member_by_member_in_any_order() -> None:
    members = {torch.ones(2), torch.zeros(3)}
    assert_same_structure(dk.to_device(members, "meta"), members)
    assert_batches_equal(dk.to_device(members, "cpu", copy=True), members)
    msg = "data: expected a member like tensor([0., 0.]), found none among {tensor([1., 1.])}."
    with pytest.raises(AssertionError, match=re.escape(msg)):
        assert_batches_equal({torch.ones(2)}, {torch.zeros(2)})
    with pytest.raises(AssertionError, match=re.escape("data: expected 2 members, got 1.")):
        assert_same_structure({torch.ones(2)}, members)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: tensors(dtypes=["float32"]), "Expected dtypes to be a non-empty sequence"),
        (lambda: tensors(dtypes=[]), "Expected dtypes to be a non-empty sequence"),
        (lambda: tensors(shapes=(2, -1)), "got tuple (2, -1)."),
        (lambda: tensors(shapes=[2, 3]), "got list [2, 3]."),
        (lambda: batches(max_leaves=0), "Expected max_leaves to be a whole number of 1 or more"),
        (lambda: batches(leaves=3), "Expected leaves to be a Hypothesis strategy"),
        (lambda: batches(leaves=st.none(), dtypes=[1]), "Expected dtypes to be a non-empty"),
        (lambda: devices(meta="yes"), "Expected meta to be True or False, got 'yes'."),
    ],
)
def test_bad_strategy_arguments_fail_when_the_strategy_is_made(make: Any, message: str) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        make()  # nothing drawn: the mistake is where the strategy is written


def test_the_assertions_import_and_work_without_hypothesis(fresh_python: str) -> None:
    code = (
        "import sys\n"
        "class NoHypothesis:\n"
        "    def find_spec(self, name, *args):\n"
        "        if name.split('.')[0] == 'hypothesis':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NoHypothesis())\n"
        "import torch\n"
        "from devicekit.testing import assert_batches_equal, assert_same_structure\n"
        "assert_batches_equal({'x': torch.ones(2)}, {'x': torch.ones(2)})\n"
        "import devicekit.testing\n"
        "try:\n"
        "    devicekit.testing.batches\n"
        "except ModuleNotFoundError as err:\n"
        "    print(err)\n"
    )
    result = subprocess.run([fresh_python, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(
        "devicekit.testing.batches is a Hypothesis strategy and needs Hypothesis"
    )


def test_objects_that_move_themselves_compare_by_what_they_hold() -> None:
    sequences = [torch.ones(3, 2), torch.zeros(2, 2)]
    packed = torch.nn.utils.rnn.pack_sequence(sequences, enforce_sorted=False)
    assert_batches_equal(torch.nn.utils.rnn.pack_sequence(sequences, enforce_sorted=False), packed)
    other = torch.nn.utils.rnn.pack_sequence([torch.ones(3, 2), torch.ones(2, 2)], False)
    with pytest.raises(AssertionError, match=re.escape("data.data: values differ")):
        assert_batches_equal(other, packed)


def test_sets_of_equal_tensors_match_without_pairwise_comparisons(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    comparisons: list[object] = []
    comparison = _assertions._comparison
    monkeypatch.setattr(
        _assertions, "_comparison", lambda *a, **k: comparisons.append(a) or comparison(*a, **k)
    )
    members = {torch.full((2,), float(i)) for i in range(2000)}
    moved = {tensor.clone() for tensor in members}  # new objects: tensors hash by identity
    assert_batches_equal(moved, members)
    assert len(comparisons) == 1  # the sets' own: members matched by digest, in linear time
    nan = torch.tensor([float("nan")])
    assert_batches_equal({nan.clone()}, {nan})  # NaN equals NaN here, as elsewhere


def test_sets_nested_in_sets_compare_without_recursion_and_say_so_briefly() -> None:
    def nested(leaf: torch.Tensor, depth: int) -> frozenset[Any]:
        found = frozenset({leaf})
        for _ in range(depth):
            found = frozenset({found, "x"})
        return found

    expected = nested(torch.ones(1), 300)
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(len(traceback.extract_stack()) + 60)  # recursion would fail
    try:
        assert_batches_equal(nested(torch.ones(1), 300), expected)  # members: new tensors
        with pytest.raises(
            AssertionError, match=re.escape("data: expected a member like")
        ) as raised:
            assert_batches_equal(nested(torch.zeros(1), 300), expected)
    finally:
        sys.setrecursionlimit(before)
    assert "frozenset({...}" in str(raised.value)
    assert len(str(raised.value)) < 500
