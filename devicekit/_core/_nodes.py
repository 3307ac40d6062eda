"""How each kind of container is taken apart, named and rebuilt, and what leaves hold.

A container's :class:`Node` gives its children, a :class:`Key` for each (printed as a
user writes the path, ``['image']``, ``[3]``, ``.boxes``, and read again from the
container), and how to rebuild it around new children, keeping its type (a subclass
keeps what it carries; what cannot be rebuilt as the same type is refused with its
path). The *contents* of leaves that hold tensors (a graph's stores, a TensorDict's
items, an optimizer's state, a transformers cache's layers) are nodes too, for the
walks that look inside them. Which type gets which node is the table's decision
(:mod:`devicekit._core._kinds`); nothing here is cached.
"""

from __future__ import annotations

import array
import collections
import copy
import dataclasses
import functools
from collections import UserDict, UserList
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from typing import Any, Final, NamedTuple

import torch

from devicekit._base import LeafError, shown


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
        if self.form == ITEM:  # a key of the user's, whose __repr__ may raise
            return f"[{shown(self.name, limit=None)}]"
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


# Sequences of numbers or bytes: leaves, as strings are.
_FLAT_SEQUENCES = (str, bytes, bytearray, range, memoryview, array.array)
UNSET: Any = type("Unset", (), {"__repr__": lambda self: "<unset>"})()
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
            if value is not UNSET:
                object.__setattr__(clone, name, value)
        return clone

    return Node(
        lambda node: [getattr(node, name, UNSET) for name in names(node)],
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
            f".to() returned refuses a new {shown(name)} ({err}). Register how to move it with "
            f"@devicekit.register_transfer({type(holder).__name__})."
        )
        raise LeafError(msg) from err


def _entries_node(entries: Callable[[Any], list[_Entry]], *, writes: bool = True) -> Node:
    def rebuild(obj: Any, values: list[Any]) -> Any:
        if not writes:
            msg = "Cannot rebuild {path}: the checks read it, nothing rebuilds it."
            raise LeafError(msg)
        for (_, old, holder, name), new in zip(entries(obj), values, strict=True):
            if new is not old and new is not UNSET:
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
                (Key(SHOWN, f".state[{where}][{shown(key, limit=None)}]"), value, None, None)
                for key, value in optimizer.state.get(param, {}).items()
                if not state_on_host(group, key)
            ]
    return found


_GRAPH = _entries_node(_graph_entries)
_MAPPING_CONTENTS = _entries_node(
    lambda obj: [(Key(ITEM, key), value, obj, key) for key, value in mapping_items(obj)]
)
ATTRIBUTES = _entries_node(
    lambda obj: [(Key(ATTRIBUTE, name), value, obj, name) for name, value in vars(obj).items()]
)
_FIELDS = _entries_node(
    lambda obj: [
        (Key(ATTRIBUTE, field.name), getattr(obj, field.name, UNSET), obj, field.name)
        for field in dataclasses.fields(obj)
    ]
)
MODULE_CONTENTS = _entries_node(
    lambda module: [
        (Key(ATTRIBUTE, name), tensor, None, None)
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]
    ],
    writes=False,
)
OPTIMIZER_CONTENTS = _entries_node(_optimizer_entries, writes=False)
# A PackedSequence's batch_sizes stays on the host by PyTorch's design (its .to() leaves
# it there, and the RNNs read it there): what the checks see leaves it out.
PACKED_SEQUENCE = _entries_node(
    lambda packed: [
        (Key(ATTRIBUTE, name), getattr(packed, name), None, None)
        for name in ("data", "sorted_indices", "unsorted_indices")
    ],
    writes=False,
)


def lineage(cls: type) -> set[str]:
    """The qualified names of a class and its bases.

    A library's types are known by name, so that the library is never imported to ask.
    """
    return {f"{k.__module__}.{k.__name__}" for k in cls.__mro__}


CACHE = "transformers.cache_utils.Cache"
CACHE_LAYER = "transformers.cache_utils.CacheLayerMixin"


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


CACHE_CONTENTS = _entries_node(_cache_entries, writes=False)


def contents_node(cls: type) -> Node | None:
    """How to see and set what an object that moves itself holds."""
    if "torch_geometric.data.data.BaseData" in lineage(cls):
        return _GRAPH
    if issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple):
        return _NAMEDTUPLE  # PackedSequence
    if dataclasses.is_dataclass(cls):
        return _FIELDS  # tensordict's tensorclasses
    if issubclass(cls, Mapping):
        return _MAPPING_CONTENTS  # TensorDict
    # Attributes where instances have a __dict__ (a list's or a __slots__ class's have none).
    return ATTRIBUTES if cls.__dictoffset__ and not issubclass(cls, type) else None
