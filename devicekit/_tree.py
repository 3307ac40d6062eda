"""The one traversal engine: how devicekit takes nested data apart and puts it back together.

Everything that walks user data (moving it, finding its devices, pinning it,
generating it in tests) goes through a :class:`Walker`. The engine owns:

* the container rules: which types are containers, how to list their children,
  and how to rebuild them with new children while keeping their exact type;
* the cycle and depth guard, so reference cycles and absurd nesting raise
  :class:`~devicekit.TransferError` with a path instead of a RecursionError;
* key paths (``['image']``, ``[3].boxes``), computed only when something fails or a
  caller asks for them, never on the hot path.

The walk keeps its own stack instead of recursing, so depth is bounded by
:data:`MAX_DEPTH`, not by the interpreter's recursion limit.
"""

from __future__ import annotations

import array
import collections
import copy
import dataclasses
import functools
import itertools
from collections import UserDict, UserList
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any, Final, NamedTuple, TypeAlias, TypeVar

from devicekit._errors import TransferError

__all__ = [
    "MAX_DEPTH",
    "TYPES_KEPT",
    "Flat",
    "LeafError",
    "Node",
    "Spec",
    "Walker",
    "container_node",
    "format_path",
]

MAX_DEPTH: Final = 10_000
"""Containers nested deeper than this are refused: no real batch comes near it."""

# How many types a walker remembers its decision for before it starts over.
TYPES_KEPT: Final = 1024
"""How many types a cache of per-type decisions holds before it starts over."""
# Lists and tuples at least this long are checked in one pass for holding scalars only.
_SCAN_FROM = 64
# How many path fragments an error message shows before eliding the middle.
_PATH_SHOWN = 16


class LeafError(Exception):
    """Raised by a leaf function that knows what went wrong but not where.

    The walker fills ``{path}`` in the message with the leaf's path and raises
    :class:`~devicekit.TransferError` in its place.
    """

    def __init__(self, template: str) -> None:
        super().__init__(template)
        self.template = template


class Node(NamedTuple):
    """How to take one kind of container apart and rebuild it."""

    children: Callable[[Any], Iterable[Any]]
    """The container's children, in a fixed order."""
    rebuild: Callable[[Any, list[Any]], Any]
    """A new container like the old one, holding the given children in the same order."""
    keys: Callable[[Any], Iterable[str]]
    """Path fragments naming each child, in the order of ``children``."""


def _index_keys(node: Iterable[Any]) -> Iterator[str]:
    return (f"[{index}]" for index, _ in enumerate(node))


def _keys_of(keys: Iterable[Any]) -> Iterator[str]:
    return (f"[{key!r}]" for key in keys)


def _refusal(node: Any, why: str) -> LeafError:
    name = type(node).__name__
    msg = (
        f"Cannot rebuild {{path}}: it is a {type(node).__module__}.{name}, {why}. Register "
        f"how to move it with @devicekit.register_transfer({name})."
    )
    return LeafError(msg)


C = TypeVar("C")


def _own_copy(node: C) -> C:
    """A shallow copy of a container, refused where it is the container itself.

    The copy keeps what a subclass carries beyond its items (a defaultdict's factory,
    BatchEncoding's encodings), as torch's pin_memory does.
    """
    clone = copy.copy(node)
    if clone is node:
        raise _refusal(node, "whose copy is the object itself")
    return clone


# Mappings. Children and keys come from one source each time, so every value is
# paired with its own key whatever the class does to __iter__, keys() or values().


def _rebuild_dict_subclass(node: dict[Any, Any], values: list[Any]) -> dict[Any, Any]:
    # A dict subclass's items are the dict itself, so its copy has storage of its own;
    # dict's own methods are used, not the subclass's.
    clone = _own_copy(node)
    for key, value in zip(dict.keys(node), values, strict=True):
        dict.__setitem__(clone, key, value)
    return clone


def _rebuild_user_dict(node: UserDict[Any, Any], values: list[Any]) -> UserDict[Any, Any]:
    clone = _own_copy(node)
    if clone.data is node.data:
        raise _refusal(node, "a UserDict whose copy shares its data with the original")
    clone.data = dict(zip(node.data, values, strict=True))
    return clone


