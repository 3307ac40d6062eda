"""The one traversal engine: nested data taken apart and put back together.

Every walk reads one view of the table (:mod:`devicekit._core._kinds`). :func:`flatten` lists
the leaves, :func:`unflatten` rebuilds the containers around new ones, :func:`paths`
names them (``['image']``, ``[3].boxes``) when asked, never on the way. :func:`map_flat`
is the three with one call on all the leaves between (small tensors go packed: the
accelerator path); :func:`map_leaves` gives its result in one fused pass, a call per
leaf (the host path, where a list costs more than a small batch's moves; tests/
test_tree.py holds them equal). Containers keep their type or are refused with their
path; cycles and absurd depth raise TransferError with a path (the walk keeps its own
stack); an error raised for a leaf gains its path. ``skip`` overrides the table for
one walk: values under those keys pass through as inert leaves.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Sequence
from typing import Any, Final, NamedTuple, NoReturn, TypeAlias

from devicekit._base import LeafError, TransferError
from devicekit._core import _kinds
from devicekit._core._kinds import INERT, MOVE, READ
from devicekit._core._nodes import DICT, LIST, TUPLE, Key, Node, rebuild_namedtuple

MAX_DEPTH: Final = 10_000
"""Containers nested deeper than this are refused: no real batch comes near it."""
TRACED_MAX_DEPTH: Final = 64
"""The same inside torch.compile, which rebuilds a nested result recursively, several
Python frames a level: about 90 levels exhaust Python's recursion limit there."""
_SCAN_FROM = 64  # lists at least this long are checked in one pass for leaves only
_PATH_SHOWN = 16  # path fragments a message shows before eliding the middle
_tuple_new = tuple.__new__  # a NamedTuple's own __new__ is a Python frame
# Per container, in the order they close (children first), read by unpacking: (end: the
# leaves seen when it closed, node: its rules, container, children: how many it has).
# Plain tuples: a NamedTuple made per container, and unpacked (UNPACK_SEQUENCE's fast path
# is for exact tuples), cost 1.1 us of 24.6 moving the mixed batch to the accelerator
# stand-in, 5 of 25 flattening 64 per-image dicts (bench_to_device.py's workloads).
Spec: TypeAlias = list[tuple[int, Node, Any, int]]
MoveAll: TypeAlias = Callable[[list[Any], Sequence[int], Any], list[Any]]
MoveEach: TypeAlias = Callable[[Sequence[Any]], "list[Any] | None"]
Kept: TypeAlias = tuple[type, Callable[[Any], bool], MoveEach | None]  # see map_leaves


class Flat(NamedTuple):
    """Data taken apart by :func:`flatten`: its leaves, and where the active ones are."""

    leaves: list[Any]
    spec: Spec
    active: list[int]


def format_path(root: str, keys: Iterable[Key | str]) -> str:
    """Join keys after a root name, eliding the middle of very long paths.

    >>> from devicekit._core._nodes import ATTRIBUTE, ITEM
    >>> format_path("data", [Key(ITEM, "image"), Key(ITEM, 0), Key(ATTRIBUTE, "boxes")])
    "data['image'][0].boxes"
    """
    parts = list(map(str, keys))
    if len(parts) > _PATH_SHOWN:
        half = _PATH_SHOWN // 2
        parts = [*parts[:half], f"...<{len(parts) - 2 * half:,} more levels>...", *parts[-half:]]
    return root + "".join(parts)


def _one_kind(values: Collection[Any], nodes: dict[type, Any], learn: Any, view: int) -> Any:
    """Whether children can be taken whole, at C speed: all INERT, all leaves (None), or no.

    A first child that is a container (most nested batches) says no at once.
    """
    if not values:
        return False
    first = _entry(type(next(iter(values))), nodes, learn, view)
    if first is not None and first is not INERT:
        return False
    kinds = set(map(type, values))
    if len(kinds) > 1 and any(_entry(kind, nodes, learn, view) is not first for kind in kinds):
        return False
    return first


def _entry(cls: type, nodes: dict[type, Any], learn: Callable[[type], Any], view: int) -> Any:
    try:
        return nodes[cls][view]
    except KeyError:
        return learn(cls)[view]


