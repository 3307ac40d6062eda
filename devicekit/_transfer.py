"""to_device: move tensors, modules, optimizers and nested batches to a device.

The walk itself is :mod:`devicekit._tree`'s; this module decides what happens to
each leaf. Per-type decisions (is this registered? does its ``.to()`` take
``dtype=``?) are made once per type and cached, so the hot path is a dict lookup.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol, TypeAlias, TypeVar

import torch

from devicekit._devices import DeviceLike, resolve_device
from devicekit._manager import current_device
from devicekit._staging import PACKABLE_DEVICE_TYPES, is_packable, packed_copy
from devicekit._tree import LeafError, Walker

__all__ = ["NonBlocking", "TransferRule", "register_transfer", "to_device"]

T = TypeVar("T")
C = TypeVar("C", bound=Callable[..., Any])

NonBlocking: TypeAlias = bool | Literal["auto"]
"""``"auto"``, True or False; see :func:`to_device`."""

# Devices whose copies are no-ops or synchronous by nature: no stream to wait on.
_HOST_DEVICE_TYPES = frozenset({"cpu", "meta"})
# Leaves that hold no data to move; strict=True accepts them.
_SCALAR_TYPES = (type(None), bool, int, float, complex, str, bytes)
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
_Tensor = torch.Tensor  # one global lookup on the hot path instead of two
_CPU = torch.device("cpu")


def _has_own_rule(cls: type) -> bool:
    # Mappings are rebuilt item by item even when they have .to(): BatchEncoding.to,
    # for one, moves its input in place instead of returning a moved copy.
    registered = any(klass in _rules for klass in cls.__mro__)
    to_method = not issubclass(cls, Mapping) and callable(getattr(cls, "to", None))
    return registered or to_method


# Plain scalars are left as they are, strict or not: the walk passes them through.
_walker = Walker(_has_own_rule, inert_types=_SCALAR_TYPES)


def register_transfer(cls: type) -> Callable[[C], C]:
    """Register how :func:`to_device` moves instances of ``cls`` (and its subclasses).

    A registered rule wins over the type's ``.to()`` method and over the container
    rules, so it also serves containers that must not be rebuilt item by item.

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

    Args:
        cls: The type whose instances the decorated function moves.

    Returns:
        A decorator that registers ``fn(obj, device, **options) -> moved`` and returns it
        unchanged. ``options`` are ``non_blocking``, ``dtype``, ``copy`` and ``memory_format``.

    Raises:
        TypeError: ``cls`` is not a class, or is :class:`torch.Tensor` itself, whose move
            is built in.
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

    def decorator(fn: C) -> C:
        _rules[cls] = fn
        # Rules are looked up once per type and cached: a new rule invalidates both caches.
        _walker.forget_types()
        _leaf_rules.clear()
        return fn

    return decorator


