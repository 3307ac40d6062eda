"""The one table of per-type decisions: what each type is, and how it is taken apart and moved.

Every walk over user data reads this table and keeps no cache of its own: to_device
(its host, accelerator, ``skip_keys`` and compiled paths), the checks, pinning in the
loader, and devicekit.testing. For each type the table decides once:

* whether it is a *container*, and how to take it apart and rebuild it (a :class:`Node`);
* whether it is *inert* (a plain scalar: passed through untouched, never even called);
* otherwise it is a *leaf*, and :class:`Leaf` says how it moves: a tensor, a module, a
  registered rule, its own ``.to()``...;
* for leaves that hold tensors (modules, optimizers, objects that move themselves), how
  to look inside them: their *contents*, named as the user writes them (``data.x``,
  ``sample.label``), so the checks see every tensor to_device moves.

A walk asks through one of three *views* of the table, each a plain dict from type to
Node, :data:`LEAF` or :data:`INERT`, filled together when a type is first met:

========  =========================================================================
``MOVE``  containers only: what to_device, pinning and the testing helpers walk
``CAST``  also the contents of objects that moved with their own ``.to()``: where
          ``dtype``, ``memory_format`` and ``copy`` are applied after the move
``READ``  also the contents of modules and optimizers: what the checks see
========  =========================================================================

:func:`register_transfer` and :func:`unregister_transfer` change the registry and drop
every decision under one lock, and decisions are only ever made under that lock, so no
decision drawn from the registry before a change survives it.

The rules for objects with a ``.to()``:

* dicts and UserDicts are containers even with a ``.to()``: they are rebuilt item by
  item (transformers' ``BatchEncoding.to`` moves its input in place, and skips nested
  values);
* any other type with a ``.to()`` moves with it (a TensorDict, which is a mapping, a
  PackedSequence, which is a namedtuple), and always on a shallow copy
  (``copy.copy``): a ``.to()`` that moves in place and returns self (torch_geometric's
  ``Data``) then changes the copy, one that returns a new object (TensorDict) leaves
  the copy unused, and in neither case does the input change;
* ``dtype``, ``memory_format`` and ``copy`` are never handed to such a ``.to()``,
  which may apply them to every tensor it holds (a PackedSequence of token ids cast to
  float16); devicekit applies them itself to the contents, after the move.
"""

from __future__ import annotations

import abc
import array
import collections
import copy
import dataclasses
import enum
import functools
import inspect
import numbers
import threading
from collections import UserDict, UserList
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any, Final, NamedTuple, Protocol, TypeVar

import torch

from devicekit._errors import LeafError

__all__ = [
    "CAST",
    "DICT",
    "INERT",
    "INERT_TYPES",
    "LEAF",
    "LIST",
    "MOVE",
    "READ",
    "TUPLE",
    "TYPES_KEPT",
    "Leaf",
    "Node",
    "TransferRule",
    "decide",
    "leaf_how",
    "mapping_items",
    "register_transfer",
    "unregister_transfer",
    "view",
]

TYPES_KEPT: Final = 1024
"""How many types the table holds before it starts over: types made at run time must
not pile up."""

MOVE: Final = 0
CAST: Final = 1
READ: Final = 2

LEAF: Any = None
"""In a view: the type's instances are leaves."""
INERT: Any = type("Inert", (), {"__repr__": lambda self: "INERT"})()
"""In a view: the type's instances are plain scalars, passed through untouched."""


class Node(NamedTuple):
    """How to take one kind of container apart and rebuild it."""

    children: Callable[[Any], Iterable[Any]]
    """The container's children, in a fixed order."""
    rebuild: Callable[[Any, list[Any]], Any]
    """A container like the old one holding the given children, in the same order."""
    keys: Callable[[Any], Iterable[str]]
    """Path fragments naming each child (``['image']``, ``[3]``, ``.boxes``)."""
    mapping: bool = False
    """Whether the children are a mapping's values, in :func:`mapping_items` order."""


