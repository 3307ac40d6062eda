"""How each leaf that is not a plain tensor moves: one function per :class:`Leaf` member.

The mover (:mod:`devicekit._core._transfer`) looks a leaf's :class:`Leaf` up in the table
(:mod:`devicekit._core._kinds`) and calls the function :data:`MOVES` holds for it, once per
object and call (the call's memo). Parameters are wrapped again, modules and optimizers
move in place (an optimizer's state follows its parameters), registered types by their
rule, objects with a ``.to()`` on a copy. A transformers cache (``past_key_values``) moves
in place, each layer through its own offloading API; a mapping that moves itself (a
TensorDict) moves every value it holds, so the values ``skip_keys`` names are put back
after its ``.to()``: each reached through the table like any other type, never by a
branch in the mover.
"""

from __future__ import annotations

import copy as copy_module
import itertools
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any, Final

import torch

from devicekit._base import META, LeafError, TransferError, listing, meta_fix
from devicekit._core import _tree
from devicekit._core._kinds import CAST, READ, Decision, Leaf, decide, leaf_how
from devicekit._core._nodes import (
    ATTRIBUTE,
    ITEM,
    SHOWN,
    Key,
    Node,
    is_cache_layer,
    mapping_items,
    state_on_host,
)

if TYPE_CHECKING:
    from devicekit._core._transfer import Call

__all__ = ["MOVES", "keep"]


def keep(obj: Any, strict: bool, *, array: bool) -> Any:
    """An object devicekit does not move: as it is, or refused where it must be."""
    if array and obj.dtype == object and any(isinstance(item, torch.Tensor) for item in obj.flat):
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


def _move_parameter(param: torch.nn.Parameter, call: Call, decision: Decision) -> Any:
    # Parameter.to returns a plain tensor: wrapped again, as nn.Module.to does.
    with torch.no_grad():
        data = call.tensor(param, call.plan.device)
    return param if data is param else torch.nn.Parameter(data, param.requires_grad)


def _in_place_only(obj: object, call: Call) -> None:
    if call.plan.options.copy:
        kind = "the module" if isinstance(obj, torch.nn.Module) else "the optimizer"
        msg = (
            f"Cannot copy {{path}}: {kind} {type(obj).__name__} moves in place, so copy=True "
            "cannot give a separate copy. Use copy.deepcopy on it first, then move the copy."
        )
        raise LeafError(msg)


def _move_module(module: torch.nn.Module, call: Call, decision: Decision) -> Any:
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
    msg = (
        f"Cannot move {{path}} to {device}: {len(meta)} of its tensors are on the meta "
        f"device ({listing(meta)}), and {META}: {meta_fix(device)}."
    )
    raise LeafError(msg)


def _move_optimizer(optimizer: torch.optim.Optimizer, call: Call, decision: Decision) -> Any:
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
    return call.tensor(leaf, device, dtype) if isinstance(leaf, torch.Tensor) else call.leaf(leaf)


def _move_by_rule(obj: Any, call: Call, decision: Decision) -> Any:
    # What the rule returns takes the object's place in the batch: an instance of the
    # class registered (a rule for Boxes may return a Boxes for a subclass's instance).
    cls, rule = decision.rule  # type: ignore[misc]  # a RULE has one
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


def _move_by_to(obj: Any, call: Call, decision: Decision) -> Any:
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
    told = {"non_blocking": True} if decision.takes_non_blocking and plan.told else {}
    moved = _checked(clone.to(plan.device, **told), obj, f"{name}.to()", expected=type(obj))
    if not plan.plain:
        # Tensors stay where the .to() left them (a PackedSequence's batch_sizes, on the
        # host); errors inside are named at the object's path, which the outer walk knows.
        moved = _tree.map_leaves(_restyle, moved, call, view=CAST, root=None)
    if call.skip is not None and isinstance(obj, Mapping):
        _keep_skipped(obj, moved, call.skip)
    return moved


def _restyle(obj: Any, call: Call) -> Any:
    if type(obj) is torch.Tensor:
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


def _move_cache(cache: Any, call: Call, decision: Decision) -> Any:
    """Move a transformers cache in place, layer by layer, leaving no tensor behind.

    A layer that knows its device is told the new one and moves there in its own
    ``prefetch()`` (its offloading API); what that leaves behind (a static layer's
    ``cumulative_length``, a sliding window's tensor, a hybrid layer's keys, quantized
    pairs, linear-attention states in dicts), whatever its name, is then moved where it
    is, attribute by attribute, as the checks see it. The layers of the caches it holds
    (an encoder-decoder's two) move too. Copies from an accelerator to the host under
    ``"auto"`` are waited for, as every other copy is.
    """
    options, device = call.plan.options, call.plan.device
    if options.copy or options.dtype is not None or options.memory_format is not None:
        asked = "copy=True" if options.copy else "dtype" if options.dtype else "memory_format"
        msg = (
            f"Cannot move {{path}} with {asked}: a transformers {type(cache).__name__} moves "
            "in place, each layer through its own prefetch(), which neither copies nor casts. "
            "Move it on its own, without the option (its tensors keep their dtype), or "
            "leave it out of the call with skip_keys."
        )
        raise LeafError(msg)
    for layer in _cache_layers(cache):
        state = getattr(layer, "__dict__", {})
        knows = [name for name, value in state.items() if isinstance(value, torch.device)]
        if knows:  # not initialised otherwise: it takes its device from its first keys
            for value in state.values():
                for leaf in _tree.flatten(value, view=READ).leaves:
                    if isinstance(leaf, torch.Tensor):
                        call.non_blocking(leaf, device)  # notes the wait prefetch's copies need
            for name in knows:
                setattr(layer, name, device)
            layer.prefetch()
        for name, value in list(state.items()):
            flat = _tree.flatten(value)
            leaves = flat.leaves.copy()
            for index in flat.active:
                leaves[index] = _in_layer(leaves[index], call)
            if any(new is not old for new, old in zip(leaves, flat.leaves, strict=True)):
                setattr(layer, name, _tree.unflatten(flat.spec, leaves))
                # The memo knows tensors by id: one it moved must outlive the call, or a
                # tensor made later (by the next layer's prefetch) could take its id.
                call.memo.setdefault(_OUTLIVING, []).append(value)
    return cache