class _Plan:
    """What a to_device call's options imply, worked out once per (device, options).

    Reading ``device.type`` costs a third of a microsecond, and a call that moves a
    small batch takes a few: every flag the walk consults is derived here, and plans
    are cached, so a call only looks its plan up.
    """

    __slots__ = (
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
        self.device = device
        self.non_blocking = non_blocking
        self.dtype = dtype
        self.copy = copy
        self.memory_format = None if memory_format is torch.preserve_format else memory_format
        self.strict = strict
        self.to_accelerator = kind not in _HOST_DEVICE_TYPES
        self.device_is_cpu = kind == "cpu"
        self.device_is_meta = kind == "meta"
        self.device_is_mps = kind == "mps"
        # With nothing but the device to change, "already there" is one comparison.
        self.trivial = dtype is None and not copy and self.memory_format is None
        # A plain blocking .to(): asked for, or a move to meta, which copies no data. Under
        # "auto" a cpu target is not plain: host tensors are already there (the hot path
        # returns them first), and the rest come from accelerators, whose copies are
        # issued asynchronously and waited for once.
        self.plain = non_blocking is False or (non_blocking == "auto" and self.device_is_meta)
        self.packs = kind in PACKABLE_DEVICE_TYPES and self.memory_format is None
        # For objects that move themselves, whose copies devicekit cannot wait for:
        # asynchronous only where reading the result is ordered after the copy anyway.
        self.opaque_non_blocking = (
            self.to_accelerator and not self.device_is_mps
            if non_blocking == "auto"
            else bool(non_blocking)
        )
        self.rule_options = {
            "non_blocking": self.opaque_non_blocking,
            "dtype": dtype,
            "copy": copy,
            "memory_format": self.memory_format or torch.preserve_format,
        }


_plans: dict[tuple[object, ...], _Plan] = {}
_default_plans: dict[torch.device, _Plan] = {}  # all options at their defaults: the usual call


class _Transfer:
    """One to_device call: its plan, its alias memo, and the devices to wait on."""

    __slots__ = ("memo", "moved_ids", "plan", "remember", "wait_for")

    def __init__(self, plan: _Plan, *, remember: bool = False) -> None:
        self.plan = plan
        self.memo: dict[int, torch.Tensor] = {}
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

    def leaf(self, obj: Any) -> Any:
        """Move one leaf of the data, whatever the options."""
        if type(obj) is _Tensor:
            return self.tensor(obj)
        rule = _leaf_rules.get(type(obj)) or _choose_leaf_rule(type(obj))
        return rule(obj, self)

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
        moved = self.memo.get(id(tensor))
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

    def pack_small_tensors(self, data: Any) -> None:
        """Send the data's small host tensors in one packed copy, ahead of the walk."""
        plan = self.plan
        unique = {id(leaf): leaf for leaf in _walker.leaves(data) if type(leaf) is _Tensor}
        small = [tensor for tensor in unique.values() if is_packable(tensor)]
        if len(small) < 2:
            return
        copies = packed_copy(small, plan.device, non_blocking=plan.non_blocking is not False)
        for tensor, copy in zip(small, copies, strict=True):
            cast = plan.dtype is not None and copy.is_floating_point()
            self.memo[id(tensor)] = copy.to(plan.dtype) if cast else copy

    def finish(self) -> None:
        """Wait once per source device for the asynchronous copies that need it."""
        for device in self.wait_for:
            event = torch.Event(device=device)
            event.record(torch.accelerator.current_stream(device))
            event.synchronize()


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
                    f"Cannot move the optimizer {{path}} to {transfer.plan.device}: its state "
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
            if not state:
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


def _to_method_rule(cls: type) -> Callable[[Any, _Transfer], Any]:
    """Call ``obj.to(device, ...)`` with the options its signature takes, found once."""
    try:
        parameters = inspect.signature(cls.to).parameters.values()  # type: ignore[attr-defined]
    except (TypeError, ValueError):  # no signature to read: hand it the device only
        parameters = ()  # type: ignore[assignment]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    names = {p.name for p in parameters}
    accepted = [name for name in _OPTION_NAMES if takes_any or name in names]

    def move(obj: Any, transfer: _Transfer) -> Any:
        asked = {
            "non_blocking": transfer.plan.opaque_non_blocking,
            "dtype": transfer.plan.dtype,
            "copy": transfer.plan.copy,
            "memory_format": transfer.plan.memory_format,
        }
        options = {name: asked[name] for name in accepted if asked[name]}
        for name, value in asked.items():
            if value and name not in accepted and name != "non_blocking":
                msg = (
                    f"Cannot move {{path}} with {name}={value!r}: "
                    f"{cls.__name__}.to() takes no {name} argument. Register how to move "
                    f"it with @devicekit.register_transfer({cls.__name__})."
                )
                raise LeafError(msg)
        return _check_result(obj.to(transfer.plan.device, **options), obj, f"{cls.__name__}.to()")

    return move


_LeafRule: TypeAlias = Callable[[Any, _Transfer], Any]
_leaf_rules: dict[type, _LeafRule] = {}


def _choose_leaf_rule(cls: type) -> _LeafRule:
    """Decide once per type how its instances move, and remember it."""
    rule = _leaf_rules[cls] = _leaf_rule(cls)
    return rule


def _leaf_rule(cls: type) -> _LeafRule:
    for klass in cls.__mro__:
        if klass in _rules:
            return _registered_rule(_rules[klass])
    if issubclass(cls, torch.Tensor):
        return _move_tensor_subclass
    if issubclass(cls, torch.nn.Module):
        return _move_module
    if issubclass(cls, torch.optim.Optimizer):
        return _move_optimizer
    if issubclass(cls, _SCALAR_TYPES):
        return _keep
    if callable(getattr(cls, "to", None)):
        return _to_method_rule(cls)
    return _refuse


def _check_options(non_blocking: object, dtype: object, memory_format: object) -> None:
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

    Returns:
        The data on ``device``, with the same structure.

    Raises:
        TransferError: Something in the data cannot be moved (a meta tensor to a real
            device, a reference cycle, a ``.to()`` that returned None, an unmovable leaf
            with ``strict=True``); the message names its path, such as ``data['x'][2]``.
        DeviceUnavailableError: ``device`` does not parse or is not on this machine.
        ValueError: An option has a value outside those listed above.
    """
    defaults = non_blocking == "auto" and dtype is None and memory_format is None
    if not defaults:
        _check_options(non_blocking, dtype, memory_format)
    target = current_device() if device is None else resolve_device(device)
    if defaults and not copy and not strict:
        plan = _default_plans.get(target)
        if plan is None:
            plan = _default_plans[target] = _Plan(
                target,
                non_blocking="auto",
                dtype=None,
                copy=False,
                memory_format=None,
                strict=False,
            )
    else:
        key = (target, non_blocking, dtype, copy, memory_format, strict)
        plan = _plans.get(key)
        if plan is None:
            plan = _plans[key] = _Plan(
                target,
                non_blocking=non_blocking,
                dtype=dtype,
                copy=copy,
                memory_format=memory_format,
                strict=strict,
            )
    transfer = _Transfer(plan)
    if plan.packs and type(data) is not _Tensor:
        transfer.pack_small_tensors(data)
    moved = _walker.map(transfer.leaf_function(), data)
    moved_ids = transfer.moved_ids
    if len(moved_ids) > 1 and len(set(moved_ids)) < len(moved_ids):
        # The optimistic walk moved some tensor twice: walk again, through the memo.
        transfer = _Transfer(plan, remember=True)
        moved = _walker.map(transfer.leaf_function(), data)
    if transfer.wait_for:
        transfer.finish()
    return moved  # type: ignore[no-any-return]