class Leaf(enum.Enum):
    """How a leaf moves: to_device's mover has one branch per member."""

    TENSOR = enum.auto()  # a torch.Tensor, or a subclass, moved with Tensor.to
    PARAMETER = enum.auto()  # moved as a tensor and wrapped again, as nn.Module.to does
    MODULE = enum.auto()  # moved in place and returned, nn.Module.to semantics
    OPTIMIZER = enum.auto()  # its state follows its parameters
    RULE = enum.auto()  # registered with register_transfer; detail: the rule
    TO_METHOD = enum.auto()  # its own .to(), on a copy; detail: whether it takes non_blocking
    ARRAY = enum.auto()  # a numpy array: kept, unless it holds tensors
    KEPT = enum.auto()  # a scalar, an enum member: kept, strict or not
    OTHER = enum.auto()  # anything else: kept, or refused with strict=True


class TransferRule(Protocol):
    """How to move one user type: ``rule(obj, device, **options)`` returns the moved object.

    ``options`` are ``non_blocking`` (a bool), ``dtype``, ``copy`` and
    ``memory_format``, exactly as :func:`~devicekit.to_device` received them
    (``non_blocking`` resolved from ``"auto"``).
    """

    def __call__(self, obj: Any, device: torch.device, /, **options: Any) -> Any: ...


# Plain values, passed through untouched by every walk unless a rule is registered for
# their exact type: scalars, and the settings a batch or a config carries.
INERT_TYPES: Final = frozenset(
    {
        type(None),
        bool,
        int,
        float,
        complex,
        str,
        bytes,
        range,
        slice,
        type(Ellipsis),
        torch.dtype,
        torch.device,
        torch.layout,
        torch.memory_format,
    }
)
# Kept as they are, strict or not: subclasses of the scalars above, enum members,
# numbers of other libraries (numpy's scalars).
_KEPT_BASES = (*INERT_TYPES, enum.Enum, numbers.Number)
# Sequences of numbers or bytes: leaves, as strings are, never containers.
_FLAT_SEQUENCES = (str, bytes, bytearray, range, memoryview, array.array)


def _refusal(node: Any, why: str) -> LeafError:
    name = type(node).__name__
    msg = (
        f"Cannot rebuild {{path}}: it is a {type(node).__module__}.{name}, {why}. Register "
        f"how to move it with @devicekit.register_transfer({name})."
    )
    return LeafError(msg)


C = TypeVar("C")


def _own_copy(node: C) -> C:
    """A shallow copy, which keeps what a subclass carries beyond its items.

    A defaultdict keeps its factory and BatchEncoding its encodings, as in torch's
    pin_memory. A copy that is the object itself cannot be filled without changing it.
    """
    clone = copy.copy(node)
    if clone is node:
        raise _refusal(node, "whose copy is the object itself")
    return clone


# Mappings. Children and keys come from one reading each time, so every value is
# paired with its own key, whatever a subclass does to __iter__, keys() or values().


def mapping_items(node: Mapping[Any, Any]) -> list[tuple[Any, Any]]:
    """A mapping's (key, value) pairs as every mapping rule reads them.

    dict's own methods for dicts and their subclasses, a UserDict's ``data``, and
    ``items()`` for any other mapping.

    >>> mapping_items(collections.OrderedDict(b=1, a=2))
    [('b', 1), ('a', 2)]
    """
    if isinstance(node, dict):
        return list(dict.items(node))
    if isinstance(node, UserDict):
        return list(node.data.items())
    return list(node.items())


def _keys_of(node: Mapping[Any, Any]) -> Iterator[str]:
    return (f"[{key!r}]" for key, _ in mapping_items(node))


def _mirror(clone: Any, items: Iterable[tuple[Any, Any]], values: list[Any]) -> None:
    """Attributes that mirror items get the items' new values.

    transformers' ModelOutput keeps each field both as an item and as an attribute
    (``out["logits"]`` and ``out.logits``): the copy's attributes still hold the old
    values until they are replaced here.
    """
    state = getattr(clone, "__dict__", None)
    if not state:
        return
    for (key, old), new in zip(items, values, strict=True):
        if type(key) is str and state.get(key, clone) is old:
            state[key] = new


def _rebuild_dict(node: dict[Any, Any], values: list[Any]) -> dict[Any, Any]:
    return dict(zip(node, values, strict=True))


