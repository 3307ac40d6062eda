"""The traversal engine on its own: container rules, leaves, paths and guards."""

from __future__ import annotations

import re
from collections import namedtuple
from collections.abc import Mapping
from typing import Any, NamedTuple

import pytest

import devicekit as dk
from devicekit._tree import Walker, container_node, format_path

Pair = namedtuple("Pair", ["left", "right"])
everything_walks = Walker(lambda cls: False)


def test_leaves_come_in_map_order_with_repeats() -> None:
    shared = [1]
    data = {"a": shared, "b": (shared, "s"), "c": None}
    assert list(everything_walks.leaves(data)) == [1, 1, "s", None]


def test_leaves_with_paths_name_keys_indices_and_fields() -> None:
    data = {"image": 1, "targets": [Pair(2, {"boxes": 3})], "ids": {7}}
    assert dict(everything_walks.leaves_with_paths(data)) == {
        "['image']": 1,
        "['targets'][0].left": 2,
        "['targets'][0].right['boxes']": 3,
        "['ids']{0}": 7,
    }


def test_a_leaf_root_has_the_empty_path() -> None:
    assert list(everything_walks.leaves_with_paths(5)) == [("", 5)]


def test_the_leaf_policy_overrides_container_rules() -> None:
    tuples_are_leaves = Walker(lambda cls: issubclass(cls, tuple))
    assert tuples_are_leaves.map(lambda x: "leaf", [(1, 2), [3]]) == ["leaf", ["leaf"]]


def test_forget_types_drops_cached_decisions() -> None:
    policy: dict[str, bool] = {"tuple_is_leaf": False}
    walker = Walker(lambda cls: cls is tuple and policy["tuple_is_leaf"])
    assert walker.map(str, (1,)) == ("1",)
    policy["tuple_is_leaf"] = True
    assert walker.map(str, (1,)) == ("1",)  # still cached
    walker.forget_types()
    assert walker.map(str, (1,)) == "(1,)"


def test_container_rules_cover_the_builtin_kinds() -> None:
    for cls in (dict, list, tuple, set, frozenset, Pair):
        assert container_node(cls) is not None, cls
    for cls in (str, bytes, bytearray, int, type(None)):
        assert container_node(cls) is None, cls


def test_a_cycle_found_while_listing_leaves_names_its_path() -> None:
    loop: list[Any] = []
    loop.append({"self": loop})
    msg = "but data[0]['self'] is the list data itself, which contains it."
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        list(everything_walks.leaves(loop))


def test_long_paths_elide_their_middle() -> None:
    fragments = [f"[{i}]" for i in range(40)]
    path = format_path("data", fragments)
    assert path.startswith("data[0][1]")
    assert "...<24 more levels>..." in path
    assert path.endswith("[38][39]")


def test_a_read_only_mapping_that_cannot_be_rebuilt_is_refused() -> None:
    class Frozen(Mapping[str, Any]):
        def __init__(self, *, items: dict[str, Any]) -> None:
            self._items = items

        def __getitem__(self, key: str) -> Any:
            return self._items[key]

        def __iter__(self) -> Any:
            return iter(self._items)

        def __len__(self) -> int:
            return len(self._items)

    msg = (
        "Cannot rebuild data['x']: it is a tests.test_tree.Frozen, a read-only Mapping that "
        "cannot be built from a dict ("
    )
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        everything_walks.map(str, {"x": Frozen(items={"a": 1})})


def test_inert_leaves_pass_through_map_without_a_call() -> None:
    seen: list[Any] = []

    def record(leaf: Any) -> str:
        seen.append(leaf)
        return "mapped"

    walker = Walker(lambda cls: False, inert_types=[int, type(None)])
    assert walker.map(record, {"a": [1, "s", None], "b": 2.5}) == {
        "a": [1, "mapped", None],
        "b": "mapped",
    }
    assert seen == ["s", 2.5]
    assert list(walker.leaves({"a": [1, None]})) == [1, None]


def test_pairs_descend_only_where_both_sides_agree() -> None:
    pairs = list(everything_walks.pairs({"a": [1, 2], "b": (3,)}, {"a": [1, 5], "b": [3]}))
    assert [(path, a, b) for path, a, b in pairs[1:]] == [
        ("['a']", [1, 2], [1, 5]),
        ("['a'][0]", 1, 1),
        ("['a'][1]", 2, 5),
        ("['b']", (3,), [3]),  # a tuple and a list: reported, not descended into
    ]


