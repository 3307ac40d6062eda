"""to_device: move tensors, modules, optimizers and nested batches to a device.

The walk itself is :mod:`devicekit._tree`'s; this module decides what happens to
each leaf. Per-type decisions (is this registered? does its ``.to()`` take
``dtype=``?) are made once per type and cached, so the hot path is a dict lookup.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import inspect
import threading
from collections.abc import Callable, Collection, Hashable, Iterator, Mapping
from typing import Any, Literal, Protocol, TypeAlias, TypeVar

import torch

from devicekit import _packing
from devicekit._devices import DeviceLike, resolve_device
from devicekit._manager import current_device
from devicekit._tree import TYPES_KEPT, LeafError, Node, Walker, container_node, mapping_items

__all__ = [
    "NonBlocking",
    "TransferRule",
    "register_transfer",
    "to_device",
    "unregister_transfer",
]

T = TypeVar("T")
C = TypeVar("C", bound=Callable[..., Any])

NonBlocking: TypeAlias = bool | Literal["auto"]
"""``"auto"``, True or False; see :func:`to_device`."""

# Devices whose copies are no-ops or synchronous by nature: no stream to wait on.
_HOST_DEVICE_TYPES = frozenset({"cpu", "meta"})
# Leaves that hold no data to move; strict=True accepts them.
# Plain values, left as they are, strict or not: scalars, and the settings a batch or a
# config carries beside its tensors.
_SCALAR_TYPES = (
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
)
_SCALAR_TYPE_SET = frozenset(_SCALAR_TYPES)
_FLAT_TYPES = frozenset({dict, list, tuple})
# The options a registered rule or a .to() method may be handed, in to_device's order.
_OPTION_NAMES = ("non_blocking", "dtype", "copy", "memory_format")


class TransferRule(Protocol):
    """How to move one user type: ``rule(obj, device, **options)`` returns the moved object.

    ``options`` are ``non_blocking`` (a bool), ``dtype``, ``copy`` and
    ``memory_format``, exactly as :func:`to_device` received them (``non_blocking``
    resolved from ``"auto"``).
    """

    def __call__(self, obj: Any, device: torch.device, /, **options: Any) -> Any: ...


_rules: dict[type, TransferRule] = {}
_rules_lock = threading.Lock()  # registering while other threads move data
_Tensor = torch.Tensor  # one global lookup on the hot path instead of two
_is_compiling = torch.compiler.is_compiling  # likewise; torch.compile knows the function


def _rule_for(cls: type) -> TransferRule | None:
    """The registered rule that applies to ``cls``, if any.

    The nearest class in its MRO that has a rule wins; then abstract base classes with
    rules, in the order registered, for the classes they recognise without inheritance
    (``collections.abc.Sequence`` covers ``list``).
    """
    for klass in cls.__mro__:
        rule = _rules.get(klass)
        if rule is not None:
            return rule
    for base, rule in list(_rules.items()):
        metaclass: type = type(base)
        if issubclass(metaclass, abc.ABCMeta) and issubclass(cls, base):
            return rule
    return None


def _has_own_rule(cls: type) -> bool:
    # Mappings are rebuilt item by item even when they have .to(): BatchEncoding.to,
    # for one, moves its input in place instead of returning a moved copy.
    registered = _rule_for(cls) is not None
    to_method = not issubclass(cls, Mapping) and callable(getattr(cls, "to", None))
    return registered or to_method


# Plain scalars are left as they are, strict or not: the walk passes them through,
# unless a rule is registered for their type.
_walker = Walker(_has_own_rule, inert_types=_SCALAR_TYPES)
_scalar_types = _SCALAR_TYPE_SET  # the scalars without a registered rule
_flat_leaf_types = _scalar_types | {torch.Tensor}  # what _flat moves or passes through


def _forget_decisions() -> None:
    """Drop every per-type decision: a rule was registered or removed."""
    global _scalar_types, _flat_leaf_types  # noqa: PLW0603 - the one place that rebinds them
    _walker.forget_types()
    _leaf_rules.clear()
    _scalar_types = frozenset(cls for cls in _SCALAR_TYPES if _rule_for(cls) is None)
    _flat_leaf_types = _scalar_types | {torch.Tensor}


def register_transfer(cls: type) -> Callable[[C], C]:
    """Register how :func:`to_device` moves instances of ``cls``.

    A registered rule wins over the type's ``.to()`` method and over the container
    rules, so it also serves containers that must not be rebuilt item by item. It
    applies to ``cls`` and its subclasses, the nearest registered class in a type's MRO
    winning; a rule for an abstract base class applies to every class it recognises
    (one for ``collections.abc.Sequence`` takes lists too).

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

    def decorator(fn: C) -> C:
        if not callable(fn):  # for callers without a type checker
            msg = (  # type: ignore[unreachable]
                f"Expected a function fn(obj, device, **options) to register for "
                f"{cls.__name__}, got {type(fn).__name__} {fn!r}."
            )
            raise TypeError(msg)
        with _rules_lock:
            existing = _rules.get(cls)
            if existing is not None:
                name = f"{existing.__module__}.{getattr(existing, '__qualname__', existing)}"
                msg = (
                    f"{cls.__name__} already has a transfer rule ({name}); call "
                    f"devicekit.unregister_transfer({cls.__name__}) first to replace it."
                )
                raise ValueError(msg)
            _rules[cls] = fn
            _forget_decisions()
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
    with _rules_lock:
        if cls not in _rules:
            msg = f"{getattr(cls, '__name__', cls)} has no transfer rule to unregister."
            raise KeyError(msg)
        del _rules[cls]
        _forget_decisions()


