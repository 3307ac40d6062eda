"""Device checks that speak of the user's data: where every tensor is, and which disagree.

``find_devices`` and ``check_same_device`` walk data with the one traversal engine,
reaching into modules (their parameters and buffers, by qualified name) and optimizers
(their parameters and state) as well as containers; ``guard`` checks a module's inputs
before each forward, naming them by the forward's own parameter names, and names the
tensors a forward made on another device when PyTorch refuses to mix them.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import linecache
import os
import re
import weakref
from collections.abc import Callable, Iterator
from types import FrameType, TracebackType
from typing import Any, NamedTuple

import torch

from devicekit import _compat, _tree
from devicekit._devices import DeviceLike, resolve_device, shown
from devicekit._errors import DeviceKitError, DeviceMismatchError
from devicekit._kinds import READ
from devicekit._unmoved import Stray, read_again, strays

__all__ = [
    "GuardHandle",
    "check_same_device",
    "describe_devices",
    "find_devices",
    "find_unmoved",
    "guard",
]

# How many paths a message lists per device before it only counts the rest.
_PATHS_SHOWN = 3


def _tensor_paths(data: Any, root: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in ``data`` with its path, as the READ view of the table sees them.

    That is every tensor to_device would move, inside modules, optimizers and objects
    that move themselves too (a PackedSequence's ``.data``, a graph's ``.x``), and the
    tensors a module holds that Module.to() leaves behind (:func:`find_unmoved`).
    """
    flat = _tree.flatten(data, view=READ)
    tensors = [index for index in flat.active if isinstance(flat.leaves[index], torch.Tensor)]
    modules = [
        (number, entry[2])
        for number, entry in enumerate(flat.spec)
        if isinstance(entry[2], torch.nn.Module)
    ]
    if not tensors and not modules:  # a million ints, a config: no path is made
        return
    leaf_paths, container_paths = _tree.paths(flat)
    for index in tensors:
        yield _rooted(root, leaf_paths[index]), flat.leaves[index]
    for number, module in modules:
        # A refusal names the data as to_device's does where it has no name of its own.
        for stray in strays(module, root=(root or "data") + container_paths[number]):
            yield _rooted(root, f"{container_paths[number]}.{stray.path}"), stray.tensor


def _rooted(root: str, path: str) -> str:
    return root + path if root or not path.startswith(".") else path[1:]


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
    for path, tensor in _tensor_paths(data, ""):
        found.setdefault(tensor.device, []).append(path)
    return found


def describe_devices(found: dict[torch.device, list[str]]) -> str:
    """``cuda:0 has a, b; cpu has c and 4 more`` for a message."""
    parts = []
    for device, paths in found.items():
        shown = ", ".join(paths[:_PATHS_SHOWN])
        more = len(paths) - _PATHS_SHOWN
        parts.append(f"{device} has {shown}" + (f" and {more} more" if more > 0 else ""))
    return "; ".join(parts)


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
        TypeError: A device was passed among the data instead of as ``device=``.
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
    for index, item in enumerate(data):
        root = _root_name(item, index, len(data))
        for path, tensor in _tensor_paths(item, root):
            found.setdefault(tensor.device, []).append(path)
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
    raise DeviceMismatchError(msg + describe_devices(found) + ".", found)


# guard: forward pre-hooks.


@functools.cache
def _input_names(forward: Any) -> tuple[list[str], str | None]:
    """The forward's positional parameter names, and its *args name if it has one."""
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
    return positional, var


