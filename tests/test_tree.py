"""The traversal engine on its own: flatten, unflatten, the two maps, paths and guards."""

from __future__ import annotations

import functools
import re
from collections import OrderedDict, namedtuple
from collections.abc import Mapping
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import devicekit as dk
from devicekit._core import _tree
from devicekit._core._kinds import MOVE, READ
from devicekit._core._nodes import LIST, container_node
from devicekit.testing import assert_batches_equal, batches

from .helpers import CPU, META

Pair = namedtuple("Pair", ["left", "right"])


class Token:
    """A leaf that is not a plain scalar: the maps call their function on it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Token) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"Token({self.name!r})"


def renamed(token: Token, state: object = None) -> Token:
    return Token(f"new {token.name}")


def each(fn: Any) -> Any:
    """``fn`` in the list form map_flat calls: the leaves, with ``fn`` at ``active``."""

    def move_all(leaves: list[Any], active: list[int], state: Any) -> list[Any]:
        moved = list(leaves)
        for index in active:
            moved[index] = fn(leaves[index], state)
        return moved

    return move_all


def test_leaves_come_in_walk_order_with_repeats() -> None:
    shared = [1]
    data = {"a": shared, "b": (shared, "s"), "c": None}
    assert _tree.flatten(data).leaves == [1, 1, "s", None]


def test_paths_name_keys_indices_and_fields() -> None:
    data = {"image": 1, "targets": [Pair(2, {"boxes": 3})], "ids": {7}}
    flat = _tree.flatten(data)
    assert dict(zip(_tree.paths(flat)[0], flat.leaves, strict=True)) == {
        "['image']": 1,
        "['targets'][0].left": 2,
        "['targets'][0].right['boxes']": 3,
        "['ids']{0}": 7,
    }


def test_a_leaf_root_has_the_empty_path() -> None:
    assert _tree.paths(_tree.flatten(5)) == ([""], [])


def test_container_rules_cover_the_builtin_kinds() -> None:
    for cls in (dict, list, tuple, set, frozenset, Pair, OrderedDict):
        assert container_node(cls) is not None, cls
    for cls in (str, bytes, bytearray, int, type(None)):
        assert container_node(cls) is None, cls


def test_a_cycle_found_while_flattening_names_its_path() -> None:
    loop: list[Any] = []
    loop.append({"self": loop})
    msg = "but data[0]['self'] is the list data itself, which contains it."
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        _tree.flatten(loop)
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        _tree.map_leaves(renamed, loop)


def test_long_paths_elide_their_middle() -> None:
    fragments = [f"[{i}]" for i in range(40)]
    path = _tree.format_path("data", fragments)
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
        _tree.map_leaves(renamed, {"x": Frozen(items={"a": Token("t")})})
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        _tree.map_flat(each(renamed), {"x": Frozen(items={"a": Token("t")})})


def test_inert_leaves_pass_through_without_a_call() -> None:
    seen: list[Any] = []

    def record(leaf: Any, state: object) -> str:
        seen.append(leaf)
        return "mapped"

    data = {"a": [1, Token("t"), None], "b": "s", "c": 2.5}
    expected = {"a": [1, "mapped", None], "b": "s", "c": 2.5}
    assert _tree.map_leaves(record, data) == expected
    assert _tree.map_flat(each(record), data) == expected
    assert seen == [Token("t"), Token("t")]
    flat = _tree.flatten(data)
    assert flat.leaves == [1, Token("t"), None, "s", 2.5]
    assert flat.active == [1]


@pytest.mark.parametrize("length", [63, 64, 200])  # taken whole from 64 elements on
def test_long_lists_of_leaves_or_scalars_flatten_as_element_by_element(length: int) -> None:
    leaves = [Token(f"leaf {i}") for i in range(length)]
    scalars = tuple(range(length))
    mixed = [*leaves[:-1], None]  # one scalar among the leaves: walked one by one
    data = {"leaves": leaves, "scalars": scalars, "mixed": mixed, "top": [leaves]}
    flat = _tree.flatten(data)
    whole = length >= 64  # a long run of scalars is one inert leaf, never looked at again
    shown = [scalars] if whole else [*scalars]
    assert flat.leaves == [*leaves, *shown, *mixed, *leaves]
    start = length + len(shown)  # the scalars are not active; the leaves and the mixed ones are
    assert flat.active == [
        *range(length),
        *range(start, start + length - 1),
        *range(start + length, start + 2 * length),
    ]
    new = [renamed(leaf) if isinstance(leaf, Token) else leaf for leaf in flat.leaves]
    rebuilt = _tree.unflatten(flat.spec, new)
    assert _tree.map_flat(each(renamed), data) == rebuilt
    assert rebuilt == {
        "leaves": [renamed(leaf) for leaf in leaves],
        "scalars": scalars,
        "mixed": [*(renamed(leaf) for leaf in leaves[:-1]), None],
        "top": [[renamed(leaf) for leaf in leaves]],
    }
    assert type(rebuilt["scalars"]) is tuple
    assert _tree.map_leaves(renamed, data) == rebuilt
    alone = _tree.flatten(leaves)  # a long list at the root
    assert (alone.leaves, alone.active) == (leaves, list(range(length)))
    leaf_paths, container_paths = _tree.paths(flat)
    assert leaf_paths[length - 1] == f"['leaves'][{length - 1}]"
    assert leaf_paths[length] == ("['scalars']" if whole else "['scalars'][0]")
    assert leaf_paths[-1] == f"['top'][0][{length - 1}]"
    assert container_paths == [
        "['leaves']",
        *([] if whole else ["['scalars']"]),
        "['mixed']",
        "['top'][0]",
        "['top']",
        "",
    ]
    assert _tree.paths(alone)[0] == [f"[{i}]" for i in range(length)]


def test_a_long_list_of_scalars_is_taken_whole_not_element_by_element() -> None:
    ids = list(range(100_000))
    flat = _tree.flatten({"ids": ids, "t": torch.ones(1)})
    assert flat.leaves[0] == ids  # one inert leaf: a copy, as the list a move makes
    assert flat.leaves[0] is not ids
    assert flat.active == [1]  # only the tensor is looked at again
    assert len(flat.spec) == 1  # the dict alone
    moved = dk.to_device({"ids": ids, "more": [*ids[:100], torch.ones(1)]}, META)
    assert moved["ids"] == ids
    assert moved["ids"] is not ids
    assert moved["more"][-1].device == META  # a tensor at the end is still found


def test_the_checks_on_a_long_list_of_scalars_name_only_the_tensors() -> None:
    # The checks walk as to_device does: the list is one leaf, not a million paths.
    batch = {"ids": list(range(10**6)), "x": torch.ones(1, device=META)}
    assert dk.find_devices(batch) == {META: ["['x']"]}
    dk.check_same_device(batch)
    nested = {"ids": [list(range(100)), torch.ones(1)], "x": torch.ones(1, device=META)}
    assert dk.find_devices(nested) == {CPU: ["['ids'][1]"], META: ["['x']"]}


def test_paths_name_every_leaf_and_container_of_a_nested_batch() -> None:
    data = {"a": [Pair(1, {"b": (2, 3)}), []], "c": {5}, "d": 6}
    flat = _tree.flatten(data)
    leaf_paths, container_paths = _tree.paths(flat)
    assert list(zip(leaf_paths, flat.leaves, strict=True)) == [
        ("['a'][0].left", 1),
        ("['a'][0].right['b'][0]", 2),
        ("['a'][0].right['b'][1]", 3),
        ("['c']{0}", 5),
        ("['d']", 6),
    ]
    assert container_paths == [
        "['a'][0].right['b']",
        "['a'][0].right",
        "['a'][0]",
        "['a'][1]",
        "['a']",
        "['c']",
        "",
    ]


class Scaled(Pair):
    """A namedtuple subclass whose own __new__ changes what it is given."""

    __slots__ = ()

    def __new__(cls, left: Any, right: int) -> Scaled:
        return super().__new__(cls, left, right * 10)


class Typed(NamedTuple):
    left: Any
    right: Any = 0


@pytest.mark.parametrize("cls", [Pair, Typed, Scaled])
def test_namedtuples_are_rebuilt_without_running_their_new_again(cls: type) -> None:
    data = {"pair": cls(Token("a"), 2), "nested": [cls(Token("c"), 4)]}
    made = data["pair"]
    flat = _tree.flatten(data)
    new = [renamed(leaf) if isinstance(leaf, Token) else leaf for leaf in flat.leaves]
    for rebuilt in (_tree.map_leaves(renamed, data), _tree.unflatten(flat.spec, new)):
        assert type(rebuilt["pair"]) is cls
        assert type(rebuilt["nested"][0]) is cls
        assert tuple(rebuilt["pair"]) == (renamed(made[0]), made[1])
        assert rebuilt["nested"][0][1] == data["nested"][0][1]  # not scaled twice
        assert rebuilt["pair"]._fields == ("left", "right")


def test_scaled_namedtuples_keep_their_values_through_to_device() -> None:
    scaled = Scaled(torch.ones(1), 3)  # __new__ made the 30
    moved = dk.to_device({"s": scaled}, "meta")["s"]
    assert type(moved) is Scaled
    assert moved[1] == 30  # the numbers __new__ produced, not 300


def test_the_read_view_reaches_into_modules_and_the_move_view_does_not() -> None:
    model = torch.nn.Linear(2, 1)
    assert _tree.flatten({"m": model}, view=MOVE).leaves == [model]
    flat = _tree.flatten({"m": model}, view=READ)
    assert _tree.paths(flat)[0] == ["['m'].weight", "['m'].bias"]
    assert flat.leaves == [model.weight, model.bias]


def test_skipped_keys_are_inert_leaves_of_the_walk() -> None:
    raw = [Token("kept")]
    flat = _tree.flatten({"raw": raw, "x": Token("moved")}, skip=frozenset({"raw"}))
    assert flat.active == [1]  # only "x": the skipped value is one inert leaf
    assert _tree.map_leaves(renamed, {"raw": raw, "x": Token("t")}, skip=frozenset({"raw"})) == {
        "raw": raw,
        "x": Token("new t"),
    }
    rebuilt = _tree.map_flat(each(renamed), {"raw": raw, "x": Token("t")}, skip=frozenset({"raw"}))
    assert rebuilt["raw"] is raw


def test_errors_in_the_leaf_function_gain_the_leaf_path_on_both_maps() -> None:
    def fail(token: Token, state: object) -> Token:
        if token.name == "bad":
            msg = "boom"
            raise ValueError(msg)
        return token

    data = {"ok": [Token("fine")], "deep": [(Token("bad"),)]}
    for walk, fn in ((_tree.map_leaves, fail), (_tree.map_flat, each(fail))):
        with pytest.raises(ValueError, match="boom") as info:
            walk(fn, data)
        assert info.value.__notes__ == [
            "devicekit: raised while handling data['deep'][0][0] (Token)."
        ]


def _tagged(leaf: Any) -> Any:
    return ("moved", leaf) if isinstance(leaf, torch.Tensor) else leaf


@given(batches(), st.sampled_from(["tensor+1", "tagged"]))
def test_the_fused_map_equals_flatten_map_unflatten(batch: Any, how: str) -> None:
    calls: list[list[Any]] = [[], [], []]

    def fn(number: int) -> Any:
        def apply(leaf: Any, state: object) -> Any:
            calls[number].append(leaf)
            if how == "tagged":
                return _tagged(leaf)
            return leaf + 1 if isinstance(leaf, torch.Tensor) else leaf

        return apply

    fused = _tree.map_leaves(fn(0), batch)
    listed = _tree.map_flat(each(fn(1)), batch)
    flat = _tree.flatten(batch)
    by_hand = list(flat.leaves)
    for index in flat.active:
        by_hand[index] = fn(2)(flat.leaves[index], None)
    unflattened = _tree.unflatten(flat.spec, by_hand)
    assert [id(leaf) for leaf in calls[0]] == [id(leaf) for leaf in calls[1]]
    assert [id(leaf) for leaf in calls[0]] == [id(leaf) for leaf in calls[2]]
    if how == "tensor+1":
        assert_batches_equal(fused, unflattened)
        assert_batches_equal(listed, unflattened)
    else:
        assert repr(fused) == repr(unflattened) == repr(listed)


def test_unflatten_rebuilds_lists_inline_and_keeps_their_identity_apart() -> None:
    data = [[Token("a")], [Token("b")]]
    flat = _tree.flatten(data)
    assert flat.spec[0][1] is LIST
    rebuilt = _tree.unflatten(flat.spec, flat.leaves)
    assert rebuilt == data
    assert rebuilt[0] is not data[0]


def test_walk_goes_in_pickle_s_order_with_flatten_s_paths() -> None:
    Point = namedtuple("Point", ["x", "y"])
    data = {"a": [1, (2, "x")], "p": Point([3], {"k": 4}), "e": [], "s": "text"}
    leaf_paths, container_paths = _tree.paths(_tree.flatten(data))
    in_move_view = functools.partial(_tree.contents, view=MOVE)
    walked = [
        ("".join(map(str, _tree.keys_of(path))), value)
        for path, value in _tree.walk(data, expand=in_move_view)
    ]
    assert sorted(path for path, _ in walked) == sorted(leaf_paths + container_paths)
    assert [path for path, _ in walked] == [
        "", "['a']", "['a'][0]", "['a'][1]", "['a'][1][0]", "['a'][1][1]", "['p']", "['p'].x",
        "['p'].x[0]", "['p'].y", "['p'].y['k']", "['e']", "['s']",
    ]  # fmt: skip
    path = next(path for path, value in _tree.walk(data) if value == 4)
    *_, outer, inner = _tree.keys_of(path)
    assert (str(outer), str(inner)) == (".y", "['k']")
    assert inner.get(outer.get(data["p"])) == 4  # read again: an attribute, then an item
