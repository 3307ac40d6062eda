"""The one traversal engine: how devicekit takes nested data apart and puts it back together.

Every walk over user data goes through this module, with the per-type decisions of
:mod:`devicekit._kinds` (one of its views: MOVE, CAST or READ). It offers:

* :func:`flatten` and :func:`unflatten`: the leaves in walk order, and the containers
  rebuilt around new ones; :func:`paths` names them (``['image']``, ``[3].boxes``),
  worked out only when asked for, for messages and the checks;
* :func:`map_flat`: flatten, a function on each leaf (after an optional look at all of
  them: the packing of small tensors), unflatten, in one call;
* :func:`map_leaves`: the same result in one fused pass, without the list of leaves, for
  the host path (a flat list costs more than the moves of a small batch). It is
  property-tested against ``map_flat`` (tests/test_tree.py).

Both keep to the engine's guarantees: containers keep their exact type (or are refused
with their path), reference cycles and absurd depth raise
:class:`~devicekit.TransferError` with a path instead of a RecursionError (the walk
keeps its own stack), and an error in a leaf function gains the leaf's path.

``skip`` overrides the table's lookup for one walk: values under those keys, in any
mapping, pass through as they are.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator
from typing import Any, Final, NamedTuple, TypeAlias

import torch

from devicekit import _kinds
from devicekit._errors import LeafError, TransferError
from devicekit._kinds import DICT, INERT, LIST, MOVE, TUPLE, Node, mapping_items

__all__ = [
    "MAX_DEPTH",
    "Flat",
    "flatten",
    "format_path",
    "map_flat",
    "map_leaves",
    "paths",
    "skip_set",
    "unflatten",
]

MAX_DEPTH: Final = 10_000
"""Containers nested deeper than this are refused: no real batch comes near it."""

# Lists and tuples at least this long are checked in one pass for holding leaves only.
_SCAN_FROM = 64
# How many path fragments an error message shows before eliding the middle.
_PATH_SHOWN = 16

_rebuild_namedtuple = _kinds.rebuild_namedtuple
_tuple_new = tuple.__new__

Spec: TypeAlias = list[tuple[int, Node, Any, int]]
"""How :func:`flatten` took data apart: per container, in the order they close
(children before parents), (leaves seen when it closed, its rules, the container, its
number of children)."""


class Flat(NamedTuple):
    """Data taken apart by :func:`flatten`."""

    leaves: list[Any]
    """Every leaf, in walk order, repeats included."""
    spec: Spec
    """How to rebuild the containers around new leaves (:func:`unflatten`)."""
    active: list[int]
    """Where the leaves that are not inert (plain scalars) are."""


def format_path(root: str, fragments: Iterable[str]) -> str:
    """Join path fragments after a root name, eliding the middle of very long paths.

    >>> format_path("data", ["['image']", "[0]", ".boxes"])
    "data['image'][0].boxes"
    """
    parts = list(fragments)
    if len(parts) > _PATH_SHOWN:
        half = _PATH_SHOWN // 2
        hidden = len(parts) - 2 * half
        parts = [*parts[:half], f"...<{hidden:,} more levels>...", *parts[-half:]]
    return root + "".join(parts)


# The lookup: a view of the table, or the table with skipped keys overriding it.


class _Kept:
    """A value under a skipped key, carried through the walk as an inert leaf."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _skipping(node: Node, skip: frozenset[Hashable]) -> Node:
    def children(container: Any) -> list[Any]:
        return [_Kept(v) if key in skip else v for key, v in mapping_items(container)]

    def rebuild(container: Any, values: list[Any]) -> Any:
        return node.rebuild(container, [v.value if type(v) is _Kept else v for v in values])

    return Node(children, rebuild, node.keys, mapping=True)


Lookup: TypeAlias = tuple[dict[type, Any], Callable[[type], Any]]
# How each view decides a type it does not hold yet (made once: a walk is often short).
_LEARN: Final[tuple[Callable[[type], Any], ...]] = tuple(
    functools.partial(lambda view, cls: _kinds.decide(cls)[view], view)
    for view in (_kinds.MOVE, _kinds.CAST, _kinds.READ)
)


