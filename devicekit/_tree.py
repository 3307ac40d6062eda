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

import copy
import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from typing import Any, Final, NamedTuple, TypeAlias

from devicekit._errors import TransferError

__all__ = ["MAX_DEPTH", "LeafError", "Node", "Walker", "container_node", "format_path"]

MAX_DEPTH: Final = 10_000
"""Containers nested deeper than this are refused: no real batch comes near it."""

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


def _mapping_keys(node: Mapping[Any, Any]) -> Iterator[str]:
    return (f"[{key!r}]" for key in node)


def _rebuild_mapping(node: Mapping[Any, Any], values: list[Any]) -> Mapping[Any, Any]:
    # A shallow copy keeps what a subclass carries beyond its items (a defaultdict's
    # factory, BatchEncoding's encodings); the copy's items are then replaced.
    if isinstance(node, MutableMapping):
        clone = copy.copy(node)
        for key, value in zip(node, values, strict=True):
            clone[key] = value
        return clone
    try:
        return type(node)(dict(zip(node, values, strict=True)))  # type: ignore[call-arg]
    except Exception as err:
        msg = (
            f"Cannot rebuild {{path}}: {type(node).__name__} is a read-only Mapping that "
            f"cannot be built from a dict ({err}). Register how to move it with "
            f"@devicekit.register_transfer({type(node).__name__})."
        )
        raise LeafError(msg) from err


def _rebuild_list_subclass(node: list[Any], values: list[Any]) -> list[Any]:
    clone = copy.copy(node)
    clone[:] = values
    return clone


def _rebuild_namedtuple(node: tuple[Any, ...], values: list[Any]) -> tuple[Any, ...]:
    return type(node)(*values)


def _rebuild_by_type(node: Any, values: list[Any]) -> Any:
    return type(node)(values)


def _field_keys(names: tuple[str, ...]) -> Callable[[Any], Iterable[str]]:
    return lambda node: (f".{name}" for name in names)


def _dataclass_node(cls: type) -> Node:
    fields = dataclasses.fields(cls)
    names = tuple(field.name for field in fields)
    init_names = [field.name for field in fields if field.init]
    late_names = [field.name for field in fields if not field.init]
    frozen = cls.__dataclass_params__.frozen  # type: ignore[attr-defined]

    def children(node: Any) -> list[Any]:
        return [getattr(node, name) for name in names]

    def rebuild(node: Any, values: list[Any]) -> Any:
        new = dict(zip(names, values, strict=True))
        if frozen:
            # replace() runs __init__ and __post_init__ as the class intends; fields
            # outside __init__ are then set the way dataclasses itself sets them.
            clone = dataclasses.replace(node, **{name: new[name] for name in init_names})
            for name in late_names:
                object.__setattr__(clone, name, new[name])
            return clone
        clone = copy.copy(node)
        for name in names:
            setattr(clone, name, new[name])
        return clone

    return Node(children, rebuild, _field_keys(names))


_DICT = Node(dict.values, lambda node, values: dict(zip(node, values, strict=True)), _mapping_keys)
_MAPPING = Node(lambda node: node.values(), _rebuild_mapping, _mapping_keys)
_LIST = Node(iter, lambda node, values: values, _index_keys)
_LIST_SUBCLASS = Node(iter, _rebuild_list_subclass, _index_keys)
_TUPLE = Node(iter, lambda node, values: tuple(values), _index_keys)
_TUPLE_SUBCLASS = Node(iter, _rebuild_by_type, _index_keys)  # torch.Size, struct sequences
_SET = Node(iter, _rebuild_by_type, lambda node: (f"{{{i}}}" for i, _ in enumerate(node)))


