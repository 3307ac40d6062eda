"""The one table of per-type decisions: what each type is, how it is taken apart and moved.

Every walk reads it and keeps no cache of its own: to_device (host, accelerator,
``skip_keys``, compiled), the checks, pinning, devicekit.testing. A type is decided once,
under the registry's lock: a container (its :class:`Node`), inert (a plain scalar,
passed through untouched), or a leaf whose :class:`Leaf` says how it moves; leaves that
hold tensors have *contents*, named as users write them (``data.x``). Walks read one
view: MOVE (containers), CAST (also what a ``.to()`` returned, where ``dtype``,
``memory_format`` and ``copy`` are applied after it), READ (also modules, optimizers
and registered types: the checks).

Dicts and UserDicts are containers even with a ``.to()`` (transformers'
``BatchEncoding.to`` moves in place and skips nested values); any other type with one
moves with it (TensorDict, PackedSequence), on a shallow copy, so that an in-place
``.to()`` (torch_geometric's ``Data``) never changes the input, and without ``dtype``,
which it would apply to every tensor it holds (token ids cast to float16).
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
import typing
from collections import UserDict, UserList
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from typing import Any, Final, NamedTuple, TypeVar

import torch

from devicekit import _compat
from devicekit._errors import LeafError

TYPES_KEPT: Final = 1024
"""Types the table holds before it starts over: types made at run time must not pile up."""
MOVE: Final = 0
CAST: Final = 1
READ: Final = 2
LEAF: Any = None
"""In a view: the type's instances are leaves."""
INERT: Any = type("Inert", (), {"__repr__": lambda self: "INERT"})()
"""In a view: the type's instances are plain scalars, passed through untouched."""


class Key(NamedTuple):
    """One step from a container to what it holds: shown as a user writes it, read again.

    An item (``['image']``, ``[3]``) is read back with a subscript and an attribute
    (``.boxes``) with getattr; what is only shown (a set's member, ``{0}``, or contents
    reached another way, ``.state[...]``) cannot be read back.

    >>> key = Key(ITEM, "image")
    >>> str(key), key.get({"image": 1}), Key(ATTRIBUTE, "real").get(2), key.readable
    ("['image']", 1, 2, True)
    """

    form: str  # ITEM, ATTRIBUTE or SHOWN: how the name is written
    name: Any  # the key, index or attribute name; for SHOWN, the fragment itself

    def __str__(self) -> str:
        return self.form.format(self.name)

    @property
    def readable(self) -> bool:
        """Whether :meth:`get` reads the value again."""
        return self.form in (ITEM, ATTRIBUTE)

    def get(self, container: Any) -> Any:
        """The value at this key in ``container`` now.

        Raises:
            AttributeError, LookupError, TypeError: It is gone, or cannot be read again.
        """
        if self.form == ITEM:
            return container[self.name]
        if self.form == ATTRIBUTE:
            return getattr(container, self.name)
        msg = f"{self} cannot be read again from a {type(container).__name__}."
        raise TypeError(msg)


ITEM: Final = "[{!r}]"
ATTRIBUTE: Final = ".{}"
SHOWN: Final = "{}"


class Node(NamedTuple):
    """How to take one kind of container apart, name its children, and rebuild it."""

    children: Callable[[Any], Iterable[Any]]
    rebuild: Callable[[Any, list[Any]], Any]
    keys: Callable[[Any], Iterable[Key]]  # one per child, in the same order
    mapping: bool = False  # children are a mapping's values, in mapping_items order


