"""The one table of per-type decisions: what each type is, and how it moves.

Every walk reads it and keeps no cache of its own: to_device (host, accelerator,
``skip_keys``, compiled), the checks, pinning, devicekit.testing. A type is decided once
(again after any ABC's ``register()``), under the registry's lock: a container (its node,
:mod:`devicekit._core._nodes`), inert (a plain scalar, passed through untouched), or a leaf
whose :class:`Leaf` says how it moves; leaves that hold tensors have *contents*, named
as users write them (``data.x``). Walks read one view: MOVE (containers), CAST (also
what a ``.to()`` returned, where ``dtype``, ``memory_format`` and ``copy`` are applied
after it), READ (also modules, optimizers and registered types: the checks).

Dicts and UserDicts are containers even with a ``.to()`` (transformers'
``BatchEncoding.to`` moves in place and skips nested values); any other type with one
moves with it (TensorDict, PackedSequence), on a shallow copy, so that an in-place
``.to()`` (torch_geometric's ``Data``) never changes the input, and without ``dtype``,
which it would apply to every tensor it holds (token ids cast to float16).
"""

from __future__ import annotations

import abc
import collections
import enum
import inspect
import numbers
import threading
import typing
from collections import UserDict
from collections.abc import Callable
from typing import Any, Final, NamedTuple, NoReturn, TypeAlias, TypeVar

import torch

from devicekit._base import LeafError, run_while_tracing
from devicekit._core import _nodes
from devicekit._core._nodes import (
    ATTRIBUTES,
    CACHE,
    CACHE_CONTENTS,
    CACHE_LAYER,
    MODULE_CONTENTS,
    OPTIMIZER_CONTENTS,
    PACKED_SEQUENCE,
    UNSET,
    Node,
    container_node,
    contents_node,
    lineage,
    mapping_items,
)

TYPES_KEPT: Final = 1024
"""Types the table holds before it starts over: types made at run time must not pile up."""
MOVE: Final = 0
CAST: Final = 1
READ: Final = 2
LEAF: Any = None
"""In a view: the type's instances are leaves."""
INERT: Any = type("Inert", (), {"__repr__": lambda self: "INERT"})()
"""In a view: the type's instances are plain scalars, passed through untouched."""


class Leaf(enum.Enum):
    """How a leaf moves: to_device's mover has one branch per member."""

    TENSOR = enum.auto()  # a tensor subclass, moved with Tensor.to
    PARAMETER = enum.auto()  # moved as a tensor and wrapped again, as nn.Module.to does
    MODULE = enum.auto()  # moved in place and returned, nn.Module.to semantics
    OPTIMIZER = enum.auto()  # its state follows its parameters
    CACHE = enum.auto()  # a transformers cache: in place, its layers by prefetch() and attribute
    RULE = enum.auto()  # registered with register_transfer (Decision.rule)
    TO_METHOD = enum.auto()  # its own .to(), on a copy (Decision.takes_non_blocking)
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
# What devicekit moves by itself, besides tensors, modules and optimizers: no ABC's
# failing check stops these.
_OWN_TYPES: Final = INERT_TYPES | {dict, list, tuple, type(UNSET)}
_OWN_BASES: Final = (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)


# The registry, and the decisions made from it.

_rules: dict[type, Callable[..., Any]] = {}  # rule(obj, device, **options) -> moved
_lock = threading.Lock()  # the registry and the decisions change together under it


def _rule_for(cls: type) -> tuple[type, Callable[..., Any]] | None:
    """The class registered and its rule: the nearest in the MRO, then ABCs in order.

    An ABC whose check raises for ``cls`` (a ``__subclasshook__`` of the user's) cannot
    say whether its rule takes it: the type is then refused where it is moved, naming
    both, unless it is one devicekit moves by itself (tensors, modules, optimizers,
    plain scalars, dicts, lists and tuples), which such a check is not let stop.
    """
    if not _rules:
        return None
    for klass in cls.__mro__:
        if klass in _rules:
            return klass, _rules[klass]
    for base, rule in _rules.items():
        metaclass: type = type(base)
        if not issubclass(metaclass, abc.ABCMeta):
            continue
        try:
            if issubclass(cls, base):
                return base, rule
        except Exception as err:  # the user's hook: asked once per type
            if cls in _OWN_TYPES or issubclass(cls, _OWN_BASES):
                continue
            msg = (
                f"Cannot move {{path}}, a {_named(cls)}: devicekit asks whether it is a "
                f"{_named(base)}, which has a transfer rule, and issubclass({cls.__name__}, "
                f"{base.__name__}) raised {type(err).__name__} (the cause below). Make "
                f"{base.__name__}.__subclasshook__ answer for {cls.__name__}, or call "
                f"devicekit.unregister_transfer({base.__name__})."
            )
            return base, Unanswered(msg, err)
    return None