_OUTLIVING: Final = object()
"""The memo's key for what a call replaced in place and keeps alive to its end."""


def _in_layer(leaf: Any, call: Call) -> Any:
    """A leaf of a cache layer, moved as it moves elsewhere; settings and helpers kept.

    A layer's other leaves (its quantizer, a class to build layers with) are no data:
    neither moved nor refused with ``strict=True``.
    """
    how = leaf_how(type(leaf)).leaf
    if how is Leaf.KEPT or how is Leaf.OTHER or how is Leaf.ARRAY:
        return leaf
    return call.leaf(leaf)


def _cache_layers(cache: Any) -> list[Any]:
    """The layers of a transformers cache, those of the caches it holds included."""

    def expand(value: Any) -> list[tuple[Key, Any]] | None:  # a cache's lists and caches
        if leaf_how(type(value)).leaf is not Leaf.CACHE:
            return None
        found = []
        for name, held in vars(value).items():
            if isinstance(held, list):
                found += [(Key(SHOWN, f".{name}[{i}]"), x) for i, x in enumerate(held)]
            elif leaf_how(type(held)).leaf is Leaf.CACHE:
                found.append((Key(ATTRIBUTE, name), held))
        return found

    return [
        value for _, value in _tree.walk(cache, expand=expand, seen={}) if is_cache_layer(value)
    ]


def _keep_skipped(original: Mapping[Any, Any], moved: Any, skip: frozenset[Hashable]) -> None:
    """Put back what ``skip_keys`` names in a mapping that moved itself (a TensorDict).

    Its own ``.to()`` moved everything it holds: the values under skipped keys, at any
    depth, are set back as they were. A TensorDict with a device would move them again,
    so it gives up its device first (``clear_device_()``), as one holding several
    devices has none.
    """

    def expand(value: Any) -> Any:  # the mappings inside, but not those under skipped keys
        if not isinstance(value, Mapping):
            return None
        return [(Key(ITEM, k), v) for k, v in mapping_items(value) if not _skipped(k, skip)]

    theirs: dict[int, Any] = {}  # id(path) -> the moved mapping there
    kept: list[_tree.Path] = []  # where something was put back, parents before children
    try:
        for path, mine in _tree.walk(original, expand=expand, root=_HERE):
            if not isinstance(mine, Mapping):
                continue
            there = theirs[id(path)] = theirs[id(path[0])][path[1].name] if path else moved
            for key, value in mapping_items(mine):
                if _skipped(key, skip):
                    _put_back(there, key, value, path)
                    kept.append(path)
    except TransferError as err:  # too deep: a template, whose path the outer walk knows
        raise LeafError(_escaped(str(err)).replace(_HERE, "{path}")) from None
    cleared: set[int] = set()
    for path in reversed(kept):  # children before their parents
        link: _tree.Path = path
        while id(link) not in cleared:
            cleared.add(id(link))
            there = theirs[id(link)]
            if getattr(there, "device", None) is not None and callable(
                getattr(there, "clear_device_", None)
            ):
                there.clear_device_()  # it holds values on several devices now
            if not link:
                break
            link = link[0]


_HERE: Final = "\x00"  # the outer walk's path, in a message made inside a leaf


def _skipped(key: Any, skip: frozenset[Hashable]) -> bool:
    return isinstance(key, Hashable) and key in skip


def _put_back(moved: Any, key: Any, value: Any, path: _tree.Path) -> None:
    moved[key] = value
    if moved[key] is not value and callable(getattr(moved, "clear_device_", None)):
        moved.clear_device_()
        moved[key] = value
    if moved[key] is not value:
        where = _escaped(_tree.format_path("", [*_tree.keys_of(path), Key(ITEM, key)]))
        msg = (
            f"Cannot keep {{path}}{where} as it is: the "
            f"{type(moved).__name__} moves every value set in it to its device. Move it out "
            "of the batch before to_device instead of naming it in skip_keys."
        )
        raise LeafError(msg)


def _escaped(text: str) -> str:
    """Text as a message template holds it: braces doubled for format()."""
    return text.replace("{", "{{").replace("}", "}}")


MOVES: Final[dict[Leaf, Callable[[Any, Call, Decision], Any]]] = {
    Leaf.PARAMETER: _move_parameter,
    Leaf.MODULE: _move_module,
    Leaf.OPTIMIZER: _move_optimizer,
    Leaf.RULE: _move_by_rule,
    Leaf.TO_METHOD: _move_by_to,
    Leaf.CACHE: _move_cache,
}