def _lookup(view: int, skip: frozenset[Hashable] | None) -> Lookup:
    """The view a walk reads, and how it decides a type the view does not hold yet.

    With ``skip``, a fresh dict for this walk alone, whose mappings hand the values
    under those keys over wrapped, as inert leaves; nothing of it outlives the call.
    """
    if skip is None:
        return _kinds.view(view), _LEARN[view]
    nodes: dict[type, Any] = {_Kept: INERT}

    def learn(cls: type) -> Any:
        node = _kinds.decide(cls)[view]
        if isinstance(node, Node) and node.mapping:
            node = _skipping(node, skip)
        nodes[cls] = node
        return node

    return nodes, learn


def skip_set(keys: object) -> frozenset[Hashable] | None:
    """``skip_keys`` as a set of keys: one key alone, or a collection of them.

    >>> sorted(skip_set(["raw", "ids"])), skip_set("raw"), skip_set(())
    (['ids', 'raw'], frozenset({'raw'}), None)

    Raises:
        TypeError: ``keys`` is neither a key nor a collection of hashable keys.
    """
    if isinstance(keys, str | bytes):  # one key, not a collection of letters
        return frozenset((keys,))
    if not isinstance(keys, Collection):
        msg = (
            "Expected skip_keys to be a mapping key such as 'raw_text', or a collection of "
            f"keys, got {type(keys).__name__} {keys!r}."
        )
        raise TypeError(msg)
    try:
        found = frozenset(keys)
    except TypeError:
        unhashable = next(key for key in keys if not isinstance(key, Hashable))
        msg = (
            "Expected skip_keys to hold mapping keys, which are hashable, got "
            f"{type(unhashable).__name__} {unhashable!r} among them."
        )
        raise TypeError(msg) from None
    return found or None


def _one_kind(values: Collection[Any], nodes: dict[type, Any], learn: Any) -> Any:
    """Whether a container's children can be taken whole: INERT, a leaf (None), or False.

    INERT where they are all plain scalars (token ids, metadata), a leaf where they are
    all leaves (a list of tensors, ``(images, labels)``); such a container is taken in
    one step at C speed, a type check per child, instead of child by child. A first
    child that is a container (most nested batches) says no at once.
    """
    if not values:
        return False
    first = _entry(type(next(iter(values))), nodes, learn)
    if first is not None and first is not INERT:
        return False
    for kind in set(map(type, values)):
        if _entry(kind, nodes, learn) is not first:
            return False
    return first


def _entry(cls: type, nodes: dict[type, Any], learn: Callable[[type], Any]) -> Any:
    try:
        return nodes[cls]
    except KeyError:
        return learn(cls)


def flatten(  # noqa: PLR0912, PLR0915 - one loop on purpose: a call per container costs more
    tree: Any, *, view: int = MOVE, skip: frozenset[Hashable] | None = None
) -> Flat:
    """The leaves of ``tree`` in walk order, and how to put new ones in their place.

    :func:`unflatten` rebuilds the containers around a new list of leaves, so leaves
    can be handled in bulk (grouped, packed, moved) with no call per leaf.

    >>> flat = flatten({"a": [1, (2, "x")], "b": None})
    >>> flat.leaves, flat.active, unflatten(flat.spec, [10, 20, "y", None])
    ([1, 2, 'x', None], [], {'a': [10, (20, 'y')], 'b': None})

    Raises:
        TransferError: The data nests deeper than :data:`MAX_DEPTH`, or holds a cycle.
    """
    if skip is None:  # as _lookup has it, without a call: a walk is often short
        nodes, learn = _kinds._views[view], _LEARN[view]
    else:
        nodes, learn = _lookup(view, skip)
    leaves: list[Any] = []
    try:
        node = nodes[type(tree)]
    except KeyError:
        node = learn(type(tree))
    if node is None or node is INERT:
        return _tuple_new(Flat, ([tree], [], [] if node is INERT else [0]))
    spec: Spec = []
    active: list[int] = []
    if node is LIST or node is TUPLE or node is DICT:
        values = tree.values() if node is DICT else tree
        kind = _one_kind(values, nodes, learn)
        if kind is not False:  # scalars only, or leaves only: taken whole
            leaves += values
            active += [] if kind is INERT else range(len(values))
            spec.append((len(values), node, tree, len(values)))
            return _tuple_new(Flat, (leaves, spec, active))
    stack: list[tuple[Node, Any, Iterator[Any], int]] = []
    container, children, count = tree, iter(node.children(tree)), 0
    while True:
        for child in children:
            count += 1
            try:  # a subscript, not .get(): the interpreter's fast path for dicts
                child_node = nodes[type(child)]
            except KeyError:
                child_node = learn(type(child))
            if child_node is None:
                active.append(len(leaves))
                leaves.append(child)
                continue
            if child_node is INERT:
                leaves.append(child)
                continue
            if (child_node is LIST or child_node is TUPLE) and len(child) >= _SCAN_FROM:
                kind = _one_kind(child, nodes, learn)
                if kind is not False:  # its elements become leaves in one step
                    if kind is None:
                        active += range(len(leaves), len(leaves) + len(child))
                    leaves += child
                    spec.append((len(leaves), child_node, child, len(child)))
                    continue
            stack.append((node, container, children, count))
            if len(stack) >= MAX_DEPTH:
                raise _too_deep(stack)
            node, container, count = child_node, child, 0
            children = iter(node.children(child))
            break
        else:
            spec.append((len(leaves), node, container, count))
            if not stack:
                # A NamedTuple's own __new__ is a Python frame: a tenth of a small walk.
                return _tuple_new(Flat, (leaves, spec, active))
            node, container, children, count = stack.pop()