class _Plan:
    """What a to_device call's options imply, worked out once per (device, options).

    Reading ``device.type`` costs a third of a microsecond, and a call that moves a
    small batch takes a few: every flag the walk consults is derived here, and plans
    are cached, so a call only looks its plan up.

    There is one rule for ``non_blocking``, :meth:`_Transfer.tensor_non_blocking`:
    under ``"auto"``, copies to an accelerator are asynchronous; copies from one to the
    host, and MPS copies, are asynchronous and waited for once. The flags below only
    pick the fast path that rule leads to: ``plain`` (one blocking ``.to()``: host
    targets), ``async_host_to_accelerator`` (one ``non_blocking`` ``.to()``), and
    ``opaque_non_blocking``, what objects that move themselves are told, since
    devicekit cannot wait for their copies.
    """

    __slots__ = (
        "async_host_to_accelerator",
        "copy",
        "device",
        "device_is_cpu",
        "device_is_meta",
        "device_is_mps",
        "dtype",
        "memory_format",
        "non_blocking",
        "opaque_non_blocking",
        "packs",
        "pins",
        "plain",
        "rule_options",
        "strict",
        "to_accelerator",
        "trivial",
    )

    def __init__(
        self,
        device: torch.device,
        *,
        non_blocking: NonBlocking,
        dtype: torch.dtype | None,
        copy: bool,
        memory_format: torch.memory_format | None,
        strict: bool,
    ) -> None:
        kind = device.type
        simulated = kind in _simulated_accelerators
        self.device = device
        self.non_blocking = non_blocking
        self.dtype = dtype
        self.copy = copy
        self.memory_format = None if memory_format is torch.preserve_format else memory_format
        self.strict = strict
        self.to_accelerator = kind not in _HOST_DEVICE_TYPES or simulated
        self.device_is_cpu = kind == "cpu"
        self.device_is_meta = kind == "meta"
        self.device_is_mps = kind == "mps"
        # With nothing but the device to change, "already there" is one comparison.
        self.trivial = dtype is None and not copy and self.memory_format is None
        # A plain blocking .to(): asked for, or a move to meta, which copies no data. Under
        # "auto" a cpu target is not plain: host tensors are already there (the hot path
        # returns them first), and the rest come from accelerators, whose copies are
        # issued asynchronously and waited for once.
        self.plain = non_blocking is False or (
            non_blocking == "auto" and self.device_is_meta and not simulated
        )
        self.packs = (
            _packing.packs_to(device) or (simulated and _packing.can_pack)
        ) and self.memory_format is None
        self.pins = not simulated
        # For objects that move themselves, whose copies devicekit cannot wait for:
        # asynchronous only where reading the result is ordered after the copy anyway.
        self.opaque_non_blocking = (
            self.to_accelerator and not self.device_is_mps
            if non_blocking == "auto"
            else bool(non_blocking)
        )
        # The usual accelerator call: host tensors go with a plain non_blocking copy.
        self.async_host_to_accelerator = (
            self.trivial
            and self.to_accelerator
            and not self.device_is_mps
            and non_blocking in ("auto", True)
        )
        self.rule_options = {
            "non_blocking": self.opaque_non_blocking,
            "dtype": dtype,
            "copy": copy,
            "memory_format": self.memory_format or torch.preserve_format,
        }


_plans: dict[object, _Plan] = {}
_PLANS_KEPT = 256  # bounded: option values seen at run time must not pile up


_simulated_accelerators: set[str] = set()


@contextlib.contextmanager
def as_accelerator(device_type: str) -> Iterator[None]:
    """Move data to ``device_type`` (``"meta"``) as to an accelerator, packing included.

    Everything to_device does on the host for an accelerator (the walk, the packing
    decision, grouping, gathering into staging, making the pieces, asynchronous
    copies) then runs on machines without one, with the staging buffer in ordinary
    memory: the tests and the host-side benchmark use it.
    """
    _simulated_accelerators.add(device_type)
    _plans.clear()
    try:
        yield
    finally:
        _simulated_accelerators.discard(device_type)
        _plans.clear()