class Leaf(enum.Enum):
    """How a leaf moves: to_device's mover has one branch per member."""

    TENSOR = enum.auto()  # a tensor subclass, moved with Tensor.to
    PARAMETER = enum.auto()  # moved as a tensor and wrapped again, as nn.Module.to does
    MODULE = enum.auto()  # moved in place and returned, nn.Module.to semantics
    OPTIMIZER = enum.auto()  # its state follows its parameters
    CACHE = enum.auto()  # a transformers cache: in place, its layers by prefetch() and attribute
    RULE = enum.auto()  # registered with register_transfer; detail: the rule
    TO_METHOD = enum.auto()  # its own .to(), on a copy; detail: takes non_blocking
    ARRAY = enum.auto()  # a numpy array: kept, unless it holds tensors
    KEPT = enum.auto()  # a scalar's subclass, an enum member: kept, strict or not
    OTHER = enum.auto()  # anything else: kept, or refused with strict=True


# Passed through untouched unless a rule is registered for the exact type: scalars,
# and the settings a batch or a config carries.
INERT_TYPES: Final = frozenset(
    {type(None), bool, int, float, complex, str, bytes, range, slice, type(Ellipsis)}
    | {torch.dtype, torch.device, torch.layout, torch.memory_format}
)
# Kept, strict or not: subclasses of those, enum members, numbers (numpy's scalars).
_KEPT_BASES = (*INERT_TYPES, enum.Enum, numbers.Number)
# Sequences of numbers or bytes: leaves, as strings are.
_FLAT_SEQUENCES = (str, bytes, bytearray, range, memoryview, array.array)
_UNSET: Any = type("Unset", (), {"__repr__": lambda self: "<unset>"})()
"""A dataclass field never set (``field(init=False)``): it stays unset."""


def _refusal(node: Any, why: str) -> LeafError:
    name = type(node).__name__
    msg = (
        f"Cannot rebuild {{path}}: it is a {type(node).__module__}.{name}, {why}. Register "
        f"how to move it with @devicekit.register_transfer({name})."
    )
    return LeafError(msg)


# Containers. A mapping is read once per use (mapping_items), so every value keeps its
# own key, whatever a subclass does to __iter__ or keys().


def mapping_items(node: Mapping[Any, Any]) -> list[tuple[Any, Any]]:
    """A mapping's (key, value) pairs, with dict's own methods for its subclasses.

    >>> mapping_items(collections.OrderedDict(b=1, a=2))
    [('b', 1), ('a', 2)]
    """
    if isinstance(node, dict):
        return list(dict.items(node))
    return list(node.data.items() if isinstance(node, UserDict) else node.items())


def _keys_of(node: Mapping[Any, Any]) -> list[Key]:
    return [Key(ITEM, key) for key, _ in mapping_items(node)]


def _values_of(node: Mapping[Any, Any]) -> list[Any]:
    return [value for _, value in mapping_items(node)]


def _refilled(fill: Callable[[Any, Any, list[Any]], None]) -> Callable[[Any, list[Any]], Any]:
    """A rebuild that fills a shallow copy, which keeps what a subclass carries.

    A defaultdict keeps its factory and BatchEncoding its encodings, as in pin_memory.
    """

    def rebuild(node: Any, values: list[Any]) -> Any:
        try:
            clone = copy.copy(node)
        except Exception as err:  # a constructor that needs arguments copy.copy lacks
            raise _refusal(node, f"which copy.copy cannot copy ({err})") from err
        if clone is node or (isinstance(node, UserDict | UserList) and clone.data is node.data):
            raise _refusal(node, "whose copy shares its contents with the original")
        fill(clone, node, values)
        return clone

    return rebuild


def _fill_dict(clone: Any, node: Any, values: list[Any]) -> None:
    items = mapping_items(node)
    if isinstance(node, UserDict):
        clone.data = dict(zip(node.data, values, strict=True))
    else:
        for (key, _), value in zip(items, values, strict=True):
            dict.__setitem__(clone, key, value)
    # Attributes that mirror items (transformers' ModelOutput: out.logits is
    # out["logits"]) take the new values too.
    state = getattr(clone, "__dict__", None) or {}
    for (key, old), new in zip(items, values, strict=True):
        if type(key) is str and state.get(key, clone) is old:
            state[key] = new