def _input_paths(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    positional, var = _input_names(type(module).forward)
    names = positional[1:] if positional[:1] == ["self"] else positional
    for index, value in enumerate(args):
        name = names[index] if index < len(names) else f"{var or 'args'}[{index - len(names)}]"
        if isinstance(value, torch.Tensor):
            yield name, value
        else:
            yield from _tensor_paths(value, name)
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            yield name, value
        else:
            yield from _tensor_paths(value, name)


class GuardHandle:
    """The hooks :func:`guard` installed: ``remove()`` them, or leave a ``with`` block.

    Leaving a ``with`` block on PyTorch's own error for mixed devices, raised inside the
    guarded forward, the handle names the tensors the forward made on another device.

    >>> import torch, devicekit as dk
    >>> model = torch.nn.Linear(2, 2)
    >>> handle = dk.guard(model)
    >>> len(model._forward_pre_hooks)
    1
    >>> handle.remove()
    >>> len(model._forward_pre_hooks)
    0
    """

    def __init__(
        self,
        handles: list[torch.utils.hooks.RemovableHandle],
        module: torch.nn.Module | None = None,
    ) -> None:
        self._handles = handles
        # Weakly: a handle kept after remove() must not keep the model alive.
        self._module = None if module is None else weakref.ref(module)

    def remove(self) -> None:
        """Take the checks off; the module then runs exactly as unguarded."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> GuardHandle:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.remove()
        module = None if self._module is None else self._module()
        if error is None or module is None:
            return
        # Read only here, when the block ends on an error: a forward that succeeds pays
        # nothing for it.
        explained = _made_inside(module, error)
        if explained is not None:
            raise explained from error


def _tensors_of(module: torch.nn.Module, *, own: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The module's parameters then buffers: its own only, or its submodules' too."""
    yield from module.named_parameters(recurse=not own)
    yield from module.named_buffers(recurse=not own)


def _first_tensor(module: torch.nn.Module, *, own: bool) -> Callable[[], torch.Tensor | None]:
    """A function giving the module's first parameter or buffer, cheaply, call after call.

    Listing a module's parameters costs microseconds per forward call; the first one
    is found once and then read through its owner's own table, so a parameter that is
    replaced (Module.to does so for some device pairs) is still the one read.
    """
    for name, _ in _tensors_of(module, own=own):
        owner_name, _, key = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        table = _compat.registered_table(owner, key)

        def first(table: dict[str, Any] = table, key: str = key) -> torch.Tensor | None:
            tensor = table.get(key)
            if tensor is None:  # removed since: look again
                return next((t for _, t in _tensors_of(module, own=own)), None)
            return tensor  # type: ignore[no-any-return]

        return first
    return lambda: next((t for _, t in _tensors_of(module, own=own)), None)


class _Strays:
    """What Module.to() left on a guarded module: found once, read again on every call.

    Found again where the module gained or lost an attribute since (its ``__dict__``'s
    size), or where a tensor's place no longer reads (an attribute deleted): a clean
    module costs a comparison a call.
    """

    __slots__ = ("found", "module", "own", "root", "size")

    def __init__(self, module: torch.nn.Module, *, own: bool, root: str) -> None:
        self.module, self.own, self.root = module, own, root
        self._find()  # when the guard is installed: a forward call walks nothing

    def elsewhere(self, home: torch.device) -> list[tuple[Stray, torch.device]]:
        """The strays not on ``home`` now, with their devices."""
        if len(self.module.__dict__) != self.size:
            self._find()
        try:
            current = list(zip(self.found, read_again(self.found), strict=True))
        except (AttributeError, LookupError, TypeError):  # a place that is gone: look again
            self._find()
            current = [(stray, stray.tensor) for stray in self.found]
        return [
            (stray, value.device)
            for stray, value in current
            if isinstance(value, torch.Tensor) and value.device != home
        ]

    def _find(self) -> None:
        self.found: list[Stray] = strays(self.module, own=self.own, root=self.root)
        self.size = len(self.module.__dict__)


def _check_inputs(
    module: torch.nn.Module,
    label: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    own: bool,
    first: Callable[[], torch.Tensor | None],
    left: _Strays,
) -> None:
    tensor = first()
    if tensor is None:
        return
    home = tensor.device
    # The usual forward(x) costs one comparison, and one for what Module.to() left.
    single = len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor)
    if single and args[0].device == home:
        if left.found or len(module.__dict__) != left.size:
            _check_strays(module, label, home, own=own, left=left)
        return
    where: dict[torch.device, list[str]] = {}
    for path, tensor in _input_paths(module, args, kwargs):
        if tensor.device != home:
            where.setdefault(tensor.device, []).append(path)
    if not where:
        _check_strays(module, label, home, own=own, left=left)
        return
    params = [name for name, t in _tensors_of(module, own=own) if t.device == home]
    (device, paths), *_ = where.items()
    seen = describe_devices({home: [f"the parameters of {label}"], **where})
    msg = (
        f"{paths[0]} is on {device} but the parameters of {label} (e.g. "
        f"{', '.join(params[:2])}) are on {home}. Devices seen: {seen}. Move the inputs with "
        f"devicekit.to_device(..., {str(home)!r}), or the module to the inputs' device."
    )
    raise DeviceMismatchError(msg, {home: [f"{label}.{name}" for name in params], **where})