class _Transfer:
    """One to_device call: its plan, its alias memo, and the devices to wait on."""

    __slots__ = ("memo", "moved_ids", "plan", "remember", "wait_for")

    def __init__(
        self, plan: _Plan, *, remember: bool = False, memo: dict[int, Any] | None = None
    ) -> None:
        self.plan = plan
        # id -> result, for tensors found twice and for every object moved by a rule,
        # a .to() or in place: each is moved once, however often the data holds it.
        self.memo: dict[int, Any] = {} if memo is None else memo
        self.wait_for: set[torch.device] = set()
        # remember=True: look every tensor up in the memo. False: the optimistic path,
        # which only notes the ids of what it moved (see leaf_function).
        self.remember = remember
        self.moved_ids: list[int] = []

    def leaf_function(self) -> Callable[[Any], Any]:
        """The function the walker maps over the leaves, specialised for this call.

        A closure, not a method: its hot path (a tensor whose device alone changes)
        reads locals instead of attributes, which is most of its cost.
        """
        plan = self.plan
        if not plan.trivial or self.remember:
            return self.leaf
        if plan.async_host_to_accelerator:
            return self._host_to_accelerator()
        device, moved_ids, plain = plan.device, self.moved_ids, plan.plain
        # `obj.device` builds a torch.device each time; for the host targets a flag says
        # the same thing at a third of the cost.
        target_is_meta, target_is_cpu = plan.device_is_meta, plan.device_is_cpu
        transfer = self

        def move(obj: Any) -> Any:
            if type(obj) is not _Tensor:
                return transfer.leaf(obj)
            if target_is_meta:
                if obj.is_meta:
                    return obj
            elif target_is_cpu:
                if obj.is_cpu:
                    return obj
            elif obj.device == device:
                return obj
            if not plain:
                return transfer.tensor(obj)
            # Optimistic about aliasing: note what moved, and let to_device walk again
            # with the memo in the rare batch that holds one tensor twice.
            moved_ids.append(id(obj))
            try:
                return obj.to(device)
            except NotImplementedError:
                if obj.is_meta:  # PyTorch's "no data!" becomes a message with the path
                    raise transfer.meta_error(obj) from None
                raise

        return move

    def _host_to_accelerator(self) -> Callable[[Any], Any]:
        """The leaf function of the usual accelerator call: host tensors copied async.

        Host tensors are all a batch usually holds, and they need no check beyond
        ``is_cpu``: nothing to wait for, nothing already there. Anything else takes the
        general path.
        """
        device, moved_ids, leaf = self.plan.device, self.moved_ids, self.leaf

        def move(obj: Any) -> Any:
            if type(obj) is _Tensor and obj.is_cpu:
                moved_ids.append(id(obj))  # optimistic about aliasing, as in leaf_function
                return obj.to(device, non_blocking=True)
            return leaf(obj)

        return move

    def leaf(self, obj: Any) -> Any:
        """Move one leaf of the data, whatever the options."""
        if type(obj) is _Tensor:
            return self.tensor(obj)
        rule = _leaf_rules.get(type(obj)) or _choose_leaf_rule(type(obj))
        if rule in _SIDE_EFFECT_FREE:
            return rule(obj, self)
        # A user's .to() or rule, a module or an optimizer: called once per object.
        moved = self.memo.get(id(obj), _UNSEEN)
        if moved is _UNSEEN:
            moved = self.memo[id(obj)] = rule(obj, self)
        return moved

    def meta_error(self, tensor: torch.Tensor) -> LeafError:
        """The error for a meta tensor asked onto a device with data."""
        msg = (
            f"Cannot move {{path}} to {self.plan.device}: it is a tensor on the meta device, "
            "which has a shape but no data. Create it on a real device instead, for "
            "example with torch.empty_like(tensor, device=...) or module.to_empty(device=...)."
        )
        return LeafError(msg)

    def tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """Move one tensor, or return it as is where it already is what was asked for."""
        moved: torch.Tensor | None = self.memo.get(id(tensor))
        if moved is not None:
            return moved
        plan = self.plan
        if tensor.is_meta and not plan.device_is_meta:
            raise self.meta_error(tensor)
        if plan.trivial:
            if tensor.device == plan.device:
                return tensor
            # Keyword arguments cost PyTorch more to parse than the copy of a small
            # tensor to meta takes: pass non_blocking only when it is True.
            if self.tensor_non_blocking(tensor):
                moved = tensor.to(plan.device, non_blocking=True)
            else:
                moved = tensor.to(plan.device)
        else:
            moved = self.tensor_with_options(tensor)
        self.memo[id(tensor)] = moved
        return moved

    def tensor_with_options(self, tensor: torch.Tensor) -> torch.Tensor:
        plan = self.plan
        dtype = plan.dtype if plan.dtype is not None and tensor.is_floating_point() else None
        memory_format = plan.memory_format
        if memory_format is not None and not _format_applies(memory_format, tensor):
            memory_format = None
        if (
            not plan.copy
            and tensor.device == plan.device
            and (dtype is None or tensor.dtype == dtype)
            and (memory_format is None or tensor.is_contiguous(memory_format=memory_format))
        ):
            return tensor
        return tensor.to(
            plan.device,
            dtype=dtype,
            non_blocking=self.tensor_non_blocking(tensor),
            copy=plan.copy,
            memory_format=memory_format or torch.preserve_format,
        )

    def tensor_non_blocking(self, tensor: torch.Tensor) -> bool:
        plan = self.plan
        if plan.non_blocking != "auto":
            return bool(plan.non_blocking)
        if not plan.to_accelerator:
            if tensor.is_cpu or tensor.is_meta:
                return False  # host to host: nothing to overlap
            # Device to host is issued asynchronously and waited for once, before
            # to_device returns, so every result is safe to read.
            self.wait_for.add(tensor.device)
        elif plan.device_is_mps:
            self.wait_for.add(plan.device)  # MPS copies likewise
        return True

    def each(
        self, leaves: list[Any], active: list[int], packed: Callable[[int], Any], data: Any
    ) -> list[Any]:
        """The leaves at ``active`` moved one by one (the packed ones looked up)."""
        moved = leaves.copy()
        memo, device, leaf = self.memo, self.plan.device, self.leaf
        fast = self.plan.async_host_to_accelerator
        for index in active:
            obj = leaves[index]
            kind = type(obj)
            try:
                if kind is _Tensor:
                    copy = packed(id(obj))
                    if copy is None:
                        copy = memo.get(id(obj))
                    if copy is None:
                        if fast and obj.is_cpu:
                            copy = memo[id(obj)] = obj.to(device, non_blocking=True)
                        else:
                            copy = self.tensor(obj)
                    moved[index] = copy
                elif kind not in _scalar_types:
                    moved[index] = leaf(obj)
            except Exception as err:
                raise _walker.locate(err, data, index) from None
        return moved

    def finish(self) -> None:
        """Wait once per source device for the asynchronous copies that need it."""
        for device in self.wait_for:
            event = torch.Event(device=device)
            event.record(torch.accelerator.current_stream(device))
            event.synchronize()