def _fill_sequence(clone: Any, node: Any, values: list[Any]) -> None:
    if isinstance(clone, UserList):
        clone.data = values
    elif isinstance(clone, list):
        clone[:] = values
    else:  # a deque, which keeps its maxlen
        clone.clear()
        clone.extend(values)


def _rebuild_read_only_mapping(node: Mapping[Any, Any], values: list[Any]) -> Mapping[Any, Any]:
    try:
        return type(node)(dict(zip(dict(mapping_items(node)), values, strict=True)))  # type: ignore[call-arg]
    except Exception as err:
        why = f"a read-only Mapping that cannot be built from a dict ({err})"
        raise _refusal(node, why) from err


def _refuse(why: str) -> Callable[[Any, list[Any]], Any]:
    def rebuild(node: Any, values: list[Any]) -> Any:
        raise _refusal(node, why)

    return rebuild


def rebuild_namedtuple(node: tuple[Any, ...], values: list[Any]) -> tuple[Any, ...]:
    """A namedtuple built as ``_make`` builds one: its own ``__new__`` ran once already."""
    return tuple.__new__(type(node), values)


def _by_type(node: Any, values: list[Any]) -> Any:
    try:
        return type(node)(values)
    except Exception as err:  # a constructor that takes something else than the items
        raise _refusal(node, f"which cannot be built from a list of its items ({err})") from err


def _indices(node: Iterable[Any]) -> list[Key]:
    return [Key(ITEM, index) for index, _ in enumerate(node)]


# node.values(), not dict.values: torch.compile traces the one, not the other.
DICT = Node(lambda node: node.values(), lambda n, v: dict(zip(n, v, strict=True)), _keys_of, True)
LIST = Node(iter, lambda node, values: values, _indices)
TUPLE = Node(iter, lambda node, values: tuple(values), _indices)
_DICT_SUBCLASS = Node(_values_of, _refilled(_fill_dict), _keys_of, mapping=True)
_USER_DICT = Node(lambda node: node.data.values(), _refilled(_fill_dict), _keys_of, mapping=True)
_READ_ONLY_MAPPING = Node(_values_of, _rebuild_read_only_mapping, _keys_of, mapping=True)
# A mutable mapping's copy may share its storage (shelve.Shelf writes through to its
# file, ChainMap to the maps after the first): filling it could change the input.
_SHARES = "a mutable mapping whose copy could share its contents with the original"
_MUTABLE_MAPPING = Node(_values_of, _refuse(_SHARES), _keys_of, mapping=True)
_SEQUENCE_SUBCLASS = Node(list, _refilled(_fill_sequence), _indices)
_UNKNOWN = "a Sequence that devicekit cannot rebuild as the same type"
_OTHER_SEQUENCE = Node(iter, _refuse(_UNKNOWN), _indices)
_TUPLE_SUBCLASS = Node(iter, _by_type, _indices)  # torch.Size, struct sequences
_NAMEDTUPLE = Node(
    iter,
    rebuild_namedtuple,
    lambda node: [Key(ATTRIBUTE, name) for name in node._fields],
)
SET = Node(
    iter, _by_type, lambda node: [Key(SHOWN, f"{{{index}}}") for index, _ in enumerate(node)]
)


def _dataclass_node(cls: type) -> Node:
    """A dataclass's fields and later attributes, rebuilt without ``__init__``.

    ``__post_init__`` could apply a computation twice, or need an InitVar; values
    cached by ``functools.cached_property`` are left out: they describe the old fields.
    """
    fields = tuple(field.name for field in dataclasses.fields(cls))
    skipped = set(fields) | {
        name
        for klass in cls.__mro__
        for name, value in vars(klass).items()
        if isinstance(value, functools.cached_property)
    }

    def names(node: Any) -> tuple[str, ...]:
        state = getattr(node, "__dict__", None) or ()
        return fields + tuple(name for name in state if name not in skipped)

    def rebuild(node: Any, values: list[Any]) -> Any:
        clone: Any = cls.__new__(cls)  # type: ignore[call-overload] # not __init__
        for name, value in zip(names(node), values, strict=True):
            if value is not _UNSET:
                object.__setattr__(clone, name, value)
        return clone

    return Node(
        lambda node: [getattr(node, name, _UNSET) for name in names(node)],
        rebuild,
        lambda node: [Key(ATTRIBUTE, name) for name in names(node)],
    )