def flatten(  # noqa: PLR0912 - one loop on purpose: a call per container costs more
    tree: Any, *, view: int = MOVE, skip: frozenset[Hashable] | None = None
) -> Flat:
    """The leaves of ``tree`` in walk order, and how to put new ones in their place.

    >>> flat = flatten({"a": [1, (2, "x")], "b": None})
    >>> flat.leaves, flat.active, unflatten(flat.spec, [10, 20, "y", None])
    ([1, 2, 'x', None], [], {'a': [10, (20, 'y')], 'b': None})

    Raises:
        TransferError: The data nests deeper than :data:`MAX_DEPTH`, or holds a cycle.
    """
    # Rows by type, each read at ``view``: (move, cast, read, decision).
    nodes: dict[type, Any]
    learn: Callable[[type], Any]
    _kinds.follow_abcs()
    nodes, learn = (_kinds._decisions, _kinds.row) if skip is None else _kinds.skipping(skip)
    node = _entry(type(tree), nodes, learn, view)
    if node is None or node is INERT:
        return _tuple_new(Flat, ([tree], [], [] if node is INERT else [0]))
    if node is LIST or node is TUPLE or node is DICT:
        values = tree.values() if node is DICT else tree
        kind = _one_kind(values, nodes, learn, view)
        if kind is not False:  # scalars only, or leaves only: taken whole
            spec: Spec = [(len(values), node, tree, len(values))]
            return _tuple_new(
                Flat, ([*values], spec, [] if kind is INERT else [*range(len(values))])
            )
    leaves: list[Any] = []
    spec = []
    active: list[int] = []
    stack: list[tuple[Node, Any, Iterator[Any], int]] = []
    child_node: Any
    container, children, count = tree, iter(node.children(tree)), 0
    while True:
        for child in children:
            count += 1
            try:  # a subscript, not .get(): the interpreter's fast path for dicts
                child_node = nodes[type(child)][view]
            except KeyError:
                child_node = learn(type(child))[view]
            if child_node is None or child_node is INERT:
                if child_node is None:
                    active.append(len(leaves))
                leaves.append(child)
                continue
            if (child_node is LIST or child_node is TUPLE) and len(child) >= _SCAN_FROM:
                kind = _one_kind(child, nodes, learn, view)
                if kind is INERT:  # token ids: one inert leaf, a copy, as map_leaves makes
                    leaves.append(list(child) if child_node is LIST else child)
                    continue
                if kind is None:  # its elements become leaves in one step
                    active += range(len(leaves), len(leaves) + len(child))
                    leaves += child
                    spec.append((len(leaves), child_node, child, len(child)))
                    continue
            stack.append((node, container, children, count))
            if len(stack) >= MAX_DEPTH:  # a cycle, or honest depth: walk says which, and raises
                path_to(_NOWHERE, tree, _expand(nodes, learn, view))
            node, container, count = child_node, child, 0
            children = iter(node.children(child))
            break
        else:
            spec.append((len(leaves), node, container, count))
            if not stack:
                return _tuple_new(Flat, (leaves, spec, active))
            node, container, children, count = stack.pop()


def paths(flat: Flat) -> tuple[list[str], list[str]]:
    """The path of every leaf, and of every container in ``spec`` order.

    >>> paths(flatten({"a": [1, (2, "x")]}))
    (["['a'][0]", "['a'][1][0]", "['a'][1][1]"], ["['a'][1]", "['a']", ''])
    """
    if not flat.spec:
        return [""], []
    leaf_parents: list[tuple[int, str]] = [(-1, "")] * len(flat.leaves)  # (container, key)
    container_parents: list[tuple[int, str]] = [(-1, "")] * len(flat.spec)
    waiting: list[tuple[bool, int]] = []  # (is a leaf, its index): not placed yet
    taken = 0
    for number, (end, node, container, count) in enumerate(flat.spec):
        waiting += ((True, index) for index in range(taken, end))
        taken = end
        for key, (is_leaf, index) in zip(
            node.keys(container), waiting[-count:] if count else [], strict=True
        ):
            (leaf_parents if is_leaf else container_parents)[index] = (number, str(key))
        del waiting[len(waiting) - count :]
        waiting.append((False, number))
    found = [""] * len(flat.spec)
    for number in reversed(range(len(flat.spec) - 1)):  # the last to close is the root
        parent, fragment = container_parents[number]
        found[number] = found[parent] + fragment
    return [found[parent] + fragment for parent, fragment in leaf_parents], found


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
        # Its children are the last `count` values: its own leaves up to its close, and
        # the containers closed inside it.
        if count <= end - taken:  # no container inside: only new leaves
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
        elif node.rebuild is rebuild_namedtuple:
            values.append(_tuple_new(type(container), children))
        else:
            try:
                values.append(node.rebuild(container, children))
            except Exception as err:
                root = spec[-1][2]  # the last to close
                path = path_to(container, root, _expand_by(_nodes_of(spec)))
                _raise(_with_path(err, path, container))
    return values[0]