def _check_strays(
    module: torch.nn.Module, label: str, home: torch.device, *, own: bool, left: _Strays
) -> None:
    """Name a tensor Module.to() left on another device than the parameters, and the fix."""
    elsewhere = left.elsewhere(home)
    if not elsewhere:
        return
    stray, device = elsewhere[0]
    params = [name for name, t in _tensors_of(module, own=own) if t.device == home]
    named = [f"{label}.{each.path}" for each, _ in elsewhere]
    more = f" (and {len(named) - 1} more: {', '.join(named[1:4])})" if len(named) > 1 else ""
    msg = (
        f"{label}.{stray.path} is on {device} but the parameters of {label} (e.g. "
        f"{', '.join(params[:2])}) are on {home}{more}. {stray.fix()}."
    )
    found: dict[torch.device, list[str]] = {home: [f"{label}.{name}" for name in params]}
    for each, where in elsewhere:
        found.setdefault(where, []).append(f"{label}.{each.path}")
    raise DeviceMismatchError(msg, found)


def guard(module: torch.nn.Module, /, *, recurse: bool = False) -> GuardHandle:
    """Check a module's inputs against its parameters before every forward call.

    PyTorch's own error names an aten argument (``mat1``); a guarded module names your
    input and the layer. With ``recurse=True`` every submodule with parameters is
    checked against its own, which catches a layer left behind on another device.

    A tensor the forward makes itself (``torch.zeros(n, 51)`` without ``device=``) is
    not an input: where PyTorch refuses it inside the forward, a ``with guard(module):``
    block names it on the way out, as the forward's variable (``h_t in
    Sequence.forward``) or the call that made it, with the fix: make it on the input's
    device. This costs nothing while the forward succeeds.

    >>> import torch, devicekit as dk
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> with dk.guard(net):
    ...     net(torch.ones(1, 2, device="meta"))
    Traceback (most recent call last):
    ...
    devicekit.DeviceMismatchError: input is on meta but the parameters of Sequential ...

    Args:
        module: The module to guard.
        recurse: Also guard every submodule that has parameters or buffers of its own.

    Returns:
        The handle of the checks. Its ``.remove()`` takes them off, and ``with
        guard(module):`` removes them on leaving the block. Removed, they cost nothing.

    Raises:
        DeviceMismatchError: From the guarded forward call, before PyTorch fails; or, on
            leaving a ``with`` block, in place of PyTorch's error for mixed devices raised
            inside the forward (its ``__cause__``), naming what the forward made there.
        TypeError: ``module`` is not a :class:`torch.nn.Module`.
        TransferError: The module's attributes, or (from the forward call) its inputs,
            nest containers deeper than :func:`~devicekit.to_device` takes.
    """
    if not isinstance(module, torch.nn.Module):  # for untyped callers
        msg = (  # type: ignore[unreachable]
            f"Expected a torch.nn.Module to guard, got {type(module).__name__} {shown(module)}."
        )
        raise TypeError(msg)
    handles = []
    targets = (
        [
            (name, sub)
            for name, sub in module.named_modules()
            if next(_tensors_of(sub, own=True), None)
        ]
        if recurse
        else [("", module)]
    )
    root = type(module).__name__
    for name, sub in targets:
        label = f"{root}.{name} ({type(sub).__name__})" if name else root
        first_of_sub = _first_tensor(sub, own=recurse)
        left_on_sub = _Strays(sub, own=recurse, root=f"{root}.{name}" if name else root)

        def check(
            sub: torch.nn.Module,
            args: tuple[Any, ...],
            kwargs: dict[str, Any],
            *,
            label: str = label,
            first: Callable[[], torch.Tensor | None] = first_of_sub,
            left: _Strays = left_on_sub,
        ) -> None:
            # Guarding the whole module compares with all its parameters; guarding each
            # layer compares each with its own, which finds the one left behind.
            _check_inputs(sub, label, args, kwargs, own=recurse, first=first, left=left)

        handles.append(sub.register_forward_pre_hook(check, with_kwargs=True))
    return GuardHandle(handles, module)


# guard: what a forward made on another device, read from PyTorch's error when a guarded
# block ends on it.

_NAME = re.compile(r"(?<![\w.])[^\W\d]\w*")
"""A name in source text, not an attribute's (``self.h`` gives ``self``)."""
_FACTORY = re.compile(
    r"\btorch\.(?:zeros|ones|empty|full|rand|randn|randint|randperm|arange|linspace|eye|tensor)\("
)
"""A call of a tensor factory, which puts its tensor on the default device unless told."""
_SOURCE_LINES = 20
"""The most lines of a failing call read: a longer span is not one call worth showing."""
_SOURCE_SHOWN = 120
"""The most characters of a failing call a message shows."""