def _flat(data: dict[Any, Any] | list[Any] | tuple[Any, ...], device: torch.device) -> Any:
    """The most common batch moved with one comprehension, or None for any other batch.

    A few host tensors (and scalars) in a dict, list or tuple, such as
    ``(images, labels)`` or ``{"input_ids": ..., "attention_mask": ...}``, would
    otherwise pay for taking apart and rebuilding a structure that has none.
    """
    values = data.values() if type(data) is dict else data
    # The checks run at C speed: a Python loop over the values would cost as much as
    # the comprehension that moves them.
    if len(values) >= _packing.MIN_TENSORS or not _flat_leaf_types.issuperset(map(type, values)):
        return None  # enough tensors for packing to be worth deciding, or containers
    if len(set(map(id, values))) < len(values):
        # Something found twice: fine for scalars (None, small ints), the memo's work
        # for a tensor, which must come back as one moved tensor.
        tensor_ids = [id(value) for value in values if type(value) is _Tensor]
        if len(set(tensor_ids)) < len(tensor_ids):
            return None
    # .to() alone is right for any plain tensor, as in _copied; one that cannot move (a
    # meta tensor) makes the general path raise its error with its path. The
    # comprehensions are written out here, not borrowed from _copied: a call more is a
    # tenth of the host time of an (images, labels) pair.
    try:
        if type(data) is dict:
            return {
                key: value.to(device, non_blocking=True) if type(value) is _Tensor else value
                for key, value in data.items()
            }
        moved = [
            value.to(device, non_blocking=True) if type(value) is _Tensor else value
            for value in data
        ]
    except Exception:
        return None
    return moved if type(data) is list else tuple(moved)


def _to_accelerator(data: Any, plan: _Plan) -> Any:
    """to_device's work for an accelerator, once its options are a plan."""
    if plan.async_host_to_accelerator:  # the usual call: its commonest batches
        if type(data) is _Tensor and data.is_cpu:
            return data.to(plan.device, non_blocking=True)
        if plan.packs and type(data) in _FLAT_TYPES:
            moved = _flat(data, plan.device)
            if moved is not None:
                return moved
    if plan.packs and type(data) is not _Tensor:
        return _in_bulk(data, plan)
    transfer = _Transfer(plan)
    moved = _walker.map(transfer.leaf_function(), data)
    moved_ids = transfer.moved_ids
    if len(moved_ids) > 1 and len(set(moved_ids)) < len(moved_ids):
        transfer = _Transfer(plan, remember=True, memo=transfer.memo)  # as on the host path
        moved = _walker.map(transfer.leaf_function(), data)
    if transfer.wait_for:
        transfer.finish()
    return moved


def _in_bulk(data: Any, plan: _Plan) -> Any:
    """Move ``data`` to an accelerator by taking it apart, moving, and rebuilding.

    The accelerator path: the leaves are moved as a list, so small host tensors can go
    packed (see :mod:`devicekit._packing`) and the rest need no call per leaf beyond
    their own copy; plain scalars are not looked at; the containers are rebuilt
    around the moved leaves.
    """
    leaves, spec, active, _, _ = _walker.flatten(data)
    if not active:  # nothing to move: token ids, metadata
        return _walker.unflatten(spec, leaves)
    # Plain scalars (the inactive leaves) are never tensors: every tensor is active.
    # Each tensor once, by id: one pass finds the tensors and whether one repeats.
    distinct = {id(leaf): leaf for leaf in leaves if type(leaf) is _Tensor}
    tensors = list(distinct.values())
    packed: dict[int, torch.Tensor] = {}
    if _packing.might_pay(tensors):
        packed = _packing.pack(
            tensors,
            plan.device,
            non_blocking=plan.non_blocking is not False,
            dtype=plan.dtype,
            pin=plan.pins,
        )
    moved = None
    if len(tensors) < len(active):
        pass  # a tensor found twice, or objects with rules or .to(): one by one, below
    elif packed and len(packed) == len(tensors):  # all packed: no call per leaf
        moved = _placed(leaves, active, list(map(packed.__getitem__, distinct)))
    elif not packed and plan.async_host_to_accelerator:
        moved = _copied(leaves, plan.device)
    if moved is None:
        transfer = _Transfer(plan)
        moved = transfer.each(leaves, active, packed.get, data)
        if transfer.wait_for:
            transfer.finish()
    return _walker.unflatten(spec, moved)