def _named(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class Unanswered:
    """The rule of a type whose decision raised: moving it raises why, with that cause.

    Its row is not kept: the next call asks again, as Python's ABCs keep no error.
    """

    __slots__ = ("cause", "message")

    def __init__(self, message: str, cause: Exception) -> None:
        self.message = message  # a template: {path} is filled by the walk
        self.cause = cause

    def __call__(self, obj: Any, device: Any, **options: Any) -> NoReturn:
        raise LeafError(self.message) from self.cause


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
    rule: tuple[type, Any] | None = None  # RULE: the class registered, and its rule
    meshed: bool = False  # TENSOR: on a device mesh (a DTensor), whose device type it keeps
    takes_non_blocking: bool = False  # TO_METHOD: whether its .to() takes non_blocking


def _decide(cls: type) -> Decision:
    """The decision for ``cls``; one whose checks raised refuses its instances, naming why."""
    try:
        return _decide_checked(cls)
    except Exception as err:
        # An ABC's check that raises (a Mapping subclass's broken __subclasshook__ breaks
        # every issubclass(..., Mapping)) must not escape raw from whatever meets the type.
        msg = (
            f"Cannot move {{path}}, a {_named(cls)}: telling what kind of object it is raised "
            f"{type(err).__name__} (the cause below), as a failing __subclasshook__ of an "
            "abstract base class does. Fix that check, or register how to move it with "
            f"@devicekit.register_transfer({cls.__name__})."
        )
        return Decision(LEAF, LEAF, LEAF, Leaf.RULE, rule=(cls, Unanswered(msg, err)))


def _decide_checked(cls: type) -> Decision:
    rule = _rule_for(cls)
    if rule is not None:
        return Decision(LEAF, LEAF, contents_node(cls), Leaf.RULE, rule=rule)
    if issubclass(cls, torch.Tensor):
        how = Leaf.PARAMETER if issubclass(cls, torch.nn.Parameter) else Leaf.TENSOR
        return Decision(LEAF, LEAF, LEAF, how, meshed=hasattr(cls, "device_mesh"))
    if issubclass(cls, torch.nn.Module):
        return Decision(LEAF, LEAF, MODULE_CONTENTS, Leaf.MODULE)
    if issubclass(cls, torch.optim.Optimizer):
        return Decision(LEAF, LEAF, OPTIMIZER_CONTENTS, Leaf.OPTIMIZER)
    if cls in INERT_TYPES or cls is type(UNSET):
        return Decision(INERT, INERT, INERT, None)
    # transformers' caches (past_key_values) hold their tensors in layer objects' attributes.
    if CACHE in (bases := lineage(cls)):
        return Decision(LEAF, LEAF, CACHE_CONTENTS, Leaf.CACHE)
    if CACHE_LAYER in bases:
        return Decision(LEAF, LEAF, ATTRIBUTES, Leaf.OTHER)
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
        contents = contents_node(cls)
        read = PACKED_SEQUENCE if issubclass(cls, torch.nn.utils.rnn.PackedSequence) else contents
        return Decision(
            LEAF, contents, read, Leaf.TO_METHOD, takes_non_blocking=_takes_non_blocking(cls)
        )
    array = cls.__module__ == "numpy" and cls.__name__ == "ndarray"  # numpy is not imported
    return Decision(LEAF, LEAF, LEAF, Leaf.ARRAY if array else Leaf.OTHER)


# The one cache: a row per type, (move, cast, read, decision), its three views first as
# an exact tuple, which the engine indexes by view number: indexing the Decision itself,
# a NamedTuple, cost 4-7% of 64 per-image dicts and a mixed batch moved cpu -> cpu. Rebound
# (never cleared in place) when the registry changes, or an ABC's registrations (what
# isinstance answers for Mapping, Sequence or a registered ABC): a walk that began before
# the change reads one consistent set of decisions to its end. The skip sets' tables go
# with it.
Row: TypeAlias = tuple[Any, Any, Any, Decision]
_decisions: dict[type, Row] = {}
_skipping: dict[frozenset[Any], tuple[dict[type, Row], Callable[[type], Row]]] = {}
SKIP_SETS_KEPT: Final = 64
"""Distinct skip_keys sets whose tables the cache keeps before it starts over."""
_abc_token: Final = abc.get_cache_token  # moves on with every ABC's register(), anywhere
_token = _abc_token()  # where it stood when the rows were started


def _start_over() -> None:
    """Forget every decision (under the lock): a registry changed, or too many types."""
    global _decisions, _skipping, _token  # noqa: PLW0603 - rebound, never cleared in place
    token = _abc_token()  # read first: a registration after it starts the rows over again
    _decisions, _skipping = {}, {}
    _token = token  # last: a walk that sees it sees the new rows


@run_while_tracing
def follow_abcs() -> None:
    """Start the rows over where an ABC has registered a class since they were started.

    Every walk calls it first: ``MyABC.register(C)`` after C was decided must reach C's
    row. One C call and a comparison; run in Python while the compiler traces, which
    cannot follow the C call.
    """
    if _abc_token() != _token:
        with _lock:
            if _abc_token() != _token:
                _start_over()


def decide(cls: type) -> Decision:
    """The decision for ``cls``: looked up, or made once from the registry under its lock."""
    return row(cls)[3]


def row(cls: type) -> Row:
    """The row of ``cls``: its MOVE, CAST and READ views, then its decision."""
    if torch.compiler.is_compiling():
        decision = _traced_decision(cls)
        return decision.move, decision.cast, decision.read, decision
    follow_abcs()
    try:
        return _decisions[cls]
    except KeyError:
        return _decided(cls)


def _decided(cls: type) -> Row:
    with _lock:
        found = _decisions.get(cls)
        if found is None:  # else decided by another thread while this one waited
            decision = _decide(cls)
            found = decision.move, decision.cast, decision.read, decision
            if decision.rule is not None and type(decision.rule[1]) is Unanswered:
                return found  # not kept: asked again next time
            if len(_decisions) >= TYPES_KEPT:
                _start_over()
            _decisions[cls] = found
    return found


def leaf_how(cls: type) -> Decision:
    """How a leaf of type ``cls`` moves: its decision, read where it is found first."""
    return (_decisions.get(cls) or row(cls))[3]


class Kept:
    """A value under a skipped key, carried through a walk as an inert leaf."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def skipping(skip: frozenset[Any]) -> tuple[dict[type, Row], Callable[[type], Row]]:
    """Decisions whose mappings hand the values under ``skip`` over as :class:`Kept` leaves.

    ``skip_keys`` is an override of the table, applied where a type is looked up: the
    table and how it learns a type are made once per skip set, and kept with the
    decisions they come from (a registry change starts them over too).
    """
    if torch.compiler.is_compiling():
        # A trace makes a table of its own: the compiler traces no lock ("Unsupported
        # context manager"), and a stored table, which eager calls fill as they learn
        # types, would make it guard on the table's size and compile again.
        return _new_table(skip)
    found = _skipping.get(skip)
    if found is not None:
        return found
    with _lock:
        if len(_skipping) >= SKIP_SETS_KEPT:
            _skipping.clear()  # skip sets made at run time must not pile up
        # The stored table is the one handed out, even when a thread beside us stored first.
        return _skipping.setdefault(skip, _new_table(skip))


def _new_table(skip: frozenset[Any]) -> tuple[dict[type, Row], Callable[[type], Row]]:
    kept = Decision(INERT, INERT, INERT, None)
    table: dict[type, Row] = {Kept: (INERT, INERT, INERT, kept)}

    def overridden(node: Any) -> Any:
        if not (isinstance(node, Node) and node.mapping):
            return node
        rebuild = node.rebuild
        return node._replace(
            children=lambda c: [Kept(v) if k in skip else v for k, v in mapping_items(c)],
            rebuild=lambda c, v: rebuild(c, [x.value if type(x) is Kept else x for x in v]),
        )

    def learn(cls: type) -> Row:
        move, cast, read, decision = row(cls)
        found = table[cls] = overridden(move), overridden(cast), overridden(read), decision
        return found

    return table, learn


# Under torch.compile a decision is made in Python while the compiler traces (a lock
# and the registry are no graph's business) and handed over as constants: the names of
# module-level nodes, which the compiler can follow, and the Leaf. A node made per class
# (a dataclass's) has no name: that type is refused where a compiled region meets it first.
_NAMED: Final = {
    name: entry
    for name, entry in {**vars(_nodes), **globals()}.items()
    if isinstance(entry, Node) or name in ("LEAF", "INERT")
}
_NAMES: Final = {id(entry): name for name, entry in _NAMED.items()}


def _names_of(cls: type) -> tuple[str, str, str, Leaf | None]:
    *views, decision = _decided(cls)
    move, cast, read = (_NAMES.get(id(entry), "") for entry in views)
    return move, cast, read, decision.leaf


# Run in Python while the compiler traces; marked without importing dynamo (see _compat).
_decision_names: Callable[[type], tuple[str, str, str, Leaf | None]] = run_while_tracing(_names_of)


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
    after this returns, in every thread. The checks look inside such objects. A class
    registered with the ABC later (``MyABC.register(C)``) takes the rule from the next
    call on. Where the ABC's check raises for a type, instances of that type are refused
    with a TransferError naming both, that error as its cause; tensors, modules,
    optimizers, plain scalars, dicts, lists and tuples move as if the ABC had said no.

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

    Args:
        cls: The class whose rule to remove, as given to :func:`register_transfer`.

    Raises:
        KeyError: ``cls`` has no rule registered.
    """
    with _lock:
        if cls not in _rules:
            msg = f"{getattr(cls, '__name__', cls)} has no transfer rule to unregister."
            raise KeyError(msg)
        del _rules[cls]
        _start_over()