class _Call(NamedTuple):
    """A frame of the user's code inside the guarded forward, and the line it was at."""

    frame: FrameType
    lineno: int
    lasti: int

    @property
    def where(self) -> str:
        """``Sequence.forward (model.py:42)``."""
        code = self.frame.f_code
        qualname = getattr(code, "co_qualname", None)  # Python 3.11 and later
        if qualname is None:
            owner = self.frame.f_locals.get("self")
            qualname = code.co_name if owner is None else f"{type(owner).__name__}.{code.co_name}"
        qualname = qualname.rpartition(".<locals>.")[2]
        return f"{qualname} ({os.path.basename(code.co_filename)}:{self.lineno})"


class _Made(NamedTuple):
    """A tensor the forward used on another device than its module's."""

    name: str
    call: _Call
    device: torch.device


def _inside_calls(module: torch.nn.Module, error: BaseException) -> list[_Call]:
    """The frames of the user's code inside ``module``'s call, outermost first.

    The call begins at the first frame of the module's forward, or of PyTorch's code
    calling it (``module(x)``); a user's method of the module that called it (a
    ``fit()``) is not inside.
    """
    # Loaded on an error only: import devicekit leaves track_transfers' module unloaded.
    from devicekit._audit import is_library  # noqa: PLC0415

    forward = getattr(type(module).forward, "__code__", None)
    calls: list[_Call] = []
    inside = False
    each = error.__traceback__
    while each is not None:
        frame = each.tb_frame
        library = is_library(frame.f_code.co_filename)
        if not inside and frame.f_locals.get("self") is module:
            inside = library or frame.f_code is forward
        if inside and not library:
            calls.append(_Call(frame, each.tb_lineno, each.tb_lasti))
        each = each.tb_next
    return calls