def container_node(cls: type) -> Node | None:
    """The container rules for a type, or None when its instances are not containers.

    >>> container_node(dict) is DICT, container_node(str)
    (True, None)
    """
    if cls is dict or cls is list or cls is tuple:
        return DICT if cls is dict else LIST if cls is list else TUPLE
    if issubclass(cls, _FLAT_SEQUENCES):
        return None
    if issubclass(cls, dict | UserDict):
        return _USER_DICT if issubclass(cls, UserDict) else _DICT_SUBCLASS
    if issubclass(cls, Mapping):
        return _MUTABLE_MAPPING if issubclass(cls, MutableMapping) else _READ_ONLY_MAPPING
    if issubclass(cls, tuple):
        return _NAMEDTUPLE if isinstance(getattr(cls, "_fields", None), tuple) else _TUPLE_SUBCLASS
    if issubclass(cls, list | collections.deque | UserList):
        return _SEQUENCE_SUBCLASS
    if issubclass(cls, Sequence):
        return _OTHER_SEQUENCE
    if issubclass(cls, set | frozenset):
        return SET
    return _dataclass_node(cls) if dataclasses.is_dataclass(cls) else None


# Contents: what a leaf holds, as entries (its key, value, holder, name). Those of
# what a .to() returned are set through the holder (it is devicekit's own copy);
# modules and optimizers are only read.

_Entry = tuple[Key, Any, Any, Any]


def _set(holder: Any, name: Any, value: Any) -> None:
    try:
        if isinstance(holder, MutableMapping):
            holder[name] = value
        else:
            setattr(holder, name, value)
    except dataclasses.FrozenInstanceError:  # set as dataclasses set frozen fields
        object.__setattr__(holder, name, value)
    except (AttributeError, TypeError) as err:
        msg = (
            f"Cannot apply the options inside {{path}}: the {type(holder).__name__} that its "
            f".to() returned refuses a new {name!r} ({err}). Register how to move it with "
            f"@devicekit.register_transfer({type(holder).__name__})."
        )
        raise LeafError(msg) from err


def _entries_node(entries: Callable[[Any], list[_Entry]], *, writes: bool = True) -> Node:
    def rebuild(obj: Any, values: list[Any]) -> Any:
        if not writes:
            msg = "Cannot rebuild {path}: the checks read it, nothing rebuilds it."
            raise LeafError(msg)
        for (_, old, holder, name), new in zip(entries(obj), values, strict=True):
            if new is not old and new is not _UNSET:
                _set(holder, name, new)
        return obj

    return Node(
        lambda obj: [entry[1] for entry in entries(obj)],
        rebuild,
        lambda obj: [entry[0] for entry in entries(obj)],
    )


def _graph_entries(graph: Any) -> list[_Entry]:
    # torch_geometric's Data, Batch and HeteroData keep their attributes in stores:
    # data.x, data['paper'].x, data['paper', 'cites', 'paper'].edge_index.
    found = []
    for store in graph.stores:
        key = getattr(store, "_key", None) or ()
        where = f"[{', '.join(map(repr, key if isinstance(key, tuple) else [key]))}]" if key else ""
        found += [
            (Key(SHOWN, f"{where}.{name}"), value, store, name) for name, value in store.items()
        ]
    return found


