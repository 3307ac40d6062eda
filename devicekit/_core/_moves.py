"""How each leaf that is not a plain tensor moves: one function per :class:`Leaf` member.

The mover (:mod:`devicekit._core._transfer`) looks a leaf's :class:`Leaf` up in the table
(:mod:`devicekit._core._kinds`) and calls the function :data:`MOVES` holds for it, once per
object and call (the call's memo). Parameters are wrapped again, modules and optimizers
move in place (an optimizer's state follows its parameters), registered types by their
rule, objects with a ``.to()`` on a copy; other libraries' objects that need more than
these rules have their moves in :mod:`devicekit._core._library_moves`.
"""

from __future__ import annotations

import copy as copy_module
import itertools
from collections.abc import Callable, Mapping
from typing import Any, Final

import torch

from devicekit._base import LeafError
from devicekit._core import _tree
from devicekit._core._kinds import CAST, Leaf, decide
from devicekit._core._library_moves import CallView, keep_skipped, move_cache
from devicekit._core._nodes import Node, state_on_host

__all__ = ["MOVES", "keep"]

_Tensor = torch.Tensor


def keep(obj: Any, strict: bool, *, array: bool) -> Any:
    """An object devicekit does not move: as it is, or refused where it must be."""
    if array and obj.dtype == object and any(isinstance(item, _Tensor) for item in obj.flat):
        msg = (
            "Cannot move {path}: it is a numpy array of objects holding tensors, which "
            "devicekit cannot move inside it. Make it a list (array.tolist()), or register "
            "how to move it with @devicekit.register_transfer(numpy.ndarray)."
        )
        raise LeafError(msg)
    if not strict:
        return obj
    msg = (
        f"Cannot move {{path}}: it is a {type(obj).__module__}.{type(obj).__name__}, which is "
        "neither a tensor, a container, a type with a .to() method, a registered type, nor "
        f"a plain scalar. Register how to move it with @devicekit.register_transfer("
        f"{type(obj).__name__}), or pass strict=False to leave such objects as they are."
    )
    raise LeafError(msg)


def _move_parameter(param: torch.nn.Parameter, call: CallView, detail: object) -> Any:
    # Parameter.to returns a plain tensor: wrapped again, as nn.Module.to does.
    with torch.no_grad():
        data = call.tensor(param, call.plan.device)
    return param if data is param else torch.nn.Parameter(data, param.requires_grad)


def _in_place_only(obj: object, call: CallView) -> None:
    if call.plan.options.copy:
        kind = "the module" if isinstance(obj, torch.nn.Module) else "the optimizer"
        msg = (
            f"Cannot copy {{path}}: {kind} {type(obj).__name__} moves in place, so copy=True "
            "cannot give a separate copy. Use copy.deepcopy on it first, then move the copy."
        )
        raise LeafError(msg)


def _move_module(module: torch.nn.Module, call: CallView, detail: object) -> Any:
    _in_place_only(module, call)
    if call.plan.device.type != "meta":
        _refuse_meta(module, call.plan.device)
    options = call.plan.options
    asked: dict[str, Any] = {"dtype": options.dtype, "memory_format": options.memory_format}
    asked = {name: value for name, value in asked.items() if value is not None}
    return module.to(call.plan.device, non_blocking=call.plan.told, **asked)


def _refuse_meta(module: torch.nn.Module, device: torch.device) -> None:
    """Refuse a module holding meta tensors before ``.to()`` moves half of it and fails."""
    tensors = itertools.chain(module.named_parameters(), module.named_buffers())
    meta = [name for name, tensor in tensors if tensor.is_meta]
    if not meta:
        return
    named = ", ".join(meta[:5]) + (f" and {len(meta) - 5} more" if len(meta) > 5 else "")
    msg = (
        f"Cannot move {{path}} to {device}: {len(meta)} of its tensors are on the meta "
        f"device, which has shapes but no data ({named}). Give them storage and "
        f"initialise them with dk.materialize(module, {str(device)!r}), which names "
        "whatever no initialiser writes."
    )
    raise LeafError(msg)