def _failing_source(call: _Call) -> str | None:
    """The source of the call that failed in ``call``'s frame, as one line; None if unknown.

    Python 3.11 and later say where the call is in its line (``co_positions``), so
    ``h = self.cell(x, (h, c))`` gives ``self.cell(x, (h, c))``; older Pythons give the line.
    """
    code = call.frame.f_code
    first, last, start, end = call.lineno, call.lineno, None, None
    positions = getattr(code, "co_positions", None)
    if positions is not None and call.lasti >= 0:
        found = next(itertools.islice(positions(), call.lasti // 2, None), None)
        if found is not None and found[0] is not None and found[1] is not None:
            first, last, start, end = found
    if last - first >= _SOURCE_LINES:
        return None
    lines = [
        linecache.getline(code.co_filename, number, call.frame.f_globals)
        for number in range(first, last + 1)
    ]
    if not all(lines):
        return None
    # Columns count bytes of UTF-8; the end first, as the start may be on the same line.
    if end is not None:
        lines[-1] = lines[-1].encode()[:end].decode(errors="ignore")
    if start is not None:
        lines[0] = lines[0].encode()[start:].decode(errors="ignore")
    return " ".join(line.strip() for line in lines)


def _tensors_named(name: str, value: Any) -> list[tuple[str, torch.Tensor]]:
    """The tensors in a local variable, with their paths; none in a module or optimizer."""
    if isinstance(value, torch.nn.Module | torch.optim.Optimizer):
        return []  # its parameters are the module's, checked before the forward
    if isinstance(value, torch.Tensor):
        return [(name, value)]
    try:
        return list(_tensor_paths(value, name))
    except Exception:  # a local that cannot be walked names nothing: the user's error goes on
        return []


def _inputs_in(module: torch.nn.Module, calls: list[_Call]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors among the forward's positional inputs, as its own frame holds them."""
    own = next((call for call in calls if call.frame.f_locals.get("self") is module), None)
    if own is None:
        return
    positional, _ = _input_names(type(module).forward)
    for name in positional[1:] if positional[:1] == ["self"] else positional:
        yield from _tensors_named(name, own.frame.f_locals.get(name))


def _listing(names: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``, ``a, b, c and 2 more``."""
    if len(names) > _PATHS_SHOWN:
        return f"{', '.join(names[:_PATHS_SHOWN])} and {len(names) - _PATHS_SHOWN} more"
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _made_elsewhere(calls: list[_Call], source: str | None, home: torch.device) -> list[_Made]:
    """The tensors the failing call used that are not on ``home``, named where first seen.

    The failing call is the innermost frame's; its tensors are the locals its source
    names (all its locals where the source cannot be read). Each is named as the
    outermost frame inside the forward calls it: ``h0`` made in ``Model.forward`` and
    passed to a block whose forward calls it ``h``. A host scalar tensor, which PyTorch
    takes next to any device, is left out.
    """
    innermost = calls[-1]
    local = innermost.frame.f_locals
    used = dict.fromkeys(_NAME.findall(source)) if source is not None else dict.fromkeys(local)
    found: dict[int, _Made] = {}
    for name in used:
        if name == "self" or name not in local:
            continue
        for path, tensor in _tensors_named(name, local[name]):
            scalar = tensor.dim() == 0 and tensor.device.type == "cpu"
            if tensor.device != home and not scalar and id(tensor) not in found:
                found[id(tensor)] = _Made(path, innermost, tensor.device)
    if not found:
        return []
    renamed: dict[int, _Made] = {}
    for call in calls[:-1]:
        for name, value in call.frame.f_locals.items():
            if isinstance(value, torch.Tensor) and id(value) in found and id(value) not in renamed:
                renamed[id(value)] = _Made(name, call, value.device)
    return [renamed.get(key, made) for key, made in found.items()]


def _made_inside(module: torch.nn.Module, error: BaseException) -> DeviceMismatchError | None:
    """The error naming what the guarded forward made on another device; None if unknown.

    Read from PyTorch's own error for mixed devices raised inside the module's call:
    the tensors the failing call used that are not on the module's device, or a tensor
    factory called there without ``device=``.
    """
    if isinstance(error, DeviceKitError) or not _compat.is_device_mismatch(error):
        return None
    calls = _inside_calls(module, error)
    if not calls:
        return None
    first = next((tensor for _, tensor in _tensors_of(module, own=False)), None)
    params = first is not None
    if first is None:
        first = next((tensor for _, tensor in _inputs_in(module, calls)), None)
        if first is None:
            return None
    home = first.device
    # What a fix makes new tensors next to: the first input on the module's device, by
    # its name in forward, else the first parameter (self.fc.weight).
    near = next((path for path, t in _inputs_in(module, calls) if t.device == home), None)
    if near is None:
        near = next((f"self.{name}" for name, t in _tensors_of(module, own=False)), "input")
    source = _failing_source(calls[-1])
    made = _made_elsewhere(calls, source, home)
    label = type(module).__name__
    default = torch.get_default_device()
    if made:
        return _named_made(made, home, _near(label, near, parameters=params), near)
    if source is None or default == home or not _FACTORY.search(source) or "device" in source:
        return None
    shown_source = source if len(source) <= _SOURCE_SHOWN else source[: _SOURCE_SHOWN - 3] + "..."
    msg = (
        f"The call {shown_source} in {calls[-1].where} makes a tensor without device=, which "
        f"puts it on {default}, but {_near(label, near, parameters=params)} on {home}. "
        + _fix("it", near)
    )
    return DeviceMismatchError(msg, {home: [near], default: [f"the call in {calls[-1].where}"]})


def _near(label: str, near: str, *, parameters: bool) -> str:
    """``the input and the parameters of Net are``: what the tensors should be next to."""
    if near.startswith("self."):
        return f"the parameters of {label} are"
    return (
        f"the input and the parameters of {label} are" if parameters else f"the input of {label} is"
    )


def _fix(them: str, near: str) -> str:
    """How to make a tensor next to ``near`` (an input, or a parameter as ``self.fc.weight``)."""
    if near.startswith("self."):
        return (
            f"Make {them} on the parameters' device: torch.zeros(..., device={near}.device) "
            f"or {near}.new_zeros(...)."
        )
    return (
        f"Make {them} on the input's device: torch.zeros(..., device={near}.device), "
        f"{near}.new_zeros(...) or torch.zeros_like({near})."
    )


def _named_made(
    made: list[_Made], home: torch.device, near_said: str, near: str
) -> DeviceMismatchError:
    """The error naming the tensors the failing call used off the module's device."""
    groups: dict[_Call, list[str]] = {}
    for each in made:
        groups.setdefault(each.call, []).append(each.name)
    subject = " and ".join(f"{_listing(names)} in {call.where}" for call, names in groups.items())
    devices = list(dict.fromkeys(each.device for each in made))
    one = len(made) == 1
    # Where the default device is the host: a factory called without device= made it.
    host = all(device == torch.get_default_device() == torch.device("cpu") for device in devices)
    made_there = (
        " A tensor made inside forward is put on the host unless told otherwise." if host else ""
    )
    msg = (
        f"{subject} {'is' if one else 'are'} on {' and '.join(map(str, devices))} but "
        f"{near_said} on {home}.{made_there} {_fix('it' if one else 'them', near)}"
    )
    found: dict[torch.device, list[str]] = {home: [near]}
    for each in made:
        found.setdefault(each.device, []).append(each.name)
    return DeviceMismatchError(msg, found)