def mapping_items(node: Mapping[Any, Any]) -> list[tuple[Any, Any]]:
    """A mapping's (key, value) pairs as the mapping rules below read them.

    dict's own methods for dicts and dict subclasses, a UserDict's ``data``, and
    ``items()`` for any other Mapping: a subclass's ``__iter__`` never pairs a value
    with another key.
    """
    if isinstance(node, dict):
        return list(dict.items(node))
    if isinstance(node, UserDict):
        return list(node.data.items())
    return list(node.items())


def _rebuild_read_only_mapping(node: Mapping[Any, Any], values: list[Any]) -> Mapping[Any, Any]:
    keys = [key for key, _ in mapping_items(node)]
    try:
        return type(node)(dict(zip(keys, values, strict=True)))  # type: ignore[call-arg]
    except Exception as err:
        why = f"a read-only Mapping that cannot be built from a dict ({err})"
        raise _refusal(node, why) from err


def _refuse_mutable_mapping(node: Mapping[Any, Any], values: list[Any]) -> Any:
    # Its copy may share its storage (shelve.Shelf writes through to its file, ChainMap
    # to the maps after the first): writing moved values into it could change the input.
    raise _refusal(node, "a mutable mapping whose copy could share its contents with the original")


_DICT = Node(dict.values, lambda node, values: dict(zip(node, values, strict=True)), _keys_of)
_DICT_SUBCLASS = Node(dict.values, _rebuild_dict_subclass, lambda node: _keys_of(dict.keys(node)))
_USER_DICT = Node(
    lambda node: node.data.values(), _rebuild_user_dict, lambda node: _keys_of(node.data)
)
_READ_ONLY_MAPPING = Node(
    lambda node: [value for _, value in mapping_items(node)],
    _rebuild_read_only_mapping,
    lambda node: _keys_of(key for key, _ in mapping_items(node)),
)
_MUTABLE_MAPPING = Node(
    lambda node: [value for _, value in mapping_items(node)],
    _refuse_mutable_mapping,
    lambda node: _keys_of(key for key, _ in mapping_items(node)),
)


# Sequences.


def _rebuild_list_subclass(node: list[Any], values: list[Any]) -> list[Any]:
    clone = _own_copy(node)
    clone[:] = values
    return clone


def _rebuild_deque(node: collections.deque[Any], values: list[Any]) -> collections.deque[Any]:
    clone = _own_copy(node)  # keeps maxlen
    clone.clear()
    clone.extend(values)
    return clone


def _rebuild_user_list(node: UserList[Any], values: list[Any]) -> UserList[Any]:
    clone = _own_copy(node)
    if clone.data is node.data:
        raise _refusal(node, "a UserList whose copy shares its data with the original")
    clone.data = values
    return clone


def _refuse_sequence(node: Sequence[Any], values: list[Any]) -> Any:
    raise _refusal(node, "a Sequence that devicekit cannot rebuild as the same type")


def _rebuild_namedtuple(node: tuple[Any, ...], values: list[Any]) -> tuple[Any, ...]:
    return type(node)(*values)


_tuple_new = tuple.__new__


def _rebuild_plain_namedtuple(node: tuple[Any, ...], values: list[Any]) -> tuple[Any, ...]:
    # What the __new__ that collections.namedtuple writes does, without its Python frame
    # (a third of a small batch's rebuilding time).
    return _tuple_new(type(node), values)


def _new_is_generated(cls: type) -> bool:
    """Whether ``cls.__new__`` is the one collections.namedtuple wrote for the class.

    A subclass with a ``__new__`` of its own is rebuilt through it.
    """
    owner = next(klass for klass in cls.__mro__ if "__new__" in vars(klass))
    return "_fields" in vars(owner) and "_make" in vars(owner)


def _rebuild_by_type(node: Any, values: list[Any]) -> Any:
    return type(node)(values)


_LIST = Node(iter, lambda node, values: values, _index_keys)
_LIST_SUBCLASS = Node(iter, _rebuild_list_subclass, _index_keys)
_DEQUE = Node(iter, _rebuild_deque, _index_keys)
_USER_LIST = Node(lambda node: node.data, _rebuild_user_list, _index_keys)
_OTHER_SEQUENCE = Node(iter, _refuse_sequence, _index_keys)
_TUPLE = Node(iter, lambda node, values: tuple(values), _index_keys)
_TUPLE_SUBCLASS = Node(iter, _rebuild_by_type, _index_keys)  # torch.Size, struct sequences
_SET = Node(iter, _rebuild_by_type, lambda node: (f"{{{i}}}" for i, _ in enumerate(node)))
# Sequences that hold only numbers or bytes: leaves, as strings are.
_FLAT_SEQUENCES = (str, bytes, bytearray, range, memoryview, array.array)


