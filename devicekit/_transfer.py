"""to_device: move tensors, modules, optimizers and nested batches to a device.

One call goes like this::

    options --(checked, cached per device and options)--> _Plan
    _Plan   --(per call: memo, devices to wait for)-----> _Call, and its mover
    data    --_tree.map_leaves(mover)-------------------> moved data          (host targets)
    data    --_tree.map_flat(mover, before=pack)--------> moved data          (accelerators)

The mover is the one function that moves a leaf, on every path: exact tensors in a few
lines, everything else as the table of per-type decisions (:mod:`devicekit._kinds`)
says. Accelerator targets take the flat route so that small host tensors can first
go packed (:mod:`devicekit._packing`); the mover then finds their pieces in its memo,
the same memo that makes a tensor found twice come back as one moved tensor and
calls a rule or a ``.to()`` once per object.
"""

from __future__ import annotations

import contextlib
import copy as copy_module
from collections.abc import Callable, Collection, Hashable, Iterator
from typing import Any, Final, Literal, NamedTuple, TypeAlias, TypeVar

import torch

from devicekit import _packing, _tree
from devicekit._devices import DeviceLike, resolve_device
from devicekit._errors import LeafError, TransferError
from devicekit._kinds import CAST, Leaf, Node, decide, leaf_how
from devicekit._manager import current_device

__all__ = ["NonBlocking", "as_accelerator", "to_device"]

T = TypeVar("T")

NonBlocking: TypeAlias = bool | Literal["auto"]
"""``"auto"``, True or False; see :func:`to_device`."""

# Devices whose copies are synchronous by nature, or move no data: no stream to wait on.
_HOST_DEVICE_TYPES = frozenset({"cpu", "meta"})
_Tensor = torch.Tensor  # one global lookup on the hot path instead of two
_is_compiling = torch.compiler.is_compiling  # likewise; torch.compile knows the function
_UNSEEN: Any = object()


class Options(NamedTuple):
    """to_device's options, each under its one name, as the user gave them."""

    non_blocking: NonBlocking = "auto"
    dtype: torch.dtype | None = None
    copy: bool = False
    memory_format: torch.memory_format | None = None
    strict: bool = False


_DEFAULTS: Final = Options()