def _rebuild_dict_subclass(node: dict[Any, Any], values: list[Any]) -> dict[Any, Any]:
    # A dict subclass's items live in the dict itself, so its copy has storage of its
    # own; dict's own methods are used, not the subclass's.
    clone = _own_copy(node)
    for key, value in zip(dict.keys(node), values, strict=True):
        dict.__setitem__(clone, key, value)
    _mirror(clone, dict.items(node), values)
    return clone


def _rebuild_user_dict(node: UserDict[Any, Any], values: list[Any]) -> UserDict[Any, Any]:
    clone = _own_copy(node)
    if clone.data is node.data:
        raise _refusal(node, "a UserDict whose copy shares its data with the original")
    clone.data = dict(zip(node.data, values, strict=True))
    _mirror(clone, node.data.items(), values)
    return clone


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


def _mapping_values(node: Mapping[Any, Any]) -> list[Any]:
    return [value for _, value in mapping_items(node)]


DICT = Node(lambda node: node.values(), _rebuild_dict, _keys_of, mapping=True)
_DICT_SUBCLASS = Node(_mapping_values, _rebuild_dict_subclass, _keys_of, mapping=True)
_USER_DICT = Node(lambda node: node.data.values(), _rebuild_user_dict, _keys_of, mapping=True)
_READ_ONLY_MAPPING = Node(_mapping_values, _rebuild_read_only_mapping, _keys_of, mapping=True)
_MUTABLE_MAPPING = Node(_mapping_values, _refuse_mutable_mapping, _keys_of, mapping=True)


# Sequences.


def _index_keys(node: Iterable[Any]) -> Iterator[str]:
    return (f"[{index}]" for index, _ in enumerate(node))


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


def rebuild_namedtuple(node: tuple[Any, ...], values: list[Any]) -> tuple[Any, ...]:
    """A namedtuple of the same type holding ``values``, built as its ``_make`` builds it.

    A ``__new__`` of the class's own is not run again: it ran when the original was
    made, and running it on values it already produced could apply it twice.
    """
    return tuple.__new__(type(node), values)


def _rebuild_by_type(node: Any, values: list[Any]) -> Any:
    return type(node)(values)


LIST = Node(iter, lambda node, values: values, _index_keys)
TUPLE = Node(iter, lambda node, values: tuple(values), _index_keys)
_LIST_SUBCLASS = Node(iter, _rebuild_list_subclass, _index_keys)
_DEQUE = Node(iter, _rebuild_deque, _index_keys)
_USER_LIST = Node(lambda node: node.data, _rebuild_user_list, _index_keys)
_OTHER_SEQUENCE = Node(iter, _refuse_sequence, _index_keys)
_TUPLE_SUBCLASS = Node(iter, _rebuild_by_type, _index_keys)  # torch.Size, struct sequences
_SET = Node(iter, _rebuild_by_type, lambda node: (f"{{{i}}}" for i, _ in enumerate(node)))


_NAMEDTUPLE = Node(iter, rebuild_namedtuple, lambda node: (f".{name}" for name in node._fields))


# Dataclasses, and objects read through their attributes.

_UNSET: Any = type("Unset", (), {"__repr__": lambda self: "<unset>"})()
"""A dataclass field never set (``field(init=False)``): a child that stays unset."""


def _write_attributes(obj: Any, names: Iterable[str], values: list[Any]) -> Any:
    """Set the attributes whose values changed on ``obj``, an object devicekit owns.

    Used on what a ``.to()`` returned, never on the input. A frozen dataclass is set as
    dataclasses set its fields; an attribute that refuses to be set is refused here.
    """
    for name, value in zip(names, values, strict=True):
        if value is _UNSET or getattr(obj, name, _UNSET) is value:
            continue
        try:
            setattr(obj, name, value)
        except dataclasses.FrozenInstanceError:
            object.__setattr__(obj, name, value)
        except (AttributeError, TypeError) as err:
            name_of_type = type(obj).__name__
            msg = (
                f"Cannot apply the options to {{path}}.{name}: the {name_of_type} that "
                f"{name_of_type}.to() returned refuses a new value there ({err}). Register "
                f"how to move it with @devicekit.register_transfer({name_of_type})."
            )
            raise LeafError(msg) from err
    return obj