def map_flat(
    move_all: MoveAll, tree: Any, state: Any = None, *, skip: frozenset[Hashable] | None = None
) -> Any:
    """``tree`` rebuilt around ``move_all(leaves, active, state)``, its new leaves.

    ``active`` says where the leaves that are not inert are; ``state`` is the caller's.

    >>> import torch
    >>> def plus_one(leaves, active, state):
    ...     return [x + 1 if i in active else x for i, x in enumerate(leaves)]
    >>> map_flat(plus_one, {"a": [torch.zeros(1)], "n": 3})
    {'a': [tensor([1.])], 'n': 3}

    Raises:
        TransferError: As :func:`flatten`, or raised for a leaf (with its path); other
            errors raised for a leaf keep their type and gain a note with its path.
    """
    kind = type(tree)
    _kinds.follow_abcs()
    if skip is None and (kind is dict or kind is list or kind is tuple):
        # A flat batch ((images, labels), a dict of features), all leaves: flatten and
        # unflatten come down to a line each, a tenth of its host time. Only where the
        # table reads the container as plain: a rule registered for Sequence or Mapping
        # takes lists and dicts too.
        nodes = _kinds._decisions
        node = _entry(kind, nodes, _kinds.row, MOVE)
        values = tree.values() if kind is dict else tree
        plain = node is DICT if kind is dict else node is (LIST if kind is list else TUPLE)
        if plain and _one_kind(values, nodes, _kinds.row, MOVE) is None:
            try:
                moved = move_all([*values], range(len(values)), state)
            except Exception as err:
                _raise(_located_again(err, move_all, state, tree, skip))
            if kind is dict:
                return dict(zip(tree, moved))  # noqa: B905 - its own values, checked: 1/3 faster
            return moved if kind is list else tuple(moved)
    flat = flatten(tree, skip=skip)
    try:
        moved = move_all(flat.leaves, flat.active, state)
    except Exception as err:
        _raise(_located_again(err, move_all, state, tree, skip))
    return unflatten(flat.spec, moved)


def _nodes_of(spec: Spec) -> Callable[[Any], Node | None]:
    """The rules of each container a spec holds, by the container: a walk's ``node_of``."""
    nodes = {id(container): node for _, node, container, _ in spec}
    return lambda container: nodes.get(id(container))


def _located_again(
    err: Exception, move_all: MoveAll, state: Any, tree: Any, skip: frozenset[Hashable] | None
) -> Exception:
    """The error of the first leaf that fails alone, with its path; else ``err``.

    Moving again repeats no side effect: an object moves once per call (the mover's
    memo), a tensor's copy has none.
    """
    flat = flatten(tree, skip=skip)
    nodes, learn = (_kinds._decisions, _kinds.row) if skip is None else _kinds.skipping(skip)
    for index in flat.active:
        leaf = flat.leaves[index]
        try:
            move_all([leaf], [0], state)
        except Exception as again:
            return _with_path(again, path_to(leaf, tree, _expand(nodes, learn, MOVE)), leaf)
    return err