def state_on_host(group: Mapping[str, Any], key: object) -> bool:
    """Whether an optimizer keeps this state on the host on purpose: the one rule.

    The ``step`` of an optimizer neither capturable nor fused: Optimizer.load_state_dict
    puts it there, to_device leaves it there, and the checks do not count it.
    """
    return key == "step" and not (group.get("capturable") or group.get("fused"))


def _optimizer_entries(optimizer: torch.optim.Optimizer) -> list[_Entry]:
    found: list[_Entry] = []
    for group_index, group in enumerate(optimizer.param_groups):
        for param_index, param in enumerate(group["params"]):
            where = f"param_groups[{group_index}]['params'][{param_index}]"
            found.append((Key(SHOWN, f".{where}"), param, None, None))
            found += [
                (Key(SHOWN, f".state[{where}][{key!r}]"), value, None, None)
                for key, value in optimizer.state.get(param, {}).items()
                if not state_on_host(group, key)
            ]
    return found


_GRAPH = _entries_node(_graph_entries)
_MAPPING_CONTENTS = _entries_node(
    lambda obj: [(Key(ITEM, key), value, obj, key) for key, value in mapping_items(obj)]
)
_ATTRIBUTES = _entries_node(
    lambda obj: [(Key(ATTRIBUTE, name), value, obj, name) for name, value in vars(obj).items()]
)
_FIELDS = _entries_node(
    lambda obj: [
        (Key(ATTRIBUTE, field.name), getattr(obj, field.name, _UNSET), obj, field.name)
        for field in dataclasses.fields(obj)
    ]
)
_MODULE = _entries_node(
    lambda module: [
        (Key(ATTRIBUTE, name), tensor, None, None)
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]
    ],
    writes=False,
)
_OPTIMIZER = _entries_node(_optimizer_entries, writes=False)
# A PackedSequence's batch_sizes stays on the host by PyTorch's design (its .to() leaves
# it there, and the RNNs read it there): what the checks see leaves it out.
_PACKED_SEQUENCE = _entries_node(
    lambda packed: [
        (Key(ATTRIBUTE, name), getattr(packed, name), None, None)
        for name in ("data", "sorted_indices", "unsorted_indices")
    ],
    writes=False,
)


def _lineage(cls: type) -> set[str]:
    """The qualified names of a class and its bases.

    A library's types are known by name, so that the library is never imported to ask.
    """
    return {f"{k.__module__}.{k.__name__}" for k in cls.__mro__}


_CACHE = "transformers.cache_utils.Cache"
_CACHE_LAYER = "transformers.cache_utils.CacheLayerMixin"


def is_cache_layer(value: object) -> bool:
    """Whether ``value``, found in a list a transformers cache holds, is one of its layers.

    Known by the offloading API every layer has (``prefetch()``), not by a class: the
    linear-attention layers (mamba-style) derive from no attention layer's class.
    """
    return callable(getattr(value, "prefetch", None))


def _cache_entries(cache: Any) -> list[_Entry]:
    """What a transformers cache holds: every attribute of every layer, and its own.

    A layer's attributes are read whole, whatever they are named (keys and values, a
    sliding window's or a static layer's tensors, linear-attention states in dicts,
    quantized pairs), so the checks see every tensor :func:`~devicekit.to_device` moves.
    """
    found: list[_Entry] = []
    for name, value in vars(cache).items():
        if isinstance(value, list) and any(map(is_cache_layer, value)):
            for index, item in enumerate(value):
                where = f".{name}[{index}]"
                if is_cache_layer(item):
                    state = getattr(item, "__dict__", {})
                    found += [
                        (Key(SHOWN, f"{where}.{key}"), part, None, None)
                        for key, part in state.items()
                    ]
                else:
                    found.append((Key(SHOWN, where), item, None, None))
        else:
            found.append((Key(ATTRIBUTE, name), value, None, None))
    return found


_CACHE_CONTENTS = _entries_node(_cache_entries, writes=False)