def _dataclass_node(cls: type, *, writes: bool) -> Node:
    """Rules for a dataclass: its fields, and attributes its instances gained since.

    A rebuilt instance is made without running ``__init__`` or ``__post_init__`` again
    (which could apply a computation twice, or need an InitVar it no longer has): each
    field and each attribute set outside the fields (in ``__post_init__``, say) is set
    as dataclasses set frozen fields. Values cached by ``functools.cached_property`` are
    left out: they would describe the old fields. With ``writes``, the changed fields
    are set on the object itself (one a ``.to()`` returned: a tensorclass keeps its
    fields in storage of its own).
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
        if writes:
            return fields
        state = getattr(node, "__dict__", None)
        if not state:
            return fields
        extra = tuple(name for name in state if name not in known and name not in cached)
        return fields + extra if extra else fields

    def children(node: Any) -> list[Any]:
        return [getattr(node, name, _UNSET) for name in names(node)]

    def rebuild(node: Any, values: list[Any]) -> Any:
        if writes:
            return _write_attributes(node, fields, values)
        clone: Any = cls.__new__(cls)  # type: ignore[call-overload] # not __init__
        for name, value in zip(names(node), values, strict=True):
            if value is not _UNSET:
                object.__setattr__(clone, name, value)
        return clone

    def keys(node: Any) -> Iterator[str]:
        return (f".{name}" for name in names(node))

    return Node(children, rebuild, keys)


def _attributes_node() -> Node:
    def children(obj: Any) -> list[Any]:
        return list(vars(obj).values())

    def rebuild(obj: Any, values: list[Any]) -> Any:
        return _write_attributes(obj, list(vars(obj)), values)

    return Node(children, rebuild, lambda obj: (f".{name}" for name in vars(obj)))


def _write_items(obj: Any, values: list[Any]) -> Any:
    for (key, old), new in zip(mapping_items(obj), values, strict=True):
        if new is not old:
            obj[key] = new
    return obj


# torch_geometric's graphs (Data, its Batch, HeteroData) keep their attributes in
# stores: read there, each named as users write it (data.x, data['paper'].x,
# data['paper', 'cites', 'paper'].edge_index).


def _store_prefix(store: Any) -> str:
    key = getattr(store, "_key", None)
    if key is None:
        return ""
    return "[" + (", ".join(map(repr, key)) if isinstance(key, tuple) else repr(key)) + "]"


def _graph_entries(graph: Any) -> list[tuple[Any, str, Any]]:
    return [
        (store, f"{_store_prefix(store)}.{name}", value)
        for store in graph.stores
        for name, value in store.items()
    ]


def _rebuild_graph(graph: Any, values: list[Any]) -> Any:
    for (store, key, old), new in zip(_graph_entries(graph), values, strict=True):
        if new is not old:
            store[key.rpartition(".")[2]] = new
    return graph


_GRAPH = Node(
    lambda graph: [value for _, _, value in _graph_entries(graph)],
    _rebuild_graph,
    lambda graph: [key for _, key, _ in _graph_entries(graph)],
)


def _is_graph(cls: type) -> bool:
    # Known by name: torch_geometric is never imported to ask.
    return any(
        klass.__name__ == "BaseData" and klass.__module__.startswith("torch_geometric.")
        for klass in cls.__mro__
    )


def _contents(cls: type) -> Node | None:
    """How to see, and set, what an object that moves itself holds, in the user's names."""
    if _is_graph(cls):
        return _GRAPH
    if issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple):
        return _NAMEDTUPLE  # PackedSequence
    if dataclasses.is_dataclass(cls):
        return _dataclass_node(cls, writes=True)  # tensordict's tensorclasses
    if issubclass(cls, Mapping):
        return Node(_mapping_values, _write_items, _keys_of, mapping=True)  # TensorDict
    if hasattr(cls, "__dict__") and not issubclass(cls, type):
        return _ATTRIBUTES
    return None


_ATTRIBUTES = _attributes_node()


# Modules and optimizers: read, never rebuilt.


def _read_only(kind: str) -> Callable[[Any, list[Any]], Any]:
    def rebuild(obj: Any, values: list[Any]) -> Any:
        msg = f"Cannot rebuild {{path}}: {kind} is read by the checks, never rebuilt."
        raise LeafError(msg)

    return rebuild


def _module_entries(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(), *module.named_buffers()]