def _placed(leaves: list[Any], active: list[int], moved: list[Any]) -> list[Any]:
    """The leaves with those at ``active`` replaced by ``moved``, in order."""
    if len(active) == len(leaves):
        return moved
    placed = leaves.copy()
    for index, value in zip(active, moved, strict=True):
        placed[index] = value
    return placed


def _copied(leaves: list[Any], device: torch.device) -> list[Any] | None:
    """The leaves with each tensor among them copied, in one comprehension.

    The leaves hold tensors, each once, and plain scalars. None where a copy fails:
    the caller's loop then raises that error with its path.
    """
    # .to() alone is right for any plain tensor here: a host one is copied async, one
    # on the target comes back as it is, one on another accelerator is copied.
    try:
        return [
            leaf.to(device, non_blocking=True) if type(leaf) is _Tensor else leaf for leaf in leaves
        ]
    except Exception:  # raised again, with its path, by the loop that follows
        return None


def _format_applies(memory_format: torch.memory_format, tensor: torch.Tensor) -> bool:
    # As nn.Module.to does: channels_last formats concern only 4-d (and 5-d) tensors,
    # so a batch's labels and masks pass untouched next to its images.
    if memory_format is torch.channels_last:
        return tensor.dim() == 4
    if memory_format is torch.channels_last_3d:
        return tensor.dim() == 5
    return True


# Leaf rules: one per type, chosen once. Each takes (obj, transfer) and returns the moved obj.


def _move_tensor_subclass(tensor: torch.Tensor, transfer: _Transfer) -> torch.Tensor:
    return transfer.tensor(tensor)


def _move_parameter(param: torch.nn.Parameter, transfer: _Transfer) -> torch.nn.Parameter:
    """A Parameter comes back a Parameter, as nn.Module.to makes it.

    Its own .to() returns a plain tensor; the moved data is wrapped again, with the
    same requires_grad.
    """
    moved: torch.nn.Parameter | None = transfer.memo.get(id(param))
    if moved is None:
        with torch.no_grad():
            data = transfer.tensor(param)
        moved = transfer.memo[id(param)] = torch.nn.Parameter(data, param.requires_grad)
    return moved


def _keep(obj: Any, transfer: _Transfer) -> Any:
    return obj


def _refuse(obj: Any, transfer: _Transfer) -> Any:
    if not transfer.plan.strict:
        return obj
    name = f"{type(obj).__module__}.{type(obj).__name__}"
    msg = (
        f"Cannot move {{path}}: it is a {name}, which is neither a tensor, a container, a type "
        "with a .to() method, a registered type, nor a plain scalar. Register how to move it "
        f"with @devicekit.register_transfer({type(obj).__name__}), or pass strict=False "
        "to leave such objects as they are."
    )
    raise LeafError(msg)


def _numpy_array(array: Any, transfer: _Transfer) -> Any:
    # Arrays of numbers are data, left as they are; an array of objects may hold
    # tensors, which no rule here can reach without rebuilding the array.
    if array.dtype == object and any(isinstance(item, torch.Tensor) for item in array.flat):
        msg = (
            "Cannot move {path}: it is a numpy array of objects holding tensors, which "
            "devicekit cannot move inside it. Make it a list (array.tolist()), or register "
            "how to move it with @devicekit.register_transfer(numpy.ndarray)."
        )
        raise LeafError(msg)
    return _refuse(array, transfer)


def _in_place_only(obj: torch.nn.Module | torch.optim.Optimizer) -> LeafError:
    kind = "the module" if isinstance(obj, torch.nn.Module) else "the optimizer"
    msg = (
        f"Cannot copy {{path}}: {kind} {type(obj).__name__} moves in place, so copy=True "
        "cannot give a separate copy. Use copy.deepcopy on it first, then move the copy."
    )
    return LeafError(msg)


def _move_module(module: torch.nn.Module, transfer: _Transfer) -> torch.nn.Module:
    if transfer.plan.copy:
        raise _in_place_only(module)
    options: dict[str, Any] = {"non_blocking": transfer.plan.opaque_non_blocking}
    if transfer.plan.dtype is not None:
        options["dtype"] = transfer.plan.dtype
    if transfer.plan.memory_format is not None:
        options["memory_format"] = transfer.plan.memory_format
    return module.to(transfer.plan.device, **options)