def _contents(cls: type) -> Node | None:
    """How to see and set what an object that moves itself holds."""
    if "torch_geometric.data.data.BaseData" in _lineage(cls):
        return _GRAPH
    if issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple):
        return _NAMEDTUPLE  # PackedSequence
    if dataclasses.is_dataclass(cls):
        return _FIELDS  # tensordict's tensorclasses
    if issubclass(cls, Mapping):
        return _MAPPING_CONTENTS  # TensorDict
    # Attributes where instances have a __dict__ (a list's or a __slots__ class's have none).
    return _ATTRIBUTES if cls.__dictoffset__ and not issubclass(cls, type) else None


# The registry, and the decisions made from it.

_rules: dict[type, Callable[..., Any]] = {}  # rule(obj, device, **options) -> moved
_lock = threading.Lock()  # the registry and the decisions change together under it


def _rule_for(cls: type) -> tuple[type, Callable[..., Any]] | None:
    """The class registered and its rule: the nearest in the MRO, then ABCs in order."""
    if not _rules:
        return None
    for klass in cls.__mro__:
        if klass in _rules:
            return klass, _rules[klass]
    for base, rule in _rules.items():
        metaclass: type = type(base)
        if issubclass(metaclass, abc.ABCMeta) and issubclass(cls, base):
            return base, rule
    return None


def _takes_non_blocking(cls: type) -> bool:
    try:
        parameters = inspect.signature(cls.to).parameters.values()  # type: ignore[attr-defined]
    except (TypeError, ValueError):  # no signature to read: hand it the device only
        return False
    return any(p.name == "non_blocking" or p.kind is p.VAR_KEYWORD for p in parameters)


class Decision(NamedTuple):
    """A type in the MOVE, CAST and READ views (a Node, LEAF or INERT), and as a leaf."""

    move: Any
    cast: Any
    read: Any
    leaf: Leaf | None  # None for containers and inert types
    detail: Any = None  # (class registered, its rule), or whether a .to() takes non_blocking


def _decide(cls: type) -> Decision:
    rule = _rule_for(cls)
    if rule is not None:
        return Decision(LEAF, LEAF, _contents(cls), Leaf.RULE, rule)
    if issubclass(cls, torch.Tensor):
        parameter = issubclass(cls, torch.nn.Parameter)
        return Decision(LEAF, LEAF, LEAF, Leaf.PARAMETER if parameter else Leaf.TENSOR)
    if issubclass(cls, torch.nn.Module):
        return Decision(LEAF, LEAF, _MODULE, Leaf.MODULE)
    if issubclass(cls, torch.optim.Optimizer):
        return Decision(LEAF, LEAF, _OPTIMIZER, Leaf.OPTIMIZER)
    if cls in INERT_TYPES or cls is type(_UNSET):
        return Decision(INERT, INERT, INERT, None)
    # transformers' caches (past_key_values) hold their tensors in layer objects' attributes.
    if _CACHE in (lineage := _lineage(cls)):
        return Decision(LEAF, LEAF, _CACHE_CONTENTS, Leaf.CACHE)
    if _CACHE_LAYER in lineage:
        return Decision(LEAF, LEAF, _ATTRIBUTES, Leaf.OTHER)
    # numpy's scalars (np.bool_ is no numbers.Number), known by name: numpy is not imported.
    if issubclass(cls, _KEPT_BASES) or any(
        k.__module__ == "numpy" and k.__name__ == "generic" for k in cls.__mro__
    ):
        return Decision(LEAF, LEAF, LEAF, Leaf.KEPT)
    node = container_node(cls)
    moves_itself = callable(getattr(cls, "to", None))
    if node is not None and (not moves_itself or issubclass(cls, dict | UserDict)):
        return Decision(node, node, node, None)
    if moves_itself:
        contents = _contents(cls)
        read = _PACKED_SEQUENCE if issubclass(cls, torch.nn.utils.rnn.PackedSequence) else contents
        return Decision(LEAF, contents, read, Leaf.TO_METHOD, _takes_non_blocking(cls))
    array = cls.__module__ == "numpy" and cls.__name__ == "ndarray"  # numpy is not imported
    return Decision(LEAF, LEAF, LEAF, Leaf.ARRAY if array else Leaf.OTHER)