def _optimizer_entries(optimizer: torch.optim.Optimizer) -> list[tuple[str, Any]]:
    """Parameters and state, without what PyTorch keeps on the host on purpose.

    A ``step`` of an optimizer that is neither capturable nor fused is a host tensor
    by design (Optimizer.load_state_dict puts it there, and to_device leaves it).
    """
    found: list[tuple[str, Any]] = []
    for group_index, group in enumerate(optimizer.param_groups):
        step_on_host = not (group.get("capturable") or group.get("fused"))
        for param_index, param in enumerate(group["params"]):
            where = f"param_groups[{group_index}]['params'][{param_index}]"
            found.append((f".{where}", param))
            for key, value in optimizer.state.get(param, {}).items():
                if key == "step" and step_on_host:
                    continue
                found.append((f".state[{where}][{key!r}]", value))
    return found


def _entries_node(entries: Callable[[Any], list[tuple[str, Any]]], kind: str) -> Node:
    return Node(
        lambda obj: [value for _, value in entries(obj)],
        _read_only(kind),
        lambda obj: [name if name.startswith(".") else f".{name}" for name, _ in entries(obj)],
    )


_MODULE = _entries_node(_module_entries, "a module")
_OPTIMIZER = _entries_node(_optimizer_entries, "an optimizer")


def container_node(cls: type) -> Node | None:  # noqa: PLR0912 - one rule per kind
    """The container rules for a type, or None when its instances are not containers.

    >>> container_node(dict) is DICT, container_node(str)
    (True, None)
    """
    if cls is dict:
        return DICT
    if cls is list:
        return LIST
    if cls is tuple:
        return TUPLE
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
            return _NAMEDTUPLE
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
        return _dataclass_node(cls, writes=False)
    return None


# The registry of user rules.

_rules: dict[type, TransferRule] = {}
_lock = threading.Lock()  # the registry and the decisions change together under it


def _rule_for(cls: type) -> TransferRule | None:
    """The registered rule that applies to ``cls``, if any; called under the lock.

    The nearest class in its MRO that has a rule wins; then abstract base classes with
    rules, in the order registered, for the classes they recognise without inheritance
    (``collections.abc.Sequence`` covers ``list``).
    """
    if not _rules:
        return None
    for klass in cls.__mro__:
        rule = _rules.get(klass)
        if rule is not None:
            return rule
    for base, rule in _rules.items():
        metaclass: type = type(base)
        if issubclass(metaclass, abc.ABCMeta) and issubclass(cls, base):
            return rule
    return None


def _takes_non_blocking(cls: type) -> bool:
    """Whether ``cls.to`` takes ``non_blocking=``, read once from its signature."""
    try:
        parameters = inspect.signature(cls.to).parameters.values()  # type: ignore[attr-defined]
    except (TypeError, ValueError):  # no signature to read: hand it the device only
        return False
    return any(
        p.name == "non_blocking" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters
    )


class Decision(NamedTuple):
    """Everything the walks and the mover need to know about one type."""

    move: Any
    """In the MOVE view: a Node, LEAF or INERT."""
    cast: Any
    """In the CAST view: the contents of what moved with its own ``.to()``, or as in MOVE."""
    read: Any
    """In the READ view: the contents of every leaf that holds tensors, or as in MOVE."""
    leaf: Leaf | None
    """How a leaf moves; None for containers and inert types."""
    detail: Any = None
    """The registered rule, or whether a ``.to()`` takes ``non_blocking``."""