# Dataclasses.


def _dataclass_node(cls: type) -> Node:
    """Rules for a dataclass: its fields, and attributes its instances gained since.

    A rebuilt instance is made without running ``__init__`` or ``__post_init__`` again
    (which could apply a computation twice, or need an InitVar it no longer has): each
    field, and each attribute set outside the fields (in ``__post_init__``, say), is
    moved and set as dataclasses themselves set frozen fields. Values cached by
    ``functools.cached_property`` are not carried over: they would describe the old
    fields.
    """
    fields = tuple(field.name for field in dataclasses.fields(cls))
    known = frozenset(fields)
    cached = frozenset(
        name
        for klass in cls.__mro__
        for name, attribute in vars(klass).items()
        if isinstance(attribute, functools.cached_property)
    )

    def names(node: Any) -> tuple[str, ...]:
        state = getattr(node, "__dict__", None)
        if not state:
            return fields
        extra = tuple(name for name in state if name not in known and name not in cached)
        return fields + extra if extra else fields

    def children(node: Any) -> list[Any]:
        return [getattr(node, name) for name in names(node)]

    def rebuild(node: Any, values: list[Any]) -> Any:
        clone: Any = cls.__new__(cls)  # type: ignore[call-overload] # not __init__
        for name, value in zip(names(node), values, strict=True):
            object.__setattr__(clone, name, value)
        return clone

    def keys(node: Any) -> Iterator[str]:
        return (f".{name}" for name in names(node))

    return Node(children, rebuild, keys)


@functools.lru_cache(maxsize=1024)  # bounded: types made at run time must not pile up
def container_node(cls: type) -> Node | None:  # noqa: PLR0912 - one rule per kind
    """The container rules for a type, or None when its instances are leaves.

    >>> container_node(dict) is not None, container_node(str)
    (True, None)
    """
    if cls is dict:
        return _DICT
    if cls is list:
        return _LIST
    if cls is tuple:
        return _TUPLE
    if issubclass(cls, _FLAT_SEQUENCES):
        return None
    if issubclass(cls, dict):
        return _DICT_SUBCLASS
    if issubclass(cls, UserDict):
        return _USER_DICT
    if issubclass(cls, MutableMapping):
        return _MUTABLE_MAPPING
    if issubclass(cls, Mapping):
        return _READ_ONLY_MAPPING
    if issubclass(cls, list):
        return _LIST_SUBCLASS
    if issubclass(cls, tuple):
        if isinstance(getattr(cls, "_fields", None), tuple):
            names = cls._fields  # type: ignore[attr-defined]
            rebuild = _rebuild_plain_namedtuple if _new_is_generated(cls) else _rebuild_namedtuple
            return Node(iter, rebuild, lambda node: (f".{name}" for name in names))
        return _TUPLE_SUBCLASS
    if issubclass(cls, collections.deque):
        return _DEQUE
    if issubclass(cls, UserList):
        return _USER_LIST
    if issubclass(cls, Sequence):
        return _OTHER_SEQUENCE
    if issubclass(cls, set | frozenset):
        return _SET
    if dataclasses.is_dataclass(cls):
        return _dataclass_node(cls)
    return None


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


_UNSEEN: Any = object()
_UP: Any = object()  # in pairs' stack: leaving a pair of containers
_INERT: Any = object()  # in Walker._nodes: a leaf that map passes through untouched

Spec: TypeAlias = list[tuple[int, Node, Any, int]]
"""How :meth:`Walker.flatten` took data apart: per container, in the order they close,
(leaves seen when it closed, its rules, the container, its number of children)."""


class Flat(NamedTuple):
    """Data taken apart by :meth:`Walker.flatten`."""

    leaves: list[Any]
    """Every leaf, in walk order, repeats included."""
    spec: Spec
    """How to rebuild the containers around new leaves (:meth:`Walker.unflatten`)."""
    active: list[int]
    """Where the leaves that are not plain scalars (the walker's inert types) are."""
    paths: list[str] | None
    """Each leaf's path from the root, where asked for."""
    container_paths: list[str]
    """Each container's path, in the order of ``spec``, where paths were asked for."""