def map_leaves(  # noqa: PLR0912, PLR0915 - one loop, as in flatten
    fn: Callable[[Any, Any], Any],
    tree: Any,
    state: Any = None,
    *,
    view: int = MOVE,
    skip: frozenset[Hashable] | None = None,
    root: str | None = "data",
    max_depth: int = MAX_DEPTH,
    kept: Kept | None = None,
) -> Any:
    """``tree`` rebuilt with ``fn(leaf, state)`` applied to each leaf that is not inert.

    >>> import torch
    >>> map_leaves(lambda t, _: t + 1, {"a": [torch.zeros(1)], "n": 3})
    {'a': [tensor([1.])], 'n': 3}

    ``kept`` is ``(leaf type, stays, move_each)``, for a flat batch: a plain list, tuple
    or dict of fewer than 64 leaves, each of exactly that type. Where ``stays(leaf)`` is
    true of each (``fn`` gives such a leaf back as it is), it is copied without a call to
    ``fn``; else, unless ``move_each`` is None, it is rebuilt around ``move_each(leaves)``,
    ``fn`` at each leaf in one call, or walked where that gives None. ``stays`` is C-level
    (``operator.attrgetter``): a Python call per leaf would cost what it saves. An error
    in ``move_each`` is met again by the walk, which names the leaf it concerns.

    >>> import operator
    >>> batch = (torch.zeros(1), torch.ones(1))
    >>> on_cpu = (torch.Tensor, operator.attrgetter("is_cpu"), None)
    >>> map_leaves(lambda t, _: t.to("cpu"), batch, kept=on_cpu) == batch
    True
    >>> on_meta = operator.attrgetter("is_meta")
    >>> to_meta = (torch.Tensor, on_meta, lambda ts: [t.to("meta") for t in ts])
    >>> map_leaves(lambda t, _: t.to("meta"), batch, kept=to_meta)[0].device
    device(type='meta')

    Raises:
        TransferError: As :func:`map_flat`, paths starting at ``root``. Without a root (a
            walk inside a leaf the caller names) errors pass through as they are.
    """
    # Rows by type, each read at ``view``: (move, cast, read, decision).
    nodes: dict[type, Any]
    learn: Callable[[type], Any]
    _kinds.follow_abcs()
    nodes, learn = (_kinds._decisions, _kinds.row) if skip is None else _kinds.skipping(skip)
    kind = type(tree)
    try:  # inline, not a helper: a call costs a twentieth of a small batch's walk
        node = _entry(kind, nodes, learn, view)
    except LeafError as err:  # a type first met in a compiled region
        _raise(_with_path(err, root or "data", tree))
    if (
        kept is not None
        and (kind is tuple or kind is list or kind is dict)
        and (node is TUPLE or node is LIST or node is DICT)  # not a rule's, nor skip_keys'
        and len(tree) < _SCAN_FROM
    ):
        leaf, stays, move_each = kept
        values = tree.values() if kind is dict else tree
        for value in values:
            if type(value) is not leaf or not stays(value):
                break
        else:  # new containers, as the walk makes them: (*tree,) is a new tuple, tuple(tree) not
            return (*tree,) if kind is tuple else kind(tree)
        if move_each is not None and type(value) is leaf:  # one to move: and the others?
            for value in values:
                if type(value) is not leaf:
                    break
            else:
                try:
                    moved = move_each([*values] if kind is dict else tree)
                except Exception:  # the walk below meets it again, and names its leaf:
                    moved = None  # moving again repeats no side effect (a copy has none)
                if moved is not None:
                    if kind is dict:
                        return dict(zip(tree, moved))  # noqa: B905 - its own values
                    return moved if kind is list else tuple(moved)
    if (
        (node is LIST or node is TUPLE)
        and len(tree) >= _SCAN_FROM
        and _one_kind(tree, nodes, learn, view) is INERT
    ):
        return list(tree) if node is LIST else tree
    stack: list[tuple[Node, Any, Iterator[Any], list[Any]]] = []
    child_node: Any
    container: Any = None  # the root, in a frame of its own
    children, results = iter((tree,)), []
    while True:
        for child in children:
            try:  # as in flatten
                child_node = nodes[type(child)][view]
            except KeyError:
                try:
                    child_node = learn(type(child))[view]
                except LeafError as err:  # a type first met in a compiled region
                    _raise(_with_path(err, root or "data", child))
            if child_node is None:
                try:
                    results.append(fn(child, state))
                except Exception as err:
                    _raise(_located(err, tree, child, _expand(nodes, learn, view), root))
            elif child_node is INERT:
                results.append(child)
            elif (
                (child_node is LIST or child_node is TUPLE)
                and len(child) >= _SCAN_FROM  # before a call: most lists are short
                and _one_kind(child, nodes, learn, view) is INERT
            ):
                results.append(list(child) if child_node is LIST else child)
            else:
                stack.append((node, container, children, results))
                if len(stack) > max_depth:
                    if max_depth == MAX_DEPTH:  # a cycle, or honest depth: walk raises which
                        path_to(_NOWHERE, tree, _expand(nodes, learn, view), root or "data")
                    raise _too_deep_to_trace(max_depth)
                node, container, results = child_node, child, []
                children = iter(node.children(child))
                break
        else:
            if not stack:
                return results[0]
            # Lists, dicts, tuples and namedtuples are rebuilt inline: a call through
            # Node.rebuild would cost as much as the rebuild itself.
            result: Any
            if node is LIST:
                result = results
            elif node is DICT:
                result = dict(zip(container, results))  # noqa: B905 - same dict, same length
            elif node is TUPLE:
                result = tuple(results)
            elif node.rebuild is rebuild_namedtuple:
                result = _tuple_new(type(container), results)
            else:
                try:
                    result = node.rebuild(container, results)
                except Exception as err:
                    _raise(_located(err, tree, container, _expand(nodes, learn, view), root))
            node, container, children, results = stack.pop()
            results.append(result)