def _decide(cls: type) -> Decision:
    """The decision for ``cls``, from the registry as it is now; called under the lock."""
    rule = _rule_for(cls)
    if rule is not None:
        return Decision(LEAF, LEAF, _contents(cls), Leaf.RULE, rule)
    if issubclass(cls, torch.Tensor):
        kind = Leaf.PARAMETER if issubclass(cls, torch.nn.Parameter) else Leaf.TENSOR
        return Decision(LEAF, LEAF, LEAF, kind)
    if issubclass(cls, torch.nn.Module):
        return Decision(LEAF, LEAF, _MODULE, Leaf.MODULE)
    if issubclass(cls, torch.optim.Optimizer):
        return Decision(LEAF, LEAF, _OPTIMIZER, Leaf.OPTIMIZER)
    if cls in INERT_TYPES or cls is type(_UNSET):
        return Decision(INERT, INERT, INERT, None)
    if issubclass(cls, _KEPT_BASES):
        return Decision(LEAF, LEAF, LEAF, Leaf.KEPT)
    node = container_node(cls)
    moves_itself = callable(getattr(cls, "to", None))
    if node is not None and not (moves_itself and not issubclass(cls, dict | UserDict)):
        return Decision(node, node, node, None)
    if moves_itself:
        contents = _contents(cls)
        return Decision(LEAF, contents, contents, Leaf.TO_METHOD, _takes_non_blocking(cls))
    if cls.__module__ == "numpy" and cls.__name__ == "ndarray":  # numpy is not imported
        return Decision(LEAF, LEAF, LEAF, Leaf.ARRAY)
    return Decision(LEAF, LEAF, LEAF, Leaf.OTHER)


# The views, rebound (never cleared in place) when the registry changes: a walk that
# began before the change reads one consistent set of decisions to its end.
_views: tuple[dict[type, Any], dict[type, Any], dict[type, Any]] = ({}, {}, {})
_leaves: dict[type, tuple[Leaf | None, Any]] = {}


def view(number: int) -> dict[type, Any]:
    """The current MOVE, CAST or READ view: type -> Node, LEAF or INERT.

    A walk reads one view from start to end; a type missing from it is decided with
    :func:`decide`, which fills every view at once.
    """
    return _views[number]


def decide(cls: type) -> Decision:
    """Decide for ``cls`` from the registry, under the lock, and record it in every view."""
    if torch.compiler.is_compiling():
        return _traced_decision(cls)
    return _decided(cls)


def _decided(cls: type) -> Decision:
    global _views, _leaves
    with _lock:
        decision = _decide(cls)
        if len(_leaves) >= TYPES_KEPT:
            _views, _leaves = ({}, {}, {}), {}
        _views[MOVE][cls], _views[CAST][cls], _views[READ][cls] = decision[:3]
        _leaves[cls] = decision.leaf, decision.detail
    return decision


# Under torch.compile. A decision is made in Python while the compiler traces (making
# it takes a lock and reads the registry, which no graph can hold), and handed to the
# trace as constants: the names of the nodes, which are module-level objects the
# compiler can follow, and the Leaf member. The nodes made for one class (a dataclass's,
# the contents of an object that moves itself) have no such name: the traced walk
# refuses those types where it meets them for the first time.
_NAMED: Final[dict[str, Any]] = {
    "LEAF": LEAF,
    "INERT": INERT,
    "dict": DICT,
    "list": LIST,
    "tuple": TUPLE,
    "namedtuple": _NAMEDTUPLE,
    "dict subclass": _DICT_SUBCLASS,
    "UserDict": _USER_DICT,
    "read-only mapping": _READ_ONLY_MAPPING,
    "mutable mapping": _MUTABLE_MAPPING,
    "list subclass": _LIST_SUBCLASS,
    "deque": _DEQUE,
    "UserList": _USER_LIST,
    "sequence": _OTHER_SEQUENCE,
    "tuple subclass": _TUPLE_SUBCLASS,
    "set": _SET,
    "module": _MODULE,
    "optimizer": _OPTIMIZER,
}
_NAMES: Final = {id(entry): name for name, entry in _NAMED.items()}


def _names_of_decision(cls: type) -> tuple[str, str, str, Leaf | None]:
    decision = _decided(cls)
    move, cast, read = (_NAMES.get(id(entry), "") for entry in decision[:3])
    return move, cast, read, decision.leaf


_decision_names: Callable[[type], tuple[str, str, str, Leaf | None]] = (
    torch.compiler.assume_constant_result(_names_of_decision)  # type: ignore[no-untyped-call]
)


def _traced_decision(cls: type) -> Decision:
    move, cast, read, leaf = _decision_names(cls)
    if move and cast and read:
        return Decision(_NAMED[move], _NAMED[cast], _NAMED[read], leaf)
    msg = (
        f"Cannot move {{path}} inside torch.compile: devicekit meets the type "
        f"{cls.__module__}.{cls.__qualname__} there for the first time, and how it learns a "
        "new dataclass or a new object that moves itself cannot be traced. Move the data "
        "before the compiled region, or move one such object with devicekit.to_device "
        "before compiling."
    )
    raise LeafError(msg)