def _move_optimizer(optimizer: torch.optim.Optimizer, transfer: _Transfer) -> Any:
    if transfer.plan.copy:
        raise _in_place_only(optimizer)
    # The state follows the parameters it belongs to; the parameters are the model's and
    # move with it, so parameters elsewhere mean the model was not moved first.
    for group_index, group in enumerate(optimizer.param_groups):
        for param_index, param in enumerate(group["params"]):
            if param.device != transfer.plan.device:
                where = f"param_groups[{group_index}]['params'][{param_index}]"
                msg = (
                    f"Cannot move {{path}} (an optimizer) to {transfer.plan.device}: its state "
                    f"follows its parameters, and {where} is on {param.device}. Move the model "
                    "first (to_device(model, device)): the optimizer holds the model's own "
                    "parameters. Where the model was moved already, PyTorch replaced its "
                    "parameters instead of moving them in place (it does so for some device "
                    "pairs, such as to meta): create the optimizer after moving the model."
                )
                raise LeafError(msg)
    for group in optimizer.param_groups:
        # PyTorch keeps "step" on the host unless the optimizer is capturable or fused,
        # as Optimizer.load_state_dict does.
        step_on_device = bool(group.get("capturable") or group.get("fused"))
        for param in group["params"]:
            state = optimizer.state.get(param)
            if state is None:
                continue
            if not isinstance(state, dict):  # a state object of the optimizer's own
                optimizer.state[param] = to_device(
                    state, param.device, non_blocking=transfer.plan.non_blocking
                )
                continue
            for key, value in state.items():
                if key == "step" and not step_on_device:
                    continue
                dtype = param.dtype if param.is_floating_point() and key != "step" else None
                state[key] = to_device(
                    value, param.device, non_blocking=transfer.plan.non_blocking, dtype=dtype
                )
    return optimizer


def _check_result(result: Any, obj: Any, how: str) -> Any:
    if result is None:
        msg = (
            f"Cannot move {{path}}: {how} returned None for the {type(obj).__name__} there; "
            "expected the moved object. A method that moves in place must return self."
        )
        raise LeafError(msg)
    return result


def _registered_rule(rule: TransferRule) -> Callable[[Any, _Transfer], Any]:
    def move(obj: Any, transfer: _Transfer) -> Any:
        result = rule(obj, transfer.plan.device, **transfer.plan.rule_options)
        how = f"the rule registered for {type(obj).__name__}"
        return _check_result(result, obj, how)

    return move


# What a .to(*args, **kwargs) is taken to accept: the options a method that hands its
# arguments on to Tensor.to (PackedSequence.to, for one) handles for every tensor it holds.
_FORWARDED_OPTIONS = frozenset({"non_blocking", "dtype"})


def _to_method_rule(cls: type) -> Callable[[Any, _Transfer], Any]:
    """Call ``obj.to(device, ...)`` with the options its signature takes, found once.

    An option is passed where the signature names it; a bare ``**kwargs`` is trusted
    with ``non_blocking`` and ``dtype`` only. ``memory_format`` applies, as in
    :meth:`torch.nn.Module.to`, to the 4-d tensors it can: an object that does not name
    it moves without it. ``dtype`` or ``copy`` asked of an object that cannot take them
    is refused, not dropped.
    """
    try:
        parameters = inspect.signature(cls.to).parameters.values()  # type: ignore[attr-defined]
    except (TypeError, ValueError):  # no signature to read: hand it the device only
        parameters = ()  # type: ignore[assignment]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    names = {p.name for p in parameters}
    accepted = [
        name
        for name in _OPTION_NAMES
        if name in names or (takes_any and name in _FORWARDED_OPTIONS)
    ]

    def move(obj: Any, transfer: _Transfer) -> Any:
        asked = {
            "non_blocking": transfer.plan.opaque_non_blocking,
            "dtype": transfer.plan.dtype,
            "copy": transfer.plan.copy,
            "memory_format": transfer.plan.memory_format,
        }
        options = {name: asked[name] for name in accepted if asked[name]}
        for name, value in asked.items():
            if value and name not in accepted and name in ("dtype", "copy"):
                msg = (
                    f"Cannot move {{path}} with {name}={value!r}: "
                    f"{cls.__name__}.to() does not name a {name} argument. Register how to "
                    f"move it with @devicekit.register_transfer({cls.__name__})."
                )
                raise LeafError(msg)
        return _check_result(obj.to(transfer.plan.device, **options), obj, f"{cls.__name__}.to()")

    return move


_LeafRule: TypeAlias = Callable[[Any, _Transfer], Any]
# Rules that call no user code and move nothing in place: they need no memo.
_SIDE_EFFECT_FREE = frozenset({_keep, _refuse, _numpy_array, _move_tensor_subclass})
_UNSEEN: Any = object()
_leaf_rules: dict[type, _LeafRule] = {}


def _choose_leaf_rule(cls: type) -> _LeafRule:
    """Decide once per type how its instances move, and remember it."""
    if len(_leaf_rules) >= TYPES_KEPT:
        _leaf_rules.clear()  # types made at run time must not pile up
    rule = _leaf_rules[cls] = _leaf_rule(cls)
    return rule