def paths(flat: Flat) -> tuple[list[str], list[str]]:
    """The path of every leaf and of every container (in ``spec`` order) of ``flat``.

    The walk keeps no paths (they cost a string per leaf): each container names its
    children with its keys, and paths are joined from the root down afterwards.

    >>> paths(flatten({"a": [1, (2, "x")]}))
    (["['a'][0]", "['a'][1][0]", "['a'][1][1]"], ["['a'][1]", "['a']", ''])
    """
    leaves, spec = flat.leaves, flat.spec
    if not spec:
        return [""], []
    leaf_parents: list[tuple[int, str]] = [(-1, "")] * len(leaves)
    container_parents: list[tuple[int, str]] = [(-1, "")] * len(spec)
    waiting: list[tuple[bool, int]] = []  # (is a leaf, its index): children not placed yet
    taken = 0
    for number, (end, node, container, count) in enumerate(spec):
        waiting += ((True, index) for index in range(taken, end))
        taken = end
        children = waiting[len(waiting) - count :]
        del waiting[len(waiting) - count :]
        for key, (is_leaf, index) in zip(node.keys(container), children, strict=True):
            (leaf_parents if is_leaf else container_parents)[index] = (number, key)
        waiting.append((False, number))
    container_paths = [""] * len(spec)
    for number in reversed(range(len(spec) - 1)):  # the last to close is the root
        parent, key = container_parents[number]
        container_paths[number] = container_paths[parent] + key
    return [container_paths[parent] + key for parent, key in leaf_parents], container_paths


def unflatten(spec: Spec, leaves: list[Any]) -> Any:
    """The data :func:`flatten` took apart, rebuilt around ``leaves``.

    Raises:
        TransferError: A container cannot be rebuilt; the message names its path.
    """
    if not spec:
        return leaves[0]
    values: list[Any] = []
    taken = 0
    for end, node, container, count in spec:
        # Leaves up to this container's close come first; its children are the last
        # `count` values: its own leaves and the containers closed inside it.
        if count <= end - taken:
            # No container inside it: its children are the last `count` new leaves.
            if taken < end - count:
                values += leaves[taken : end - count]
            children = leaves[end - count : end]
        else:
            values += leaves[taken:end]
            children = values[len(values) - count :]
            del values[len(values) - count :]
        taken = end
        if node is LIST:
            values.append(children)
        elif node is DICT:
            values.append(dict(zip(container, children)))  # noqa: B905 - same dict
        elif node is TUPLE:
            values.append(tuple(children))
        elif node.rebuild is _rebuild_namedtuple:
            values.append(_tuple_new(type(container), children))
        else:
            try:
                values.append(node.rebuild(container, children))
            except Exception as err:
                flat = Flat(leaves, spec, [])
                number = next(i for i, entry in enumerate(spec) if entry[2] is container)
                raise _with_path(err, "data" + paths(flat)[1][number], container) from None
    return values[0]