def _located(err: Exception, tree: Any, where: Any, expand: Expand, root: str | None) -> Exception:
    """``err``, raised for ``where``, with its path; a walk with no root does not walk again."""
    return err if root is None else _with_path(err, path_to(where, tree, expand, root), where)


def _raise(err: Exception) -> NoReturn:
    """Raise what a walk located with its own cause: ``from None`` would drop it too."""
    raise err from err.__cause__


def _with_path(err: Exception, path: str, where: Any) -> Exception:
    if isinstance(err, LeafError):
        located = TransferError(err.template.format(path=path))
        located.__cause__ = err.__cause__
        return located
    if not isinstance(err, TransferError) and hasattr(err, "add_note"):
        # Errors from PyTorch or user code keep their type (an out-of-memory error must
        # stay one); a note says where in the data they happened.
        err.add_note(f"devicekit: raised while handling {path} ({type(where).__name__}).")
    return err


def _too_deep_to_trace(limit: int) -> TransferError:
    msg = (
        f"Cannot move data inside torch.compile: it nests more than {limit} containers "
        "deep, deeper than the compiler can rebuild (it recurses once per level). Move it "
        "before the compiled region."
    )
    return TransferError(msg)


def _expand(nodes: dict[type, Any], learn: Callable[[type], Any], view: int) -> Expand:
    """Children as a walk of the table's ``view`` met them, skip_keys' overrides included."""
    return _expand_by(lambda value: _entry(type(value), nodes, learn, view))


def _expand_by(node_of: Callable[[Any], Any]) -> Expand:
    def expand(value: Any) -> Iterable[tuple[Key, Any]] | None:
        node = node_of(value)
        if type(node) is not Node:
            return None
        return zip(node.keys(value), node.children(value), strict=True)

    return expand


_NOWHERE: Final = object()  # found nowhere: walk all the way, refusing where it must


def path_to(where: Any, tree: Any, expand: Expand, root: str = "data") -> str:
    """The path of the first value in ``tree`` that is ``where``: how a walk's errors name it.

    Raises:
        TransferError: As :func:`walk`: ``tree`` nests deeper than :data:`MAX_DEPTH`, or
            holds a cycle (how flatten and map_leaves refuse them, from where they stopped).
    """
    for path, value in walk(tree, expand=expand, root=root):
        if value is where:
            return format_path(root, keys_of(path))
    return root