def _move_optimizer(optimizer: torch.optim.Optimizer, call: CallView, detail: object) -> Any:
    """Move an optimizer's state, in place, within the call: one memo, one wait."""
    _in_place_only(optimizer, call)
    device = call.plan.device
    # The state follows its parameters, the model's: moved first, unless PyTorch
    # replaced them instead of moving them in place (it does so for some device pairs).
    for number, group in enumerate(optimizer.param_groups):
        for index, param in enumerate(group["params"]):
            if param.device != device:
                msg = (
                    f"Cannot move {{path}} (an optimizer) to {device}: its state follows its "
                    f"parameters, and param_groups[{number}]['params'][{index}] is on "
                    f"{param.device}. Move the model first (to_device(model, device)): the "
                    "optimizer holds the model's own parameters. Where the model was moved "
                    "already, PyTorch replaced its parameters instead of moving them in place "
                    "(it does so for some device pairs, such as to meta): create the "
                    "optimizer after moving the model."
                )
                raise LeafError(msg)
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if state is not None:
                # Each value takes its parameter's device, and its dtype where that is
                # floating-point, as Optimizer.load_state_dict has it.
                target = (call, param.device, param.dtype if param.is_floating_point() else None)
                optimizer.state[param] = _moved_state(state, group, target)
    return optimizer


def _moved_state(state: Any, group: Mapping[str, Any], target: tuple[Any, ...]) -> Any:
    """One parameter's state, its values moved to ``target``, what stays on the host kept."""
    node = decide(type(state)).move
    if not isinstance(node, Node):
        return _tree.map_leaves(_to_parameter, state, target, root=None)
    moved = [
        value
        if key.readable and state_on_host(group, key.name)
        else _tree.map_leaves(_to_parameter, value, target, root=None)
        for key, value in zip(node.keys(state), node.children(state), strict=True)
    ]
    return node.rebuild(state, moved)


def _to_parameter(leaf: Any, target: tuple[Any, ...]) -> Any:
    call, device, dtype = target
    return call.tensor(leaf, device, dtype) if isinstance(leaf, _Tensor) else call.leaf(leaf)


def _move_by_rule(obj: Any, call: CallView, registered: tuple[type, Any]) -> Any:
    # What the rule returns takes the object's place in the batch: an instance of the
    # class registered (a rule for Boxes may return a Boxes for a subclass's instance).
    cls, rule = registered
    options = call.plan.options
    result = rule(
        obj,
        call.plan.device,
        non_blocking=call.plan.told,
        dtype=options.dtype,
        copy=options.copy,
        memory_format=options.memory_format or torch.preserve_format,
    )
    return _checked(result, obj, f"the rule registered for {cls.__name__}", expected=cls)


def _move_by_to(obj: Any, call: CallView, takes_non_blocking: bool) -> Any:
    """Move an object with its own ``.to()``, on a copy; the options go to its contents.

    The copy keeps an in-place ``.to()`` (torch_geometric's) off the input; what a
    ``.to()`` would apply to every tensor it holds (a cast of token ids) is applied
    through the CAST view, where it belongs.
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
    told = {"non_blocking": True} if takes_non_blocking and plan.told else {}
    moved = _checked(clone.to(plan.device, **told), obj, f"{name}.to()", expected=type(obj))
    if not plan.plain:
        # Tensors stay where the .to() left them (a PackedSequence's batch_sizes, on the
        # host); errors inside are named at the object's path, which the outer walk knows.
        moved = _tree.map_leaves(_restyle, moved, call, view=CAST, root=None)
    if call.skip is not None and isinstance(obj, Mapping):
        keep_skipped(obj, moved, call.skip)
    return moved


def _restyle(obj: Any, call: CallView) -> Any:
    if type(obj) is _Tensor:
        return call.tensor(obj, obj.device)
    return call.leaf(obj) if isinstance(obj, torch.Tensor | torch.nn.Module) else obj


def _checked(result: Any, obj: Any, how: str, *, expected: type) -> Any:
    name = type(obj).__name__
    if result is None:
        msg = (
            f"Cannot move {{path}}: {how} returned None for the {name} there; expected the "
            "moved object. A method that moves in place must return self."
        )
        raise LeafError(msg)
    if not isinstance(result, expected):
        msg = (
            f"Cannot move {{path}}: {how} returned a {type(result).__name__} for the {name} "
            f"there, not a {expected.__name__}, so it is not the moved object. Register how "
            f"to move it with @devicekit.register_transfer({name}), returning a "
            f"{expected.__name__}."
        )
        raise LeafError(msg)
    return result


MOVES: Final[dict[Leaf, Callable[[Any, CallView, Any], Any]]] = {
    Leaf.PARAMETER: _move_parameter,
    Leaf.MODULE: _move_module,
    Leaf.OPTIMIZER: _move_optimizer,
    Leaf.RULE: _move_by_rule,
    Leaf.TO_METHOD: _move_by_to,
    Leaf.CACHE: move_cache,
}