def _leaf_rule(cls: type) -> _LeafRule:
    registered = _rule_for(cls)
    if registered is not None:
        return _registered_rule(registered)
    if issubclass(cls, torch.nn.Parameter):
        return _move_parameter
    if issubclass(cls, torch.Tensor):
        return _move_tensor_subclass
    if issubclass(cls, torch.nn.Module):
        return _move_module
    if issubclass(cls, torch.optim.Optimizer):
        return _move_optimizer
    if issubclass(cls, _SCALAR_TYPES) or issubclass(cls, enum.Enum):
        return _keep
    if callable(getattr(cls, "to", None)):
        return _to_method_rule(cls)
    if cls.__module__ == "numpy" and cls.__name__ == "ndarray":  # numpy is not imported
        return _numpy_array
    return _refuse


def _check_options(
    non_blocking: object, dtype: object, memory_format: object, *, copy: object, strict: object
) -> None:
    for name, value in (("copy", copy), ("strict", strict)):
        if value is not True and value is not False:
            msg = f"Expected {name} to be True or False, got {value!r}."
            raise TypeError(msg)
    if non_blocking not in ("auto", True, False) or (
        isinstance(non_blocking, int | float) and not isinstance(non_blocking, bool)
    ):
        msg = f"Expected non_blocking to be 'auto', True or False, got {non_blocking!r}."
        raise ValueError(msg)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        msg = (
            "Expected dtype to be None or a floating-point dtype such as torch.float16 or "
            f"torch.bfloat16, got {dtype!r}: to_device casts floating-point tensors only, so "
            "integer tensors (labels, indices) keep their dtype."
        )
        raise ValueError(msg)
    if memory_format is not None and not isinstance(memory_format, torch.memory_format):
        msg = (
            "Expected memory_format to be None or a torch.memory_format such as "
            f"torch.channels_last, got {memory_format!r}."
        )
        raise ValueError(msg)


def to_device(
    data: T,
    device: DeviceLike | None = None,
    /,
    *,
    non_blocking: NonBlocking = "auto",
    dtype: torch.dtype | None = None,
    copy: bool = False,
    memory_format: torch.memory_format | None = None,
    strict: bool = False,
    skip_keys: Collection[Hashable] = (),
) -> T:
    """Move tensors, modules, optimizers and any nesting of them to a device.

    Containers come back as new containers of their exact type (dict and Mapping
    subclasses, list, tuple, namedtuple, dataclass, set); the input is never changed,
    except modules and optimizers, which move in place and are returned as
    :meth:`torch.nn.Module.to` does. A tensor found twice comes back as one moved
    tensor, and a tensor already where it should be comes back as it is.

    >>> import torch, devicekit as dk
    >>> batch = {"image": torch.zeros(2, 3), "label": torch.tensor([1, 0]), "id": ["a", "b"]}
    >>> moved = dk.to_device(batch, "meta")
    >>> moved["image"].device, moved["id"]
    (device(type='meta'), ['a', 'b'])
    >>> dk.to_device(batch, "cpu", dtype=torch.float16)["image"].dtype
    torch.float16

    Args:
        data: A tensor, module, optimizer, or containers of them and of other objects.
            Objects with a ``.to()`` method move with it; types registered with
            :func:`register_transfer` move with their rule; other leaves (numbers,
            strings, arrays) are returned unchanged.
        device: The target: a :class:`torch.device`, a string such as ``"cuda:1"``, an
            accelerator index, or None for :func:`~devicekit.current_device`.
        non_blocking: ``"auto"`` copies host->device asynchronously (pinned sources
            overlap with compute), and issues device->host and MPS copies asynchronously
            but waits for them once before returning, so whatever comes back is safe to
            read. True and False apply to every copy as in :meth:`torch.Tensor.to`.
        dtype: A floating-point dtype to cast floating-point tensors to; integer and
            boolean tensors keep theirs.
        copy: Return new tensors even where they are already on the target.
        memory_format: A :class:`torch.memory_format`; ``torch.channels_last`` applies
            to 4-d tensors and ``torch.channels_last_3d`` to 5-d ones, as in
            :meth:`torch.nn.Module.to`.
        strict: Raise on leaves that cannot be moved and are not plain scalars,
            instead of returning them unchanged.
        skip_keys: Keys whose values, in any mapping at any depth, stay where they are
            (the same objects), as accelerate's ``send_to_device`` has it: a batch's
            ``"raw_text"`` or a host-side index, say. One key may be given alone. Such a
            call is not packed.

    Returns:
        The data on ``device``, with the same structure.

    Raises:
        TransferError: Something in the data cannot be moved (a meta tensor to a real
            device, a reference cycle, a ``.to()`` that returned None, an unmovable leaf
            with ``strict=True``); the message names its path, such as ``data['x'][2]``.
        DeviceUnavailableError: ``device`` does not parse or is not on this machine.
        ValueError: An option has a value outside those listed above.
    """
    if _is_compiling():
        return _traced(data, device, non_blocking, dtype)  # type: ignore[no-any-return]
    if skip_keys:
        return _skipping(  # type: ignore[no-any-return]
            data,
            skip_keys,
            device,
            non_blocking=non_blocking,
            dtype=dtype,
            copy=copy,
            memory_format=memory_format,
            strict=strict,
        )
    # Identity, not truth: copy="False" and strict="no" are mistakes to report, not
    # values to read as True.
    defaults = (
        non_blocking == "auto"
        and dtype is None
        and memory_format is None
        and copy is False
        and strict is False
    )
    if not defaults:
        _check_options(non_blocking, dtype, memory_format, copy=copy, strict=strict)
    # One cache: the usual call (every option at its default) is keyed by the device
    # alone, since building a tuple key costs as much as the rest of the lookup. A
    # torch.device found there is a target already resolved (an index, checked to
    # exist), so the usual call with one skips resolving it again.
    plan = _plans.get(device) if defaults and type(device) is torch.device else None
    if plan is None:
        target = current_device() if device is None else resolve_device(device)
        key = target if defaults else (target, non_blocking, dtype, copy, memory_format, strict)
        plan = _plans.get(key)
        if plan is None:
            if len(_plans) >= _PLANS_KEPT:
                _plans.clear()
            plan = _plans[key] = _Plan(
                target,
                non_blocking=non_blocking,
                dtype=dtype,
                copy=copy,
                memory_format=memory_format,
                strict=strict,
            )
    if plan.to_accelerator:
        return _to_accelerator(data, plan)  # type: ignore[no-any-return]
    # The host path inline: a call per to_device is a measurable share of a small batch.
    transfer = _Transfer(plan)
    moved = _walker.map(transfer.leaf_function(), data)
    moved_ids = transfer.moved_ids
    if len(moved_ids) > 1 and len(set(moved_ids)) < len(moved_ids):
        # The optimistic walk moved some tensor twice: walk again, through the memo,
        # which keeps what objects with rules became, so none is moved twice.
        transfer = _Transfer(plan, remember=True, memo=transfer.memo)
        moved = _walker.map(transfer.leaf_function(), data)
    if transfer.wait_for:
        transfer.finish()
    return moved  # type: ignore[no-any-return]