def map_flat(
    move_all: Callable[[list[Any], list[int], Any], list[Any]],
    tree: Any,
    state: Any = None,
    *,
    skip: frozenset[Hashable] | None = None,
) -> Any:
    """``tree`` rebuilt around ``move_all(leaves, active, state)``: its new leaves.

    Flatten, one call on the list of leaves and the places of those that are not
    inert (which can then be handled in bulk: grouped, packed), unflatten. The call
    returns every leaf, inert ones as they are. ``state`` is anything the caller wants
    handed over (what one call keeps: a memo, say).

    >>> import torch
    >>> def plus_one(leaves, active, state):
    ...     return [leaf + 1 if index in active else leaf for index, leaf in enumerate(leaves)]
    >>> map_flat(plus_one, {"a": [torch.zeros(1)], "n": 3})
    {'a': [tensor([1.])], 'n': 3}

    Raises:
        TransferError: As :func:`flatten`, or ``move_all`` raised one for a leaf (given
            its path); other errors from it keep their type and gain a note with it.
    """
    kind = type(tree)
    if skip is None and (kind is dict or kind is list or kind is tuple):
        # A flat batch ((images, labels), a dict of features), every child a leaf:
        # flatten and unflatten come down to a line each, a tenth of its host time.
        values = tree.values() if kind is dict else tree
        if _one_kind(values, _kinds._views[MOVE], _LEARN[MOVE]) is None:
            leaves = list(values)
            try:
                moved = move_all(leaves, list(range(len(leaves))), state)
            except Exception as err:
                raise _located_again(err, move_all, state, flatten(tree)) from None
            if kind is dict:
                return dict(zip(tree, moved))  # noqa: B905 - its own values, in order
            return moved if kind is list else tuple(moved)
    leaves, spec, active = flatten(tree, skip=skip)
    try:
        moved = move_all(leaves, active, state)
    except Exception as err:
        raise _located_again(err, move_all, state, Flat(leaves, spec, active)) from None
    return unflatten(spec, moved)


def _located_again(
    err: Exception,
    move_all: Callable[[list[Any], list[int], Any], list[Any]],
    state: Any,
    flat: Flat,
) -> Exception:
    """The error of the first leaf whose move fails, with its path: found by moving again.

    The leaves were moved in one call, which says nothing of where it failed. Moving
    them one by one repeats no side effect: an object is moved once per call (the
    mover's memo), and a tensor's copy has none.
    """
    for index in flat.active:
        leaf = flat.leaves[index]
        try:
            move_all([leaf], [0], state)
        except Exception as again:
            return _with_path(again, "data" + paths(flat)[0][index], leaf)
    return err