def _check(options: Options) -> Options:
    """The options, checked; ``preserve_format`` is the same as no memory format."""
    # As objects: callers without a type checker pass anything.
    non_blocking: object = options.non_blocking
    dtype: object = options.dtype
    memory_format: object = options.memory_format
    copy: object = options.copy
    strict: object = options.strict
    for name, value in (("copy", copy), ("strict", strict)):
        if value is not True and value is not False:
            msg = f"Expected {name} to be True or False, got {value!r}."
            raise TypeError(msg)
    if not (
        non_blocking is True
        or non_blocking is False
        or (isinstance(non_blocking, str) and non_blocking == "auto")
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
    if memory_format is torch.preserve_format:
        return options._replace(memory_format=None)
    return options


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


class _Plan:
    """What a call's device and options imply, worked out once and cached.

    ``non_blocking`` has one rule, :meth:`_Call.non_blocking`; ``told`` is what objects
    that move themselves are told, since devicekit cannot wait for their copies:
    asynchronous only where reading the result is ordered after the copy anyway.
    """

    __slots__ = ("device", "move", "move_all", "options", "packs", "pins", "plain", "told")

    def __init__(self, device: torch.device, options: Options, *, traced: bool = False) -> None:
        simulated = device.type in _simulated_accelerators
        to_accelerator = device.type not in _HOST_DEVICE_TYPES or simulated
        auto = options.non_blocking == "auto"
        self.device = device
        self.options = options
        # Nothing but the device changes: "already there" is one comparison.
        self.plain = options.dtype is None and not options.copy and options.memory_format is None
        self.packs = (  # not in a compiled graph: its copies are the compiler's to plan
            not traced
            and to_accelerator
            and options.memory_format is None
            and (_packing.packs_to(device) or (simulated and _packing.can_pack))
        )
        self.pins = not simulated
        self.told = (
            (to_accelerator and device.type != "mps") if auto else bool(options.non_blocking)
        )
        self.move, self.move_all = _mover(self, is_meta=device.type == "meta" and not simulated)


_plans: dict[object, _Plan] = {}
_PLANS_KEPT = 256  # bounded: option values seen at run time must not pile up


def _plan(device: DeviceLike | None, options: Options) -> _Plan:
    if _is_compiling():
        return _Plan(_traced_device(device), _check(options), traced=True)
    defaults = options is _DEFAULTS
    # The usual call (every option at its default) is keyed by the device alone. A
    # torch.device found there is a target already resolved (an index checked to
    # exist); one without an index ("cuda": the current device) is resolved every call.
    plan = _plans.get(device) if defaults and type(device) is torch.device else None
    if plan is None:
        if not defaults:
            options = _check(options)
        target = current_device() if device is None else resolve_device(device)
        key = target if defaults else (target, options)
        plan = _plans.get(key)
        if plan is None:
            if len(_plans) >= _PLANS_KEPT:
                _plans.clear()
            plan = _plans[key] = _Plan(target, options)
    return plan


def _traced_device(device: DeviceLike | None) -> torch.device:
    """The target inside torch.compile, where a device given explicitly is taken as given."""
    if device is None:
        msg = (
            "Cannot move data inside torch.compile to the current device: devicekit reads "
            "it from its context (a DeviceManager block), which the compiler cannot follow. "
            "Pass the device explicitly, such as to_device(batch, 'cuda:0')."
        )
        raise TransferError(msg)
    return device if type(device) is torch.device else torch.device(device)


def _format_applies(memory_format: torch.memory_format | None, tensor: torch.Tensor) -> bool:
    # As nn.Module.to does: channels_last formats concern only 4-d (and 5-d) tensors,
    # so a batch's labels and masks pass untouched next to its images.
    if memory_format is torch.channels_last:
        return tensor.dim() == 4
    if memory_format is torch.channels_last_3d:
        return tensor.dim() == 5
    return memory_format is not None


Mover: TypeAlias = Callable[[Any, "_Call"], Any]
MoveAll: TypeAlias = Callable[[list[Any], list[int], "_Call"], list[Any]]


def _mover(plan: _Plan, *, is_meta: bool) -> tuple[Mover, MoveAll]:
    """The plan's mover: ``move(leaf, call)``, the one function that moves a leaf.

    Built once per plan: a closure whose hot path (a tensor whose device alone changes)
    reads the plan's constants as locals; what one call keeps is in ``call``. It comes
    with ``move_all(leaves, active, call)``, the leaves with ``move`` applied at the
    places ``active`` (tests/test_to_device.py holds the two equal), which for an
    accelerator first packs the small tensors where that pays, and copies distinct
    plain tensors in one comprehension: a call per tensor is a tenth of a small copy's
    host time.
    """
    device, asynchronous = plan.device, plan.told
    if not plan.plain:

        def move_with_options(obj: Any, call: _Call) -> Any:
            return call.tensor(obj, device) if type(obj) is _Tensor else call.leaf(obj)

        return move_with_options, _packing_first(_one_by_one(move_with_options), plan)
    is_cpu = device.type == "cpu"
    host = is_cpu or is_meta
    # A copy needs a wait only from an accelerator to the host under "auto".
    waitless = asynchronous or is_meta or plan.options.non_blocking != "auto"

    def move(obj: Any, call: _Call) -> Any:
        if type(obj) is not _Tensor:
            return call.leaf(obj)
        if host:
            # Already there: one flag read (obj.device builds a torch.device).
            if obj.is_cpu if is_cpu else obj.is_meta:
                return obj
            if not waitless:
                return call.tensor(obj, device)
        notes = call.notes
        if notes is not None:  # see _Call
            if notes is _REMEMBER:
                return call.tensor(obj, device)
            notes.append(id(obj))
        try:
            # A tensor already on the target comes back from .to() as it is. Keyword
            # arguments cost PyTorch more to parse than a small copy to meta takes:
            # non_blocking is passed only when it is True.
            return obj.to(device, non_blocking=True) if asynchronous else obj.to(device)
        except NotImplementedError:
            if obj.is_meta:
                raise call.meta_error() from None
            raise

    move_each = _one_by_one(move)
    if host:
        return move, move_each

    def move_all(leaves: list[Any], active: list[int], call: _Call) -> list[Any]:
        # Every leaf that is not inert an exact tensor, none twice: one comprehension.
        # The checks run from C; an inert leaf is never a tensor.
        if call.notes is _REMEMBER:
            return move_each(leaves, active, call)
        if len(active) == len(leaves):  # leaves only: a list of tensors, a flat dict
            tensors = leaves
            if set(map(type, leaves)) != _JUST_TENSORS:
                return move_each(leaves, active, call)
        else:
            tensors = [leaf for leaf in leaves if type(leaf) is _Tensor]
            if len(tensors) != len(active):
                return move_each(leaves, active, call)
        if len(set(map(id, tensors))) < len(tensors):
            call.notes = _REMEMBER  # one tensor twice: through the memo
            return move_each(leaves, active, call)
        try:
            if tensors is leaves:
                if asynchronous:
                    return [leaf.to(device, non_blocking=True) for leaf in leaves]
                return [leaf.to(device) for leaf in leaves]
            if asynchronous:
                return [
                    leaf.to(device, non_blocking=True) if type(leaf) is _Tensor else leaf
                    for leaf in leaves
                ]
            return [leaf.to(device) if type(leaf) is _Tensor else leaf for leaf in leaves]
        except NotImplementedError:  # a meta tensor: its error comes from move
            return move_each(leaves, active, call)

    return move, _packing_first(move_all, plan)


def _one_by_one(move: Mover) -> MoveAll:
    def move_each(leaves: list[Any], active: list[int], call: _Call) -> list[Any]:
        moved = leaves.copy()
        for index in active:
            moved[index] = move(leaves[index], call)
        return moved

    return move_each


def _packing_first(move_all: MoveAll, plan: _Plan) -> MoveAll:
    """``move_all``, after the small host tensors among the leaves went packed.

    Where the plan packs, and packing pays for them (see :mod:`devicekit._packing`).
    """
    if not plan.packs:
        return move_all

    def packing_first(leaves: list[Any], active: list[int], call: _Call) -> list[Any]:
        packed = _pack(leaves, active, call) if len(active) >= _packing.MIN_TENSORS else None
        if not packed:
            return move_all(leaves, active, call)
        if len(packed) == len(active):  # every leaf moved, each once: placed from C
            if len(active) == len(leaves):
                return list(map(packed.__getitem__, map(id, leaves)))
            moved = leaves.copy()
            for index in active:
                moved[index] = packed[id(leaves[index])]
            return moved
        rest = [index for index in active if id(leaves[index]) not in packed]
        moved = move_all(leaves, rest, call)
        for index in active:
            piece = packed.get(id(leaves[index]))
            if piece is not None:
                moved[index] = piece
        return moved

    return packing_first


_JUST_TENSORS: Final = {torch.Tensor}


_REMEMBER: Final[list[int]] = []
"""``_Call.notes`` of a call that moves tensors through its memo: they repeat."""


class _Call:
    """What one to_device call keeps: its memo, and the devices whose copies to wait for.

    Aliasing, one rule: a tensor found twice comes back as one moved tensor. A memo
    write per tensor would cost a fifth of a small copy, so tensors go through the
    memo only in a call whose tensors repeat (which is rare), and ``notes`` says how
    the call knows:

    * a list: the mover notes the id of each tensor it copies, and a call whose notes
      repeat an id is made again, remembering (the host path, in one pass);
    * ``_REMEMBER``: every tensor goes through the memo; the accelerator path, which
      lists the leaves before moving them, asks so at once where tensors repeat;
    * None: they are known not to repeat.

    Objects moved by a rule, a ``.to()`` or in place always go through the memo (their
    moves must never run twice), and so do tensors moved with options.
    """

    __slots__ = ("memo", "notes", "plan", "waits")

    def __init__(
        self, plan: _Plan, notes: list[int] | None, memo: dict[int, Any] | None = None
    ) -> None:
        self.plan = plan
        self.notes = notes
        self.memo: dict[int, Any] = {} if memo is None else memo  # id -> what it became
        self.waits: set[torch.device] | None = None

    def tensor(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """One tensor to ``device`` with the call's options, or as it is if nothing changes."""
        moved: torch.Tensor | None = self.memo.get(id(tensor))
        if moved is not None:
            return moved
        options = self.plan.options
        if tensor.is_meta and device.type != "meta":
            raise self.meta_error()
        dtype = options.dtype if options.dtype is not None and tensor.is_floating_point() else None
        memory_format = options.memory_format
        if not _format_applies(memory_format, tensor):
            memory_format = None
        if (
            not options.copy
            and tensor.device == device
            and (dtype is None or tensor.dtype == dtype)
            and (memory_format is None or tensor.is_contiguous(memory_format=memory_format))
        ):
            return tensor
        moved = self.memo[id(tensor)] = tensor.to(
            device,
            dtype=dtype,
            non_blocking=self.non_blocking(tensor, device),
            copy=options.copy,
            memory_format=memory_format or torch.preserve_format,
        )
        return moved

    def non_blocking(self, tensor: torch.Tensor, device: torch.device) -> bool:
        """Whether a tensor's copy is asynchronous: the one rule for ``non_blocking``.

        Under ``"auto"``, copies to an accelerator are asynchronous; copies from one to
        the host, and MPS copies, are asynchronous too and waited for once, before
        to_device returns.
        """
        non_blocking = self.plan.options.non_blocking
        if non_blocking != "auto":
            return bool(non_blocking)
        if device.type in _HOST_DEVICE_TYPES and device.type not in _simulated_accelerators:
            if tensor.is_cpu or tensor.is_meta:
                return False  # host to host: nothing to overlap
            waits_on = tensor.device
        elif device.type == "mps":
            waits_on = device
        else:
            return True
        if _is_compiling():
            return False  # a graph holds no event to wait on: the same values, blocking
        if self.waits is None:
            self.waits = set()
        self.waits.add(waits_on)
        return True

    def leaf(self, obj: Any) -> Any:
        """Move a leaf that is not an exact tensor, as the table says its type moves."""
        how, detail = leaf_how(type(obj))
        if how is Leaf.KEPT:
            return obj
        if how is Leaf.TENSOR:
            return self.tensor(obj, self.plan.device)
        if how is Leaf.OTHER or how is Leaf.ARRAY:
            return _keep(obj, self.plan.options.strict, array=how is Leaf.ARRAY)
        if how is None:  # never: containers and inert types are not leaves
            return obj
        if _is_compiling() and how is not Leaf.PARAMETER:
            raise _untraced(obj, how)
        moved = self.memo.get(id(obj), _UNSEEN)
        if moved is _UNSEEN:  # user code, or in-place moves: once per object
            moved = self.memo[id(obj)] = _MOVES[how](obj, self, detail)
        return moved

    def meta_error(self) -> LeafError:
        """The error for a meta tensor asked onto a device with data."""
        msg = (
            f"Cannot move {{path}} to {self.plan.device}: it is a tensor on the meta device, "
            "which has a shape but no data. Create it on a real device instead, for "
            "example with torch.empty_like(tensor, device=...) or module.to_empty(device=...)."
        )
        return LeafError(msg)

    def finish(self) -> None:
        """Wait once per source device for the asynchronous copies that need it."""
        for device in self.waits or ():
            event = torch.Event(device=device)
            event.record(torch.accelerator.current_stream(device))
            event.synchronize()


def _pack(leaves: list[Any], active: list[int], call: _Call) -> dict[int, torch.Tensor]:
    """The small host tensors among ``leaves`` sent packed, where that pays, by id."""
    tensors = list({id(leaf): leaf for leaf in leaves if type(leaf) is _Tensor}.values())
    if not _packing.might_pay(tensors):
        return {}
    plan = call.plan
    return _packing.pack(
        tensors,
        plan.device,
        non_blocking=plan.options.non_blocking is not False,
        dtype=plan.options.dtype,
        pin=plan.pins,
    )


def _restyle(obj: Any, call: _Call) -> Any:
    """Apply dtype, memory_format and copy to a leaf where it is (the CAST view).

    Tensors stay on their device: what a ``.to()`` left on the host stays there (a
    PackedSequence's ``batch_sizes``).
    """
    if type(obj) is _Tensor:
        return call.tensor(obj, obj.device)
    if isinstance(obj, torch.Tensor | torch.nn.Module):
        return call.leaf(obj)
    return obj


# How leaves that are neither exact tensors nor kept move: one function per Leaf member.


def _keep(obj: Any, strict: bool, *, array: bool) -> Any:
    if array and obj.dtype == object and any(isinstance(item, _Tensor) for item in obj.flat):
        # An array of objects may hold tensors, which no rule can reach inside it.
        msg = (
            "Cannot move {path}: it is a numpy array of objects holding tensors, which "
            "devicekit cannot move inside it. Make it a list (array.tolist()), or register "
            "how to move it with @devicekit.register_transfer(numpy.ndarray)."
        )
        raise LeafError(msg)
    if not strict:
        return obj
    name = f"{type(obj).__module__}.{type(obj).__name__}"
    msg = (
        f"Cannot move {{path}}: it is a {name}, which is neither a tensor, a container, a type "
        "with a .to() method, a registered type, nor a plain scalar. Register how to move it "
        f"with @devicekit.register_transfer({type(obj).__name__}), or pass strict=False "
        "to leave such objects as they are."
    )
    raise LeafError(msg)


def _untraced(obj: Any, how: Leaf) -> LeafError:
    name = type(obj).__name__
    what = {
        Leaf.MODULE: "in place, as nn.Module.to moves it",
        Leaf.OPTIMIZER: "in place, with its state",
        Leaf.RULE: "the rule registered for it",
        Leaf.TO_METHOD: f"{name}.to()",
    }.get(how, "as it is")
    msg = (
        f"Cannot move {{path}} inside torch.compile: a {name} moves {what}, which a compiled "
        "graph cannot repeat as devicekit does outside it. Move it before the compiled region."
    )
    return LeafError(msg)


def _move_parameter(param: torch.nn.Parameter, call: _Call, detail: object) -> Any:
    """A Parameter comes back a Parameter, as nn.Module.to makes it.

    Its own .to() returns a plain tensor; the moved data is wrapped again, with the
    same requires_grad.
    """
    with torch.no_grad():
        data = call.tensor(param, call.plan.device)
    return param if data is param else torch.nn.Parameter(data, param.requires_grad)


def _in_place_only(obj: object) -> LeafError:
    kind = "the module" if isinstance(obj, torch.nn.Module) else "the optimizer"
    msg = (
        f"Cannot copy {{path}}: {kind} {type(obj).__name__} moves in place, so copy=True "
        "cannot give a separate copy. Use copy.deepcopy on it first, then move the copy."
    )
    return LeafError(msg)


def _move_module(module: torch.nn.Module, call: _Call, detail: object) -> Any:
    options = call.plan.options
    if options.copy:
        raise _in_place_only(module)
    asked: dict[str, Any] = {"dtype": options.dtype, "memory_format": options.memory_format}
    asked = {name: value for name, value in asked.items() if value is not None}
    return module.to(call.plan.device, non_blocking=call.plan.told, **asked)


def _move_optimizer(optimizer: torch.optim.Optimizer, call: _Call, detail: object) -> Any:
    device = call.plan.device
    if call.plan.options.copy:
        raise _in_place_only(optimizer)
    # The state follows the parameters it belongs to; the parameters are the model's and
    # move with it, so parameters elsewhere mean the model was not moved first.
    for group_index, group in enumerate(optimizer.param_groups):
        for param_index, param in enumerate(group["params"]):
            if param.device != device:
                where = f"param_groups[{group_index}]['params'][{param_index}]"
                msg = (
                    f"Cannot move {{path}} (an optimizer) to {device}: its state follows its "
                    f"parameters, and {where} is on {param.device}. Move the model first "
                    "(to_device(model, device)): the optimizer holds the model's own "
                    "parameters. Where the model was moved already, PyTorch replaced its "
                    "parameters instead of moving them in place (it does so for some device "
                    "pairs, such as to meta): create the optimizer after moving the model."
                )
                raise LeafError(msg)
    for group in optimizer.param_groups:
        # PyTorch keeps "step" on the host unless the optimizer is capturable or fused,
        # as Optimizer.load_state_dict does; every other entry takes its parameter's
        # device, and its dtype where the parameter is floating-point.
        step_stays = not (group.get("capturable") or group.get("fused"))
        for param in group["params"]:
            state = optimizer.state.get(param)
            if state is not None:
                optimizer.state[param] = _state_to(state, param, step_stays, call)
    return optimizer


def _state_to(state: Any, param: torch.Tensor, step_stays: bool, call: _Call) -> Any:
    """One parameter's state on its parameter's device: a dict, a dataclass, or a tensor."""
    non_blocking = call.plan.options.non_blocking
    dtype = param.dtype if param.is_floating_point() else None
    node = decide(type(state)).move
    if not isinstance(node, Node):
        return to_device(state, param.device, non_blocking=non_blocking, dtype=dtype)
    moved = [
        value
        if key in ("['step']", ".step") and step_stays
        else to_device(value, param.device, non_blocking=non_blocking, dtype=dtype)
        for key, value in zip(node.keys(state), node.children(state), strict=True)
    ]
    return node.rebuild(state, moved)


def _move_by_rule(obj: Any, call: _Call, rule: Any) -> Any:
    options = call.plan.options
    result = rule(
        obj,
        call.plan.device,
        non_blocking=call.plan.told,
        dtype=options.dtype,
        copy=options.copy,
        memory_format=options.memory_format or torch.preserve_format,
    )
    return _checked(result, obj, f"the rule registered for {type(obj).__name__}", same_type=False)


def _move_by_to(obj: Any, call: _Call, takes_non_blocking: bool) -> Any:
    """Move an object with its own ``.to()``, on a copy, then apply the other options.

    The copy keeps an in-place ``.to()`` (torch_geometric's) off the input. The
    options such a ``.to()`` would apply to every tensor it holds (a dtype cast of
    token ids) are applied here instead, where they belong, through its contents.
    """
    name = type(obj).__name__
    try:
        clone = copy_module.copy(obj)
    except Exception as err:
        msg = (
            f"Cannot move {{path}}: devicekit calls {name}.to() on a shallow copy, so that "
            f"the input never changes, and copy.copy failed on the {name} there ({err}). "
            f"Register how to move it with @devicekit.register_transfer({name})."
        )
        raise LeafError(msg) from err
    plan = call.plan
    if takes_non_blocking and plan.told:
        moved = clone.to(plan.device, non_blocking=True)
    else:
        moved = clone.to(plan.device)
    moved = _checked(moved, obj, f"{name}.to()", same_type=True)
    if not plan.plain:
        # Errors inside are named at the object's path, which the outer walk knows.
        moved = _tree.map_leaves(_restyle, moved, call, view=CAST, root=None)
    return moved


def _checked(result: Any, obj: Any, how: str, *, same_type: bool) -> Any:
    name = type(obj).__name__
    if result is None:
        msg = (
            f"Cannot move {{path}}: {how} returned None for the {name} there; expected the "
            "moved object. A method that moves in place must return self."
        )
        raise LeafError(msg)
    if same_type and not isinstance(result, type(obj)):
        msg = (
            f"Cannot move {{path}}: {how} returned a {type(result).__name__} for the {name} "
            f"there, not a {name}: its .to() does not move it to a device. Register how to "
            f"move it with @devicekit.register_transfer({name})."
        )
        raise LeafError(msg)
    return result


_MOVES: dict[Leaf, Callable[[Any, _Call, Any], Any]] = {
    Leaf.PARAMETER: _move_parameter,
    Leaf.MODULE: _move_module,
    Leaf.OPTIMIZER: _move_optimizer,
    Leaf.RULE: _move_by_rule,
    Leaf.TO_METHOD: _move_by_to,
}


def _walk(data: Any, call: _Call, skip: frozenset[Hashable] | None) -> Any:
    """The one crossing into the engine: the accelerator path lists the leaves first."""
    plan = call.plan
    if plan.packs:
        return _tree.map_flat(plan.move_all, data, call, skip=skip)
    return _tree.map_leaves(plan.move, data, call, skip=skip)


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
            Objects with a ``.to()`` method move with it, on a shallow copy; types
            registered with :func:`register_transfer` move with their rule; other
            leaves (numbers, strings, arrays) are returned unchanged.
        device: The target: a :class:`torch.device`, a string such as ``"cuda:1"``, an
            accelerator index, or None for :func:`~devicekit.current_device`.
        non_blocking: ``"auto"`` copies host->device asynchronously (pinned sources
            overlap with compute), and issues device->host and MPS copies asynchronously
            but waits for them once before returning, so whatever comes back is safe to
            read. True and False apply to every copy as in :meth:`torch.Tensor.to`.
        dtype: A floating-point dtype to cast floating-point tensors to, inside objects
            that move with their own ``.to()`` too; integer and boolean tensors keep theirs.
        copy: Return new tensors even where they are already on the target.
        memory_format: A :class:`torch.memory_format`; ``torch.channels_last`` applies
            to 4-d tensors and ``torch.channels_last_3d`` to 5-d ones, as in
            :meth:`torch.nn.Module.to`.
        strict: Raise on leaves that cannot be moved and are not plain scalars,
            instead of returning them unchanged.
        skip_keys: Keys whose values, in any mapping at any depth, stay where they are
            (the same objects), as accelerate's ``send_to_device`` has it: a batch's
            ``"raw_text"`` or a host-side index, say. One key may be given alone.

    Returns:
        The data on ``device``, with the same structure.

    Raises:
        TransferError: Something in the data cannot be moved (a meta tensor to a real
            device, a reference cycle, a ``.to()`` that returned None, an unmovable leaf
            with ``strict=True``); the message names its path, such as ``data['x'][2]``.
        DeviceUnavailableError: ``device`` does not parse or is not on this machine.
        ValueError: An option has a value outside those listed above.
        TypeError: ``copy``, ``strict`` or ``skip_keys`` has a value of the wrong type.
    """
    options = (
        _DEFAULTS
        # Identity, not truth: copy="False" and strict="no" are mistakes to report, not
        # values to read as True.
        if (non_blocking == "auto") is True  # an array compares element by element
        and dtype is None
        and memory_format is None
        and copy is False
        and strict is False
        else Options(non_blocking, dtype, copy, memory_format, strict)
    )
    skip = None if type(skip_keys) is tuple and not skip_keys else _tree.skip_set(skip_keys)
    plan = _plan(device, options)
    call = _Call(plan, [])
    moved = _walk(data, call, skip)
    notes = call.notes
    if notes and len(set(notes)) < len(notes):  # a tensor found twice (see _Call)
        call = _Call(plan, _REMEMBER, call.memo)
        moved = _walk(data, call, skip)
    if call.waits:
        call.finish()
    return moved  # type: ignore[no-any-return]