def test_pairs_of_a_cycle_end_in_an_error_at_the_first_repeat() -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    msg = (
        "Expected data without reference cycles, but data[1] is the list data itself, which "
        "contains it."
    )
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        list(everything_walks.pairs(loop, [1, [1, [1]]]))
    # Two cycles that repeat together are compared once round, not refused.
    other: list[Any] = [1]
    other.append(other)
    assert len(list(everything_walks.pairs(loop, other))) == 3


@pytest.mark.parametrize("length", [63, 64, 200])  # taken whole from 64 elements on
def test_long_lists_of_leaves_or_scalars_flatten_as_element_by_element(length: int) -> None:
    walker = Walker(lambda cls: False, inert_types=[int, type(None)])
    leaves = [f"leaf {i}" for i in range(length)]  # str: a leaf this walker calls for
    scalars = list(range(length))
    mixed = [*leaves[:-1], None]  # one scalar among the leaves: walked one by one
    data = {"leaves": leaves, "scalars": tuple(scalars), "mixed": mixed, "top": [leaves]}
    flat = walker.flatten(data)
    assert flat.leaves == [*leaves, *scalars, *mixed, *leaves]
    start = 2 * length  # the scalars are not active; the leaves and the mixed ones are
    expected_active = [
        *range(length),
        *range(start, start + length - 1),
        *range(start + length, start + 2 * length),
    ]
    assert flat.active == expected_active
    renamed = [f"new {leaf}" if isinstance(leaf, str) else leaf for leaf in flat.leaves]
    rebuilt = walker.unflatten(flat.spec, renamed)
    assert rebuilt == {
        "leaves": [f"new {leaf}" for leaf in leaves],
        "scalars": tuple(scalars),
        "mixed": [*(f"new {leaf}" for leaf in leaves[:-1]), None],
        "top": [[f"new {leaf}" for leaf in leaves]],
    }
    assert type(rebuilt["scalars"]) is tuple
    alone = walker.flatten(leaves)  # a long list at the root
    assert (alone.leaves, alone.active) == (leaves, list(range(length)))
    assert walker.unflatten(alone.spec, renamed[:length]) == rebuilt["leaves"]
    # Paths are the same whichever way a list was taken.
    with_paths = walker.flatten(data, paths=True)
    assert with_paths.leaves == flat.leaves
    assert with_paths.paths is not None
    assert with_paths.paths[length - 1] == f"['leaves'][{length - 1}]"
    assert with_paths.paths[-1] == f"['top'][0][{length - 1}]"
    assert with_paths.container_paths == [
        "['leaves']",
        "['scalars']",
        "['mixed']",
        "['top'][0]",
        "['top']",
        "",
    ]
    assert walker.flatten(leaves, paths=True).paths == [f"[{i}]" for i in range(length)]


def test_paths_name_every_leaf_and_container_of_a_nested_batch() -> None:
    data = {"a": [Pair(1, {"b": (2, 3)}), []], "c": {5}, "d": 6}
    flat = everything_walks.flatten(data, paths=True)
    assert list(zip(flat.paths or [], flat.leaves, strict=True)) == [
        ("['a'][0].left", 1),
        ("['a'][0].right['b'][0]", 2),
        ("['a'][0].right['b'][1]", 3),
        ("['c']{0}", 5),
        ("['d']", 6),
    ]
    assert flat.container_paths == [
        "['a'][0].right['b']",
        "['a'][0].right",
        "['a'][0]",
        "['a'][1]",
        "['a']",
        "['c']",
        "",
    ]
    assert everything_walks.flatten(7, paths=True).paths == [""]


class Clamped(Pair):
    """A namedtuple subclass whose own __new__ changes what it is given."""

    __slots__ = ()

    def __new__(cls, left: int, right: int) -> Clamped:
        return super().__new__(cls, min(left, 9), min(right, 9))


class Typed(NamedTuple):
    left: int
    right: int = 0


@pytest.mark.parametrize("cls", [Pair, Typed, Clamped])
def test_namedtuples_are_rebuilt_as_their_own_new_would_build_them(cls: type) -> None:
    data = {"pair": cls(1, 2), "nested": [cls(3, 4)]}
    flat = everything_walks.flatten(data)
    for rebuilt in (
        everything_walks.map(lambda x: x * 10, data),
        everything_walks.unflatten(flat.spec, [x * 10 for x in flat.leaves]),
    ):
        expected = (9, 9) if cls is Clamped else (10, 20)  # Clamped's __new__ ran
        assert type(rebuilt["pair"]) is cls
        assert type(rebuilt["nested"][0]) is cls
        assert tuple(rebuilt["pair"]) == expected
        assert rebuilt["pair"]._fields == ("left", "right")