def too_deep_at(root: str, keys: Sequence[Key | str]) -> TransferError:
    """The refusal of a container ``MAX_DEPTH`` deep: every walk's message.

    ``keys`` lead from ``root`` to the container refused, one per level.

    >>> print(too_deep_at("Net.table", ["[0]"] * 3))
    Expected data nested at most 10,000 containers deep, but Net.table[0][0][0] goes deeper.
    """
    path = format_path(root, keys)
    return TransferError(
        f"Expected data nested at most {MAX_DEPTH:,} containers deep, but {path} goes deeper."
    )


# A path, linked: (the path of the container, the key there); () for the walk's root.
# A level costs one tuple however deep it is, and values below one container share it.
Path: TypeAlias = "tuple[Path, Key] | tuple[()]"
Expand: TypeAlias = Callable[[Any], "Iterable[tuple[Key, Any]] | None"]


def keys_of(path: Path) -> list[Key]:
    """The keys from the walk's root to ``path``'s value, outermost first.

    >>> path, value = list(walk({"a": [1]}))[-1]
    >>> [str(key) for key in keys_of(path)], value
    (["['a']", '[0]'], 1)
    """
    keys: list[Key] = []
    while path:
        path, key = path
        keys.append(key)
    keys.reverse()
    return keys


def contents(value: Any, view: int = READ) -> Iterable[tuple[Key, Any]] | None:
    """A container's children with their keys, as the table's ``view`` has them; else None.

    >>> [(str(key), child) for key, child in contents({"a": 1, "b": [2]})]
    [("['a']", 1), ("['b']", [2])]
    """
    node = _kinds.decide(type(value))[view]
    if not isinstance(node, Node):
        return None
    return zip(node.keys(value), node.children(value), strict=True)


def walk(
    tree: Any,
    *,
    expand: Expand = contents,
    seen: dict[int, Any] | None = None,
    root: str = "data",
    at: Path = (),
) -> Iterator[tuple[Path, Any]]:
    """Every value in ``tree`` with its path, each before what it holds: pickle's order.

    ``expand(value)`` gives a value's children with their keys, or None for a leaf (by
    default the table's READ view, :func:`contents`). The walk keeps its own stack: a
    container :data:`MAX_DEPTH` levels down is refused, as :func:`flatten` refuses it.
    With ``seen``, a dict the caller may share between walks, each container is
    entered once (a cycle is walked once); without, a cycle is refused. ``at`` is the
    path of ``tree`` itself (where the caller found it), which the paths extend; ``root``
    names ``tree`` in messages.

    >>> [(format_path("data", keys_of(path)), value) for path, value in walk({"a": [1]})]
    [('data', {'a': [1]}), ("data['a']", [1]), ("data['a'][0]", 1)]

    Raises:
        TransferError: A container nests deeper than :data:`MAX_DEPTH`, or (without
            ``seen``) holds itself; the message names its path from ``root``.
    """
    yield at, tree
    below = expand(tree)
    if below is None:
        return
    above = len(keys_of(at))  # keys a message leaves to root

    def named(path: Path) -> str:
        return format_path(root, keys_of(path)[above:])

    open_: dict[int, Path] = {id(tree): at}  # the containers around the value: a cycle's test
    if seen is not None:
        seen[id(tree)] = tree
    stack: list[tuple[Path, Any, Iterator[tuple[Key, Any]]]] = [(at, tree, iter(below))]
    while stack:
        path, container, children = stack[-1]
        for key, child in children:
            here = (path, key)
            yield here, child
            held = expand(child)
            if held is None:
                continue
            if seen is not None:
                if id(child) in seen:
                    continue
                seen[id(child)] = child  # kept alive: its id is not reused during the walk
            elif id(child) in open_:
                msg = (
                    f"Expected data without reference cycles, but {named(here)} is the "
                    f"{type(child).__name__} {named(open_[id(child)])} itself, which contains it."
                )
                raise TransferError(msg)
            if len(stack) >= MAX_DEPTH:
                raise too_deep_at(root, keys_of(here)[above:])
            open_[id(child)] = here
            stack.append((here, child, iter(held)))
            break
        else:
            stack.pop()
            open_.pop(id(container), None)