def leaf_how(cls: type) -> tuple[Leaf | None, Any]:
    """How a leaf of type ``cls`` moves: its :class:`Leaf`, and the rule or detail it needs."""
    try:
        return _leaves[cls]
    except KeyError:
        decision = decide(cls)
        return decision.leaf, decision.detail


def _forget() -> None:
    """Drop every decision; called under the lock when the registry changes."""
    global _views, _leaves
    _views, _leaves = ({}, {}, {}), {}


F = TypeVar("F", bound=Callable[..., Any])


def register_transfer(cls: type) -> Callable[[F], F]:
    """Register how :func:`~devicekit.to_device` moves instances of ``cls``.

    A registered rule wins over the type's ``.to()`` method and over the container
    rules, so it also serves containers that must not be rebuilt item by item. It
    applies to ``cls`` and its subclasses, the nearest registered class in a type's MRO
    winning; a rule for an abstract base class applies to every class it recognises
    (one for ``collections.abc.Sequence`` takes lists too). It takes effect for every
    call that starts after it returns, in every thread.

    >>> import dataclasses, torch, devicekit as dk
    >>> @dataclasses.dataclass
    ... class Boxes:
    ...     xyxy: torch.Tensor
    ...     image_size: tuple[int, int]
    >>> @dk.register_transfer(Boxes)
    ... def move_boxes(boxes, device, **options):
    ...     return Boxes(boxes.xyxy.to(device), boxes.image_size)
    >>> dk.to_device(Boxes(torch.zeros(1, 4), (32, 32)), "meta").xyxy.device
    device(type='meta')
    >>> dk.unregister_transfer(Boxes)

    Args:
        cls: The type whose instances the decorated function moves.

    Returns:
        A decorator that registers ``fn(obj, device, **options) -> moved`` and returns it
        unchanged. ``options`` are ``non_blocking``, ``dtype``, ``copy`` and ``memory_format``.

    Raises:
        TypeError: ``cls`` is not a class, is :class:`torch.Tensor` (moved by to_device
            itself) or ``object`` (whose rule would take every leaf); or what is
            decorated is not callable.
        ValueError: ``cls`` has a rule already; :func:`unregister_transfer` removes it.
    """
    if not isinstance(cls, type):  # for callers without a type checker
        msg = f"Expected a class to register a transfer rule for, got {type(cls).__name__} {cls!r}."  # type: ignore[unreachable]
        raise TypeError(msg)
    if cls is torch.Tensor:
        msg = (
            "Expected a user type, got torch.Tensor: tensors are moved by to_device itself. "
            "Register a tensor subclass instead."
        )
        raise TypeError(msg)
    if cls is object:
        msg = (
            "Expected a type narrower than object: a rule for object would take every leaf "
            "and every container of every batch. Register the types you mean."
        )
        raise TypeError(msg)

    def decorator(fn: F) -> F:
        if not callable(fn):  # for callers without a type checker
            msg = (  # type: ignore[unreachable]
                f"Expected a function fn(obj, device, **options) to register for "
                f"{cls.__name__}, got {type(fn).__name__} {fn!r}."
            )
            raise TypeError(msg)
        with _lock:
            existing = _rules.get(cls)
            if existing is not None:
                name = f"{existing.__module__}.{getattr(existing, '__qualname__', existing)}"
                msg = (
                    f"{cls.__name__} already has a transfer rule ({name}); call "
                    f"devicekit.unregister_transfer({cls.__name__}) first to replace it."
                )
                raise ValueError(msg)
            _rules[cls] = fn
            _forget()
        return fn

    return decorator


def unregister_transfer(cls: type) -> None:
    """Remove the rule :func:`register_transfer` registered for ``cls``.

    >>> import devicekit as dk
    >>> @dk.register_transfer(complex)
    ... def move_complex(value, device, **options):
    ...     return value
    >>> dk.unregister_transfer(complex)

    Raises:
        KeyError: ``cls`` has no rule registered.
    """
    with _lock:
        if cls not in _rules:
            msg = f"{getattr(cls, '__name__', cls)} has no transfer rule to unregister."
            raise KeyError(msg)
        del _rules[cls]
        _forget()