# The views, rebound (never cleared in place) when the registry changes: a walk that
# began before the change reads one consistent set of decisions to its end. The
# decisions themselves, and the views with keys skipped (skip_keys), go with them.
_views: tuple[dict[type, Any], dict[type, Any], dict[type, Any]] = ({}, {}, {})
_leaves: dict[type, tuple[Leaf | None, Any]] = {}
_decisions: dict[type, Decision] = {}
_skipping: dict[tuple[int, frozenset[Any]], tuple[dict[type, Any], Callable[[type], Any]]] = {}
_is_compiling = torch.compiler.is_compiling  # one global lookup per skip_keys walk
SKIP_SETS_KEPT: Final = 64
"""Distinct skip_keys sets whose views the table keeps before it starts over."""


def _start_over() -> None:
    """Forget every decision (under the lock): the registry changed, or too many types."""
    global _views, _leaves, _decisions, _skipping  # rebound, never cleared in place
    _views, _leaves, _decisions, _skipping = ({}, {}, {}), {}, {}, {}


def view(number: int) -> dict[type, Any]:
    """The current MOVE, CAST or READ view: type -> Node, LEAF or INERT."""
    return _views[number]


def decide(cls: type) -> Decision:
    """The decision for ``cls``: looked up, or made once from the registry under its lock."""
    if torch.compiler.is_compiling():
        return _traced_decision(cls)
    try:
        return _decisions[cls]
    except KeyError:
        return _decided(cls)


def _decided(cls: type) -> Decision:
    with _lock:
        decision = _decisions.get(cls)
        if decision is not None:  # decided by another thread while this one waited
            return decision
        decision = _decide(cls)
        if len(_leaves) >= TYPES_KEPT:
            _start_over()
        _views[MOVE][cls], _views[CAST][cls], _views[READ][cls] = decision[:3]
        _leaves[cls] = decision.leaf, decision.detail
        _decisions[cls] = decision
    return decision


