"""Device checks that speak of the user's data: where every tensor is, and which disagree.

``find_devices`` and ``check_same_device`` walk data with the one traversal engine,
reaching into modules (their parameters and buffers, by qualified name) and optimizers
(their parameters and state) as well as containers; ``find_unmoved`` names what a
module holds that ``Module.to()`` leaves behind. Every tensor is named as the user
wrote it (:func:`devicekit._core.tensor_paths`), a forward's inputs by its own parameter names
(:func:`input_names`): the naming that :mod:`devicekit._checks._guard` and its explanation of
a failed forward (:mod:`devicekit._checks._forward_error`) speak in too.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from typing import Any

import torch

from devicekit._base import (
    META,
    DeviceLike,
    DeviceMismatchError,
    listing,
    mesh_of,
    meta_fix,
    resolve_device,
    shown,
)
from devicekit._core import leaf_how, strays, tensor_paths

__all__ = [
    "check_same_device",
    "describe_devices",
    "find_devices",
    "find_unmoved",
    "input_names",
    "split_model",
    "tensors_of",
]


def find_unmoved(module: torch.nn.Module, /) -> dict[str, torch.device]:
    """The tensors a module tree holds that ``Module.to()`` will not move, with their devices.

    A plain tensor attribute (``self.scale = torch.ones(3)``), the tensors of a
    ``torch.distributions`` object built in ``__init__``, a list or dict of tensors, a
    module kept in a plain list, a second name for a buffer: ``model.to("cuda")`` leaves
    each where it was, and the forward then fails deep inside PyTorch. They are named as
    you write them, submodules' by their qualified names; registered parameters, buffers
    and submodules, which move, are never listed. A clean model gives an empty dict.

    >>> import torch, devicekit as dk
    >>> class Scaled(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.linear = torch.nn.Linear(3, 3)
    ...         self.scale = torch.ones(3)  # a plain attribute: left behind
    ...         self.prior = torch.distributions.Normal(torch.zeros(3), torch.ones(3))
    >>> for path, device in dk.find_unmoved(dk.to_device(Scaled(), "meta")).items():
    ...     print(path, device)
    scale cpu
    prior.loc cpu
    prior.scale cpu
    >>> dk.find_unmoved(torch.nn.Linear(3, 3))
    {}

    The fix: ``self.register_buffer("scale", torch.ones(3), persistent=False)`` for an
    attribute; for a distribution, buffers for its tensors and the distribution built in
    ``forward()``; ``torch.nn.ModuleList`` for modules in a list.

    Args:
        module: The root of the module tree.

    Returns:
        Each such tensor's path, with its device, in the order the walk meets them.

    Raises:
        TypeError: ``module`` is not a :class:`torch.nn.Module`.
        TransferError: An attribute nests containers deeper than
            :func:`~devicekit.to_device` takes; the message names the path.
    """
    if not isinstance(module, torch.nn.Module):  # for untyped callers
        msg = (  # type: ignore[unreachable]
            "Expected a torch.nn.Module to look through, got "
            f"{type(module).__name__} {shown(module)}."
        )
        raise TypeError(msg)
    found = strays(module, root=type(module).__name__)
    return {stray.path: stray.tensor.device for stray in found}


def find_devices(data: Any, /) -> dict[torch.device, list[str]]:
    """Every device the data's tensors are on, with the paths of the tensors there.

    Sees every tensor :func:`~devicekit.to_device` moves, named as you write them:
    inside containers, modules (``fc.weight``), optimizers
    (``param_groups[0]['params'][1]``, ``state[...]['exp_avg']``; not a ``step`` that
    PyTorch keeps on the host on purpose), and objects that move themselves (a
    PackedSequence's ``.data``, a torch_geometric graph's ``.x``).

    >>> import torch, devicekit as dk
    >>> batch = {"image": torch.zeros(2, device="meta"), "labels": [torch.ones(1), 3]}
    >>> dk.find_devices(batch)
    {device(type='meta'): ["['image']"], device(type='cpu'): ["['labels'][0]"]}
    >>> dk.find_devices(torch.nn.Linear(2, 2))
    {device(type='cpu'): ['weight', 'bias']}

    Args:
        data: Tensors, modules, optimizers, and containers of them.

    Returns:
        Devices in the order first met, each with its tensors' paths in walk order.

    Raises:
        TransferError: The data holds a cycle (outside a module's attributes, which are
            walked once), or nests containers deeper than :func:`~devicekit.to_device`
            takes; the message names the path.
    """
    found: dict[torch.device, list[str]] = {}
    for path, tensor in tensor_paths(data, ""):
        found.setdefault(tensor.device, []).append(path)
    return found


def describe_devices(found: dict[torch.device, list[str]]) -> str:
    """``cuda:0 has a and b; cpu has c, d, e and 4 more`` for a message."""
    return "; ".join(f"{device} has {listing(where)}" for device, where in found.items())


def _parts(module: torch.nn.Module, name: str) -> Iterator[tuple[str, torch.device]]:
    """The parts of a module, each wholly on one device: a submodule, else a tensor of its own.

    A module all on one device is one part, named as the user knows it (``Net.head``);
    one split across devices gives its own parameters and buffers, then its children's
    parts, in order. A module holding no tensor is no part. Walked with a stack, not by
    recursion: a model may nest deeper than Python recurses.
    """
    stack = [(module, name)]
    while stack:
        module, name = stack.pop()
        devices = {tensor.device for _, tensor in tensors_of(module, own=False)}
        if len(devices) == 1:
            yield name, devices.pop()
        elif devices:
            for key, tensor in tensors_of(module, own=True):
                yield f"{name}.{key}", tensor.device
            children = [(child, f"{name}.{key}") for key, child in module.named_children()]
            stack += reversed(children)  # the first child is taken next


def split_model(
    module: torch.nn.Module, label: str, near: torch.device | None = None
) -> tuple[str, str, dict[torch.device, list[str]]] | None:
    """Where a module's tensors are on several devices: the split, its fix, and where.

    The device to move it to is the one holding most of its elements (a layer's weight
    outweighs a few norm layers): of equals, ``near`` (the inputs') where it is one, else
    the first met. The text names the parts on each device (the largest submodules wholly
    there, by :func:`~devicekit._base.listing`), and advises moving the module, never its
    inputs to where a little of it is; part of it on meta is given storage first.
    None where all of it is on one device.

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    >>> _ = net[0].to("meta")
    >>> split, fix, found = split_model(net, "Net")
    >>> print(split)
    Net is split: 20 of its 28 elements are on meta (Net.0), 8 on cpu (Net.1).
    >>> print(fix)
    Move the model with devicekit.to_device(model, 'meta'), which moves all of it to one device.
    """
    found: dict[torch.device, list[str]] = {}
    weight: dict[torch.device, int] = {}
    for name, tensor in tensors_of(module, own=False):
        found.setdefault(tensor.device, []).append(f"{label}.{name}")
        weight[tensor.device] = weight.get(tensor.device, 0) + tensor.numel()
    if len(found) < 2:  # one device is no split
        return None
    most = max(weight.values())
    tied = [device for device, count in weight.items() if count == most]
    target = near if near in tied else tied[0]
    parts: dict[torch.device, list[str]] = {}
    for name, device in _parts(module, label):
        parts.setdefault(device, []).append(name)
    rest = ", ".join(
        f"{weight[device]:,} on {device} ({listing(names)})"
        for device, names in parts.items()
        if device != target
    )
    split = (
        f"{label} is split: {weight[target]:,} of its {sum(weight.values()):,} elements are on "
        f"{target} ({listing(parts[target])}), {rest}."
    )
    fix = (
        f"Move the model with devicekit.to_device(model, {str(target)!r}), which moves all of "
        "it to one device."
    )
    if target.type != "meta" and any(device.type == "meta" for device in found):
        # Moving it would fail on the part that has no data: it needs storage first.
        fix = f"{META.capitalize()}: {meta_fix(target)}; then {fix[0].lower()}{fix[1:]}"
    if near is not None and near != target:
        fix += " Move the inputs there too."
    return split, fix, found


def _root_name(data: Any, index: int, count: int) -> str:
    if isinstance(data, torch.nn.Module | torch.optim.Optimizer):
        return type(data).__name__
    return "data" if count == 1 else f"data[{index}]"


def check_same_device(*data: Any, device: DeviceLike | None = None) -> torch.device:
    """The one device all tensors in ``data`` share; an error naming them where they differ.

    Modules are named by class (``Net.fc.weight``), other arguments as ``data`` (or
    ``data[1]`` when several are given). ``"cuda"`` means the current CUDA device.

    >>> import torch, devicekit as dk
    >>> model = torch.nn.Linear(2, 2)
    >>> dk.check_same_device(model, {"x": torch.ones(2)})
    device(type='cpu')
    >>> dk.check_same_device(model, {"x": torch.ones(2, device="meta")})
    Traceback (most recent call last):
    ...
    devicekit.DeviceMismatchError: Expected every tensor on one device, but found 2: ...

    Args:
        *data: Tensors, modules, optimizers, and containers of them.
        device: The device they must all be on; None accepts any one device.

    Returns:
        The common device.

    Raises:
        DeviceMismatchError: The tensors are on more than one device, or not on
            ``device``. Its ``devices`` attribute maps every device to its paths.
        ValueError: ``data`` holds no tensor at all.
        TypeError: A device was passed among the data instead of as ``device=``, or
            ``device`` is of the wrong type.
        DeviceUnavailableError: ``device`` does not parse or is not on this machine.
        TransferError: As :func:`find_devices`.
    """
    expected = None if device is None else resolve_device(device)
    for index, item in enumerate(data):
        if isinstance(item, str | torch.device):
            msg = (
                "Expected tensors, modules, optimizers or containers of them as the data, and "
                f"the device as device=..., got the device {shown(str(item))} as data[{index}]. "
                f"Write check_same_device(..., device={str(item)!r})."
            )
            raise TypeError(msg)
    found: dict[torch.device, list[str]] = {}
    module_on_meta = False  # only a module with tensors on meta wants storage, not a move
    for index, item in enumerate(data):
        root = _root_name(item, index, len(data))
        for path, tensor in tensor_paths(item, root):
            if tensor.device.type == "meta" and isinstance(item, torch.nn.Module):
                module_on_meta = True
            # A DTensor is named with its placements and mesh: the table's row for its type
            # says whether it lives on one.
            meshed = leaf_how(type(tensor)).meshed
            found.setdefault(tensor.device, []).append(
                f"{path} ({mesh_of(tensor)})" if meshed else path
            )
    if not found:
        arguments = "1 argument" if len(data) == 1 else f"{len(data)} arguments"
        msg = f"Expected tensors to check, but found none in {arguments}."
        raise ValueError(msg)
    if expected is None and len(found) == 1:
        return next(iter(found))
    if expected is not None and set(found) == {expected}:
        return expected
    if expected is None:
        msg = f"Expected every tensor on one device, but found {len(found)}: "
    else:
        msg = f"Expected every tensor on {expected}, but found {len(found)} device(s): "
    msg += describe_devices(found) + "."
    if module_on_meta and (expected is None or expected.type != "meta"):
        target = next(each for each in (expected, *found) if each and each.type != "meta")
        msg += f" {META.capitalize()}: {meta_fix(target)}."
    raise DeviceMismatchError(msg, found)


@functools.cache
def input_names(forward: Any) -> tuple[list[str], str | None]:
    """The forward's positional parameter names (not ``self``), and its *args name if any."""
    try:
        parameters = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return [], "args"
    positional = [
        p.name
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    var = next((p.name for p in parameters if p.kind is inspect.Parameter.VAR_POSITIONAL), None)
    return positional[1:] if positional[:1] == ["self"] else positional, var


def tensors_of(module: torch.nn.Module, *, own: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The module's parameters then buffers: its own only, or its submodules' too."""
    yield from module.named_parameters(recurse=not own)
    yield from module.named_buffers(recurse=not own)