@functools.cache
def container_node(cls: type) -> Node | None:
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
    if issubclass(cls, str | bytes | bytearray):
        return None
    if issubclass(cls, Mapping):
        return _MAPPING
    if issubclass(cls, list):
        return _LIST_SUBCLASS
    if issubclass(cls, tuple):
        if isinstance(getattr(cls, "_fields", None), tuple):
            names = cls._fields  # type: ignore[attr-defined]
            return Node(iter, _rebuild_namedtuple, _field_keys(names))
        return _TUPLE_SUBCLASS
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
_INERT: Any = object()  # in Walker._nodes: a leaf that map passes through untouched

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
        node = self._nodes.get(cls, _UNSEEN)
        if node is _UNSEEN:
            node = self._extra_nodes(cls) if self._extra_nodes is not None else None
            if node is None:
                node = None if self._is_leaf_type(cls) else container_node(cls)
            self._nodes[cls] = _INERT if node is None and cls in self._inert_types else node
        return None if node is _INERT else node

    def map(self, fn: Callable[[Any], Any], tree: Any) -> Any:  # noqa: PLR0912 - one loop on purpose: a call per container costs more than its branches
        """Rebuild ``tree`` with ``fn`` applied to every leaf; containers keep their type.

        Containers are rebuilt wherever they occur; ``fn`` keeps its own memo if a
        leaf met twice must come back as one object.

        >>> Walker(lambda cls: False).map(lambda x: x * 2, {"a": [1, (2, "x")]})
        {'a': [2, (4, 'xx')]}
        """
        nodes = self._nodes
        node = self.node_of(type(tree))
        if node is None:
            try:
                return fn(tree)
            except Exception as err:
                raise self._located(err, [], tree) from None
        # The current frame lives in locals; the frames above it wait on `stack`.
        # No recursion, so depth is bounded by MAX_DEPTH, not by the interpreter.
        stack: list[_Frame] = []
        unseen, inert = _UNSEEN, _INERT
        container = tree
        children = iter(node.children(tree))
        results: list[Any] = []
        while True:
            for child in children:
                child_node = nodes.get(type(child), unseen)
                if child_node is unseen:
                    self.node_of(type(child))
                    child_node = nodes[type(child)]
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

    def leaves(self, tree: Any) -> Iterator[Any]:
        """Every leaf of ``tree`` in the order :meth:`map` meets them, repeats included.

        >>> list(Walker(lambda cls: False).leaves({"a": [1, (2, "x")], "b": None}))
        [1, 2, 'x', None]
        """
        for _, leaf in self._walk(tree, with_paths=False):
            yield leaf

    def leaves_with_paths(self, tree: Any) -> Iterator[tuple[str, Any]]:
        """Every leaf with its path from the root, such as ``"['a'][1][0]"``.

        >>> dict(Walker(lambda cls: False).leaves_with_paths({"a": [1, (2,)]}))
        {"['a'][0]": 1, "['a'][1][0]": 2}
        """
        return self._walk(tree, with_paths=True)

    def pairs(self, left: Any, right: Any) -> Iterator[tuple[str, Any, Any]]:
        """Corresponding objects of two structures, with their paths, parents first.

        Descends where both are containers of one type with the same keys; the caller
        judges each pair, so a difference is reported where it first appears. Sets are
        not descended into: their members have no order to pair them by.

        >>> walker = Walker(lambda cls: False)
        >>> [(path, a, b) for path, a, b in walker.pairs({"x": [1, 2]}, {"x": [1, 3]})][1:]
        [("['x']", [1, 2], [1, 3]), ("['x'][0]", 1, 1), ("['x'][1]", 2, 3)]

        Raises:
            TransferError: The structures nest deeper than :data:`MAX_DEPTH` (a cycle).
        """
        stack: list[tuple[tuple[str, ...], Any, Any]] = [((), left, right)]
        while stack:
            fragments, a, b = stack.pop()
            yield "".join(fragments), a, b
            node = self.node_of(type(a)) if type(a) is type(b) else None
            if node is None or isinstance(a, set | frozenset):
                continue
            keys = list(node.keys(a))
            if keys != list(node.keys(b)):
                continue
            if len(fragments) >= MAX_DEPTH:
                path = format_path(self._root, fragments)
                msg = (
                    f"Expected data nested at most {MAX_DEPTH:,} containers deep, but {path} "
                    "goes deeper."
                )
                raise TransferError(msg)
            children = zip(keys, node.children(a), node.children(b), strict=True)
            stack.extend(((*fragments, key), x, y) for key, x, y in reversed(list(children)))

    def _walk(self, tree: Any, *, with_paths: bool) -> Iterator[tuple[str, Any]]:
        node = self.node_of(type(tree))
        if node is None:
            yield "", tree
            return
        stack: list[_Frame] = [(node, tree, iter(node.children(tree)), [])]
        # Parallel to `stack`: each frame's key iterator and its own path, when wanted.
        keys: list[Iterator[str] | None] = [iter(node.keys(tree)) if with_paths else None]
        paths = [""]
        while stack:
            children = stack[-1][2]
            child_keys = keys[-1]
            for child in children:
                path = paths[-1] + next(child_keys) if child_keys is not None else ""
                child_node = self.node_of(type(child))
                if child_node is None:
                    yield path, child
                    continue
                if len(stack) >= MAX_DEPTH:
                    raise self._too_deep(stack, child)
                stack.append((child_node, child, iter(child_node.children(child)), []))
                keys.append(iter(child_node.keys(child)) if with_paths else None)
                paths.append(path)
                break
            else:
                stack.pop()
                keys.pop()
                paths.pop()

    # Errors: the stack is the path, so it is only read here, once something failed.

    def _path(self, stack: list[_Frame], last: Any) -> str:
        fragments = [_key_of(parent, child[1]) for parent, child in itertools.pairwise(stack)]
        if stack:
            fragments.append(_key_of(stack[-1], last))
        return format_path(self._root, fragments)

    def _located(self, err: Exception, stack: list[_Frame], where: Any) -> Exception:
        path = self._path(stack, where)
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