class _Kept:
    """A value under a skipped key, carried through the walk untouched."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def to(self, device: torch.device) -> _Kept:
        return self


def _skipping_walker(skip: frozenset[Hashable]) -> Walker:
    def skipping(cls: type) -> Node | None:
        base = container_node(cls) if not _has_own_rule(cls) else None
        if base is None or not issubclass(cls, Mapping):
            return None
        rules = base

        def children(node: Any) -> list[Any]:
            return [_Kept(value) if key in skip else value for key, value in mapping_items(node)]

        def rebuild(node: Any, values: list[Any]) -> Any:
            kept = [value.value if type(value) is _Kept else value for value in values]
            return rules.rebuild(node, kept)

        return Node(children, rebuild, rules.keys)

    return Walker(_has_own_rule, inert_types=_SCALAR_TYPES, extra_nodes=skipping)


_skipping_walkers: dict[frozenset[Hashable], Walker] = {}


def _skipping(
    data: Any, skip_keys: Collection[Hashable], device: DeviceLike | None, **options: Any
) -> Any:
    """to_device with values under ``skip_keys`` left where they are.

    A walker whose mapping rules hand those values over wrapped, so that they pass as
    leaves that do not move, and unwrap them when the mapping is rebuilt.
    """
    # One key alone, as accelerate takes it too; a string is not a collection of letters.
    skip = frozenset((skip_keys,) if isinstance(skip_keys, str | bytes) else skip_keys)
    walker = _skipping_walkers.get(skip)
    if walker is None:
        if len(_skipping_walkers) >= 64:
            _skipping_walkers.clear()
        walker = _skipping_walkers[skip] = _skipping_walker(skip)
    _check_options(
        options["non_blocking"],
        options["dtype"],
        options["memory_format"],
        copy=options["copy"],
        strict=options["strict"],
    )
    target = current_device() if device is None else resolve_device(device)
    plan = _Plan(target, **options)
    transfer = _Transfer(plan, remember=True)  # aliases through the memo: one walk
    moved = walker.map(transfer.leaf, data)
    if transfer.wait_for:
        transfer.finish()
    return moved


def _traced(data: Any, device: DeviceLike | None, non_blocking: object, dtype: Any) -> Any:
    """to_device as torch.compile traces it: the common containers, by plain recursion.

    Caches, type registries and context variables are what a compiler cannot follow;
    inside a compiled function the device is taken as given (None: the current device),
    and dicts, lists, tuples and namedtuples of tensors move as written here. Anything
    else is returned as it is, as the eager to_device returns other leaves.
    """
    if device is None:
        device = current_device()
    target = torch.device(device)
    asynchronous = (
        bool(non_blocking)
        if non_blocking != "auto"
        else target.type
        not in (
            "cpu",
            "meta",
        )
    )

    memo: dict[int, torch.Tensor] = {}  # a tensor found twice comes back as one

    def move(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if id(obj) not in memo:
                cast = dtype if dtype is not None and obj.is_floating_point() else obj.dtype
                memo[id(obj)] = obj.to(target, dtype=cast, non_blocking=asynchronous)
            return memo[id(obj)]
        if type(obj) is dict:
            return {key: move(value) for key, value in obj.items()}
        if type(obj) is list:
            return [move(value) for value in obj]
        if type(obj) is tuple:
            return tuple(move(value) for value in obj)
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return type(obj)(*(move(value) for value in obj))
        return obj

    return move(data)