class Kept:
    """A value under a skipped key, carried through a walk as an inert leaf."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def skipping_view(
    number: int, skip: frozenset[Any]
) -> tuple[dict[type, Any], Callable[[type], Any]]:
    """A view whose mappings hand the values under ``skip`` over as :class:`Kept` leaves.

    ``skip_keys`` is an override of the table, applied where a type is looked up: the
    view and how it learns a type are made once per skip set, and kept with the
    decisions they come from (a registry change starts them over too).
    """
    if _is_compiling():
        # A trace makes a view of its own: the compiler traces no lock ("Unsupported
        # context manager"), and a stored view, which eager calls fill as they learn
        # types, would make it guard on the view's size and compile again.
        return _new_view(number, skip)
    found = _skipping.get((number, skip))
    if found is not None:
        return found
    with _lock:
        if len(_skipping) >= SKIP_SETS_KEPT:
            _skipping.clear()  # skip sets made at run time must not pile up
        # The stored view is the one handed out, even when a thread beside us stored first.
        return _skipping.setdefault((number, skip), _new_view(number, skip))


def _new_view(number: int, skip: frozenset[Any]) -> tuple[dict[type, Any], Any]:
    nodes: dict[type, Any] = {Kept: INERT}

    def learn(cls: type) -> Any:
        node = nodes[cls] = decide(cls)[number]
        if isinstance(node, Node) and node.mapping:
            rebuild = node.rebuild
            node = nodes[cls] = node._replace(
                children=lambda c: [Kept(v) if k in skip else v for k, v in mapping_items(c)],
                rebuild=lambda c, v: rebuild(c, [x.value if type(x) is Kept else x for x in v]),
            )
        return node

    return nodes, learn


def leaf_how(cls: type) -> tuple[Leaf | None, Any]:
    """How a leaf of type ``cls`` moves: its :class:`Leaf`, and its detail."""
    try:
        return _leaves[cls]
    except KeyError:
        decision = decide(cls)
        return decision.leaf, decision.detail


# Under torch.compile a decision is made in Python while the compiler traces (a lock
# and the registry are no graph's business) and handed over as constants: the names of
# module-level nodes, which the compiler can follow, and the Leaf. A node made per class
# (a dataclass's) has no name: that type is refused where a compiled region meets it first.
_NAMED: Final = {
    k: v for k, v in globals().items() if isinstance(v, Node) or k in ("LEAF", "INERT")
}
_NAMES: Final = {id(entry): name for name, entry in _NAMED.items()}


def _names_of(cls: type) -> tuple[str, str, str, Leaf | None]:
    decision = _decided(cls)
    move, cast, read = (_NAMES.get(id(entry), "") for entry in decision[:3])
    return move, cast, read, decision.leaf


# Run in Python while the compiler traces; marked without importing dynamo (see _compat).
_decision_names: Callable[[type], tuple[str, str, str, Leaf | None]] = _compat.run_while_tracing(
    _names_of
)


def _traced_decision(cls: type) -> Decision:
    if issubclass(cls, collections.deque):
        msg = (
            "Cannot move {path} inside torch.compile: it is a deque, and the compiler reads "
            "a deque's maxlen as None, so its copy would not be the same deque. Make it a "
            "list, or move it before the compiled region."
        )
        raise LeafError(msg)
    move, cast, read, leaf = _decision_names(cls)
    if move and cast and read:
        return Decision(_NAMED[move], _NAMED[cast], _NAMED[read], leaf)
    msg = (
        f"Cannot move {{path}} inside torch.compile: devicekit meets the type "
        f"{cls.__module__}.{cls.__qualname__} there for the first time, and how it learns a "
        "new dataclass or a new object that moves itself cannot be traced. Move the data "
        "before the compiled region, or one such object with devicekit.to_device before."
    )
    raise LeafError(msg)


F = TypeVar("F", bound=Callable[..., Any])


def register_transfer(cls: type) -> Callable[[F], F]:
    """Register how :func:`~devicekit.to_device` moves instances of ``cls``.

    The rule wins over a ``.to()`` method and the container rules, for ``cls`` and its
    subclasses (the nearest in the MRO wins), and for what an abstract base class
    recognises (``collections.abc.Sequence``: lists too), in every call that starts
    after this returns, in every thread. The checks look inside such objects.

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
        ``moved`` takes the object's place, so it must be an instance of ``cls``: a rule
        returning anything else (None, a number) is a TransferError naming the object.

    Raises:
        TypeError: ``cls`` is not a class, is :class:`torch.Tensor` (moved by to_device
            itself) or ``object`` (whose rule would take every leaf); or what is
            decorated is not callable.
        ValueError: ``cls`` has a rule already; :func:`unregister_transfer` removes it.
    """
    if not isinstance(cls, type):  # for callers without a type checker
        msg = f"Expected a class to register a transfer rule for, got {type(cls).__name__} {cls!r}."  # type: ignore[unreachable]
        raise TypeError(msg)
    if cls is typing.Any:
        msg = (
            "Expected a class to register a transfer rule for, got typing.Any, which no "
            "object is an instance of. Register the types you mean."
        )
        raise TypeError(msg)
    if cls is torch.Tensor or cls is object:
        msg = (
            "Expected a user type, got torch.Tensor: tensors are moved by to_device itself. "
            "Register a tensor subclass instead."
            if cls is torch.Tensor
            else "Expected a type narrower than object: a rule for object would take every "
            "leaf and every container of every batch. Register the types you mean."
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
            _start_over()
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
        _start_over()