def map_leaves(  # noqa: PLR0912, PLR0915 - one loop, as in flatten
    fn: Callable[[Any, Any], Any],
    tree: Any,
    state: Any = None,
    *,
    view: int = MOVE,
    skip: frozenset[Hashable] | None = None,
    root: str | None = "data",
) -> Any:
    """``tree`` rebuilt with ``fn(leaf, state)`` applied to each leaf that is not inert.

    The result is that of :func:`map_flat` (and of flatten, ``fn`` on each leaf,
    unflatten), in one pass, without the list of leaves. Containers are rebuilt
    wherever they occur; ``fn`` keeps a memo in ``state`` if a leaf met twice must come
    back as one object.

    >>> import torch
    >>> map_leaves(lambda t, _: t + 1, {"a": [torch.zeros(1)], "n": 3})
    {'a': [tensor([1.])], 'n': 3}

    Raises:
        TransferError: As :func:`map_flat`; paths start at ``root``. Without a root
            (a walk inside a leaf, whose path the outer walk knows), errors from ``fn``
            and rebuilds pass through as they are.
    """
    if skip is None:  # as _lookup has it, without a call: a walk is often short
        nodes, learn = _kinds._views[view], _LEARN[view]
    else:
        nodes, learn = _lookup(view, skip)
    try:
        node = nodes[type(tree)]
    except KeyError:
        node = learn(type(tree))
    if node is None or node is INERT:
        try:
            return tree if node is INERT else fn(tree, state)
        except Exception as err:
            if root is None:
                raise
            raise _with_path(err, root, tree) from None
    if (
        (node is LIST or node is TUPLE)
        and len(tree) >= _SCAN_FROM
        and _one_kind(tree, nodes, learn) is INERT
    ):
        return list(tree) if node is LIST else tree
    # The current frame lives in locals; the frames above it wait on `stack`.
    stack: list[tuple[Node, Any, Iterator[Any], list[Any]]] = []
    container, children, results = tree, iter(node.children(tree)), []
    while True:
        for child in children:
            try:  # as in flatten
                child_node = nodes[type(child)]
            except KeyError:
                try:
                    child_node = learn(type(child))
                except LeafError as err:  # a type met for the first time in a graph
                    raise _with_path(err, root or "data", child) from None
            if child_node is None:
                try:
                    results.append(fn(child, state))
                except Exception as err:
                    if root is None:
                        raise
                    if torch.compiler.is_compiling():  # no second walk in a graph
                        raise _with_path(err, root, child) from None
                    raise _located(err, tree, child, view, skip, root) from None
                continue
            if child_node is INERT:
                results.append(child)
                continue
            if (
                (child_node is LIST or child_node is TUPLE)
                and len(child) >= _SCAN_FROM  # before a call: most lists are short
                and _one_kind(child, nodes, learn) is INERT
            ):
                results.append(list(child) if child_node is LIST else child)
                continue
            stack.append((node, container, children, results))
            if len(stack) >= MAX_DEPTH:
                flatten(tree, view=view, skip=skip)  # raises, with the path
            node, container, results = child_node, child, []
            children = iter(node.children(child))
            break
        else:
            # Lists, dicts, tuples and namedtuples are rebuilt inline: a call through
            # Node.rebuild would cost as much as the rebuild itself.
            result: Any
            if node is LIST:
                result = results
            elif node is DICT:
                result = dict(zip(container, results))  # noqa: B905 - same dict, same length
            elif node is TUPLE:
                result = tuple(results)
            elif node.rebuild is _rebuild_namedtuple:
                result = _tuple_new(type(container), results)
            else:
                try:
                    result = node.rebuild(container, results)
                except Exception as err:
                    if root is None:
                        raise
                    raise _located(err, tree, container, view, skip, root) from None
            if not stack:
                return result
            node, container, children, results = stack.pop()
            results.append(result)


# Errors: paths are worked out here, once something failed, by walking again.


def _located(  # noqa: PLR0917 - the walk's own arguments, passed on
    err: Exception,
    tree: Any,
    where: Any,
    view: int,
    skip: frozenset[Hashable] | None,
    root: str,
) -> Exception:
    """``err``, raised for ``where`` (a leaf or a container of ``tree``), with its path.

    The first leaf or container that is ``where`` is the one that failed: the walk met
    it first, and each object is moved once.
    """
    flat = flatten(tree, view=view, skip=skip)
    leaf_paths, container_paths = paths(flat)
    found = [path for leaf, path in zip(flat.leaves, leaf_paths, strict=True) if leaf is where]
    found += [
        path for (_, _, c, _), path in zip(flat.spec, container_paths, strict=True) if c is where
    ]
    return _with_path(err, root + (found[0] if found else ""), where)


def _with_path(err: Exception, path: str, where: Any) -> Exception:
    if isinstance(err, LeafError):
        located = TransferError(err.template.format(path=path))
        located.__cause__ = err.__cause__
        return located
    if isinstance(err, TransferError) or not hasattr(err, "add_note"):
        return err
    # Errors from PyTorch or user code keep their type (an out-of-memory error must
    # stay one); a note says where in the data they happened.
    err.add_note(f"devicekit: raised while handling {path} ({type(where).__name__}).")
    return err


def _too_deep(stack: list[tuple[Node, Any, Iterator[Any], int]]) -> TransferError:
    """The error for a walk ``MAX_DEPTH`` containers deep: a cycle, or honest depth.

    Each frame's count says which of its children the walk is in, so its key names it.
    """
    fragments = [list(node.keys(container))[count - 1] for node, container, _, count in stack]
    first_seen: dict[int, int] = {}
    for depth, (_, container, _, _) in enumerate(stack):
        first = first_seen.setdefault(id(container), depth)
        if first != depth:
            msg = (
                "Expected data without reference cycles, but "
                f"{format_path('data', fragments[:depth])} is the {type(container).__name__} "
                f"{format_path('data', fragments[:first])} itself, which contains it."
            )
            return TransferError(msg)
    msg = (
        f"Expected data nested at most {MAX_DEPTH:,} containers deep, but "
        f"{format_path('data', fragments)} goes deeper."
    )
    return TransferError(msg)