# A frame of the walk: (node rules, container, iterator over its children, results so far).
# Plain tuples, not a NamedTuple: frames are made per container, on the hot path.
_Frame: TypeAlias = tuple[Node, Any, Iterator[Any], list[Any]]


def _key_of(frame: _Frame, child: Any) -> str:
    """The path fragment under which ``child`` sits in the frame's container."""
    node, container = frame[0], frame[1]
    pairs = zip(node.keys(container), node.children(container), strict=True)
    return next((key for key, value in pairs if value is child), "[?]")


class Walker:
    """Walks nested data under one policy of what counts as a leaf.

    Args:
        is_leaf_type: Types for which this returns True are leaves even if they are
            containers (a type with its own transfer rule, say). It is asked once per type.
        inert_types: Leaf types that :meth:`map` passes through as they are, without
            calling its function: the plain scalars of a batch (ids, names, None) are
            most of its leaves after the tensors, and a call each would cost more than
            the walk. Exact types only; :meth:`leaves` still yields them.
        extra_nodes: Rules for types that are not data containers but hold tensors a
            walk should reach (a module's parameters, an optimizer's state); asked
            before the container rules. For walks that only read (:meth:`leaves`):
            such nodes need not be rebuildable.
        root: The name error messages give the data's root, as in ``data['x']``.
    """

    def __init__(
        self,
        is_leaf_type: Callable[[type], bool],
        *,
        inert_types: Iterable[type] = (),
        extra_nodes: Callable[[type], Node | None] | None = None,
        root: str = "data",
    ) -> None:
        self._is_leaf_type = is_leaf_type
        self._extra_nodes = extra_nodes
        self._inert_types = frozenset(inert_types)
        self._root = root
        self._nodes: dict[type, Node | None] = {}

    def forget_types(self) -> None:
        """Drop what was learnt per type; called when the leaf policy changes."""
        self._nodes.clear()

    def node_of(self, cls: type) -> Node | None:
        """The container rules this walker applies to ``cls``, or None for a leaf."""
        node = self._learn(cls)
        return None if node is _INERT else node

    def _learn(self, cls: type) -> Any:
        """What the walk does with ``cls``: its Node, None (a leaf) or _INERT.

        The answer is returned, not read back from the table: another thread may clear
        the table (a new transfer rule) between the two.
        """
        node = self._nodes.get(cls, _UNSEEN)
        if node is _UNSEEN:
            node = self._extra_nodes(cls) if self._extra_nodes is not None else None
            if node is None:
                node = None if self._is_leaf_type(cls) else container_node(cls)
            if node is None and cls in self._inert_types and not self._is_leaf_type(cls):
                node = _INERT  # a plain scalar nobody registered a rule for
            if len(self._nodes) >= TYPES_KEPT:
                self._nodes.clear()  # types made at run time must not pile up
            self._nodes[cls] = node
        return node

    def _only_scalars(self, sequence: list[Any] | tuple[Any, ...]) -> bool:
        """Whether a long list or tuple holds plain scalars only (token ids, metadata)."""
        return self._one_kind(sequence) is _INERT

    def _one_kind(self, sequence: list[Any] | tuple[Any, ...]) -> Any:
        """How a long list or tuple can be taken whole: _INERT, None or _UNSEEN.

        _INERT where it holds plain scalars only (token ids, metadata), None where it
        holds leaves only (a list of tensors), _UNSEEN otherwise. The first two are
        taken whole, at C speed, instead of element by element: a type check per
        element in C costs a fraction of a step of the walk. Short ones, and those
        whose first element is a container, are not looked at.
        """
        if len(sequence) < _SCAN_FROM:
            return _UNSEEN
        first = self._learn(type(sequence[0]))
        if first is not _INERT and first is not None:
            return _UNSEEN
        if all(self._learn(kind) is first for kind in set(map(type, sequence))):
            return first
        return _UNSEEN

    def map(self, fn: Callable[[Any], Any], tree: Any) -> Any:  # noqa: PLR0912, PLR0915 - one loop on purpose: a call per container costs more than its branches
        """Rebuild ``tree`` with ``fn`` applied to every leaf; containers keep their type.

        Containers are rebuilt wherever they occur; ``fn`` keeps its own memo if a
        leaf met twice must come back as one object.

        >>> Walker(lambda cls: False).map(lambda x: x * 2, {"a": [1, (2, "x")]})
        {'a': [2, (4, 'xx')]}
        """
        nodes = self._nodes
        node = nodes.get(type(tree), _UNSEEN)
        if node is _UNSEEN:
            node = self._learn(type(tree))
        if node is None or node is _INERT:
            try:
                return fn(tree)
            except Exception as err:
                raise self._located(err, [], tree) from None
        if (
            (node is _LIST or node is _TUPLE)
            and len(tree) >= _SCAN_FROM
            and self._only_scalars(tree)
        ):
            return list(tree) if node is _LIST else tree
        # The current frame lives in locals; the frames above it wait on `stack`.
        # No recursion, so depth is bounded by MAX_DEPTH, not by the interpreter.
        stack: list[_Frame] = []
        inert = _INERT
        container = tree
        children = iter(node.children(tree))
        results: list[Any] = []
        while True:
            for child in children:
                try:  # a subscript, not .get(): the interpreter's fast path for dicts
                    child_node = nodes[type(child)]
                except KeyError:
                    child_node = self._learn(type(child))
                if child_node is None:
                    try:
                        results.append(fn(child))
                    except Exception as err:
                        here = (node, container, children, results)
                        raise self._located(err, [*stack, here], child) from None
                    continue
                if child_node is inert:
                    results.append(child)
                    continue
                if (
                    (child_node is _LIST or child_node is _TUPLE)
                    and len(child) >= _SCAN_FROM  # before a call: most lists are short
                    and self._only_scalars(child)
                ):
                    results.append(list(child) if child_node is _LIST else child)
                    continue
                stack.append((node, container, children, results))
                if len(stack) >= MAX_DEPTH:
                    raise self._too_deep(stack, child)
                node, container, results = child_node, child, []
                children = iter(node.children(child))
                break
            else:
                # Lists and dicts, the usual containers, are rebuilt inline: a call
                # through Node.rebuild would cost as much as the rebuild itself.
                result: Any
                if node is _LIST:
                    result = results
                elif node is _DICT:
                    result = dict(zip(container, results))  # noqa: B905 - same dict, same length
                else:
                    try:
                        result = node.rebuild(container, results)
                    except Exception as err:
                        raise self._located(err, stack, container) from None
                if not stack:
                    return result
                node, container, children, results = stack.pop()
                results.append(result)

    def leaves(self, tree: Any) -> list[Any]:
        """Every leaf of ``tree`` in the order :meth:`map` meets them, repeats included.

        >>> Walker(lambda cls: False).leaves({"a": [1, (2, "x")], "b": None})
        [1, 2, 'x', None]
        """
        return self.flatten(tree).leaves

    def flatten(self, tree: Any, *, paths: bool = False) -> Flat:  # noqa: PLR0912, PLR0915 - one loop, as in map
        """The leaves of ``tree`` in walk order, and how to put new ones in their place.

        :meth:`unflatten` rebuilds the containers around a new list of leaves. Leaves
        can then be handled in bulk (grouped, packed, moved) with no call per leaf, and
        rebuilding costs a few list operations per container. With ``paths=True`` the
        path of every leaf and container comes too (for messages: it costs more).

        >>> walker = Walker(lambda cls: False)
        >>> flat = walker.flatten({"a": [1, (2, "x")]}, paths=True)
        >>> flat.leaves, flat.paths, walker.unflatten(flat.spec, [10, 20, "y"])
        ([1, 2, 'x'], ["['a'][0]", "['a'][1][0]", "['a'][1][1]"], {'a': [10, (20, 'y')]})

        Raises:
            TransferError: The data nests deeper than :data:`MAX_DEPTH` (a cycle).
        """
        nodes = self._nodes
        leaves: list[Any] = []
        node = nodes.get(type(tree), _UNSEEN)
        if node is _UNSEEN:
            node = self._learn(type(tree))
        if node is None or node is _INERT:
            flat = Flat([tree], [], [] if node is _INERT else [0], None, [])
            return self._with_paths(flat) if paths else flat
        spec: Spec = []  # containers in the order they close: children before parents
        active: list[int] = []
        if node is _LIST or node is _TUPLE:
            kind = self._one_kind(tree)
            if kind is _INERT or kind is None:  # scalars only, or leaves only: taken whole
                leaves += tree
                active += [] if kind is _INERT else range(len(tree))
                spec.append((len(tree), node, tree, len(tree)))
                flat = _tuple_new(Flat, (leaves, spec, active, None, []))
                return self._with_paths(flat) if paths else flat
        stack: list[tuple[Node, Any, Iterator[Any], int]] = []
        inert = _INERT
        container, children, count = tree, iter(node.children(tree)), 0
        while True:
            for child in children:
                count += 1
                try:  # as in map
                    child_node = nodes[type(child)]
                except KeyError:
                    child_node = self._learn(type(child))
                if child_node is None:
                    active.append(len(leaves))
                    leaves.append(child)
                    continue
                if child_node is inert:
                    leaves.append(child)
                    continue
                if (child_node is _LIST or child_node is _TUPLE) and len(child) >= _SCAN_FROM:
                    kind = self._one_kind(child)
                    if kind is inert or kind is None:
                        # Its elements become leaves in one step; it closes at once.
                        if kind is None:
                            active += range(len(leaves), len(leaves) + len(child))
                        leaves += child
                        spec.append((len(leaves), child_node, child, len(child)))
                        continue
                stack.append((node, container, children, count))
                if len(stack) >= MAX_DEPTH:
                    raise self._too_deep([(f[0], f[1], f[2], []) for f in stack], child)
                node, container, count = child_node, child, 0
                children = iter(node.children(child))
                break
            else:
                spec.append((len(leaves), node, container, count))
                if not stack:
                    # A NamedTuple's own __new__ is a Python frame: a tenth of the walk
                    # of a small batch.
                    flat = _tuple_new(Flat, (leaves, spec, active, None, []))
                    return self._with_paths(flat) if paths else flat
                node, container, children, count = stack.pop()

    def _with_paths(self, flat: Flat) -> Flat:
        """``flat`` with the path of every leaf and container, worked out from its spec.

        The walk itself keeps no paths (they cost a string per leaf): each container
        in the spec names its children with its keys, and paths are then joined from
        the root down, parents closing after their children.
        """
        if not flat.spec:
            return flat._replace(paths=[""])
        leaf_parents: list[tuple[int, str]] = [(-1, "")] * len(flat.leaves)
        container_parents: list[tuple[int, str]] = [(-1, "")] * len(flat.spec)
        waiting: list[tuple[bool, int]] = []  # (is a leaf, its index): children not placed yet
        taken = 0
        for number, (end, node, container, count) in enumerate(flat.spec):
            waiting += ((True, index) for index in range(taken, end))
            taken = end
            children = waiting[len(waiting) - count :]
            del waiting[len(waiting) - count :]
            for key, (is_leaf, index) in zip(node.keys(container), children, strict=True):
                (leaf_parents if is_leaf else container_parents)[index] = (number, key)
            waiting.append((False, number))
        container_paths = [""] * len(flat.spec)
        for number in reversed(range(len(flat.spec) - 1)):  # the last to close is the root
            parent, key = container_parents[number]
            container_paths[number] = container_paths[parent] + key
        leaf_paths = [container_paths[parent] + key for parent, key in leaf_parents]
        return flat._replace(paths=leaf_paths, container_paths=container_paths)

    def unflatten(self, spec: Spec, leaves: list[Any]) -> Any:
        """The data :meth:`flatten` took apart, rebuilt around ``leaves``.

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
            if node is _LIST:
                values.append(children)
            elif node is _DICT:
                values.append(dict(zip(container, children)))  # noqa: B905 - same dict
            elif node is _TUPLE:
                values.append(tuple(children))
            elif node.rebuild is _rebuild_plain_namedtuple:
                values.append(_tuple_new(type(container), children))
            else:
                try:
                    values.append(node.rebuild(container, children))
                except Exception as err:
                    # Rare: walk again to say where (the hot path keeps no paths).
                    raise self._rebuild_error(err, container, spec) from None
        return values[0]

    def _rebuild_error(self, err: Exception, container: Any, spec: Spec) -> Exception:
        flat = self.flatten(spec[-1][2], paths=True)
        for (_, _, found, _), path in zip(flat.spec, flat.container_paths, strict=True):
            if found is container:
                return self._with_path(err, format_path(self._root, [path]), container)
        return err

    def locate(self, err: Exception, tree: Any, index: int) -> Exception:
        """``err``, raised for the ``index``-th leaf of ``tree``, with that leaf's path."""
        flat = self.flatten(tree, paths=True)
        assert flat.paths is not None  # asked for
        where = format_path(self._root, [flat.paths[index]])
        return self._with_path(err, where, flat.leaves[index])

    def leaves_with_paths(self, tree: Any) -> Iterator[tuple[str, Any]]:
        """Every leaf with its path from the root, such as ``"['a'][1][0]"``.

        >>> dict(Walker(lambda cls: False).leaves_with_paths({"a": [1, (2,)]}))
        {"['a'][0]": 1, "['a'][1][0]": 2}
        """
        flat = self.flatten(tree, paths=True)
        assert flat.paths is not None  # asked for
        return zip(flat.paths, flat.leaves, strict=True)

    def pairs(self, left: Any, right: Any) -> Iterator[tuple[str, Any, Any]]:
        """Corresponding objects of two structures, with their paths, parents first.

        Descends where both are containers of one type with the same keys; the caller
        judges each pair, so a difference is reported where it first appears. Sets are
        not descended into: their members have no order to pair them by.

        >>> walker = Walker(lambda cls: False)
        >>> [(path, a, b) for path, a, b in walker.pairs({"x": [1, 2]}, {"x": [1, 3]})][1:]
        [("['x']", [1, 2], [1, 3]), ("['x'][0]", 1, 1), ("['x'][1]", 2, 3)]

        Raises:
            TransferError: The structures hold a reference cycle, or nest deeper than
                :data:`MAX_DEPTH`.
        """
        # The left containers on the way down, by id, with their paths: a container met
        # again inside itself is a cycle, found at its first repeat, not MAX_DEPTH later.
        inside: dict[int, str] = {}
        paired: set[tuple[int, int]] = set()  # container pairs being compared, on the way down
        stack: list[tuple[Any, Any, Any]] = [((), left, right)]
        while stack:
            fragments, a, b = stack.pop()
            if fragments is _UP:  # the way back up, past this pair of containers
                del inside[a]
                paired.discard((a, b))
                continue
            path = "".join(fragments)
            yield path, a, b
            node = self.node_of(type(a)) if type(a) is type(b) else None
            if node is None or isinstance(a, set | frozenset):
                continue
            keys = list(node.keys(a))
            if keys != list(node.keys(b)):
                continue
            if (id(a), id(b)) in paired:
                continue  # both sides repeat here together: compared where they began
            if id(a) in inside:
                msg = (
                    "Expected data without reference cycles, but "
                    f"{format_path(self._root, [path])} is the {type(a).__name__} "
                    f"{format_path(self._root, [inside[id(a)]])} itself, which contains it."
                )
                raise TransferError(msg)
            inside[id(a)] = path
            paired.add((id(a), id(b)))
            stack.append((_UP, id(a), id(b)))
            if len(fragments) >= MAX_DEPTH:
                path = format_path(self._root, fragments)
                msg = (
                    f"Expected data nested at most {MAX_DEPTH:,} containers deep, but {path} "
                    "goes deeper."
                )
                raise TransferError(msg)
            children = zip(keys, node.children(a), node.children(b), strict=True)
            stack.extend(((*fragments, key), x, y) for key, x, y in reversed(list(children)))

    # Errors: the stack is the path, so it is only read here, once something failed.

    def _path(self, stack: list[_Frame], last: Any) -> str:
        fragments = [_key_of(parent, child[1]) for parent, child in itertools.pairwise(stack)]
        if stack:
            fragments.append(_key_of(stack[-1], last))
        return format_path(self._root, fragments)

    def _located(self, err: Exception, stack: list[_Frame], where: Any) -> Exception:
        return self._with_path(err, self._path(stack, where), where)

    def _with_path(self, err: Exception, path: str, where: Any) -> Exception:
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

    def _too_deep(self, stack: list[_Frame], child: Any) -> TransferError:
        # A reference cycle nests without end, so it trips the depth guard; telling it
        # apart from honest depth is left to this error path, off the hot one.
        first_seen: dict[int, int] = {}
        for depth, (_, container, _, _) in enumerate(stack):
            first = first_seen.setdefault(id(container), depth)
            if first != depth:
                msg = (
                    "Expected data without reference cycles, but "
                    f"{self._path(stack[:depth], container)} is the {type(container).__name__} "
                    f"{self._path(stack[:first], container)} itself, which contains it."
                )
                return TransferError(msg)
        msg = (
            f"Expected data nested at most {MAX_DEPTH:,} containers deep, but "
            f"{self._path(stack, child)} goes deeper."
        )
        return TransferError(msg)
