"""guard: a module's inputs checked against its parameters before every forward call.

A forward pre-hook per guarded module compares the inputs' devices with the module's
first parameter, and with what ``Module.to()`` left on it (found once, when the guard
is installed), and names them as the forward's own parameters; the usual
``forward(x)`` on the right device costs a comparison or two. A mismatch PyTorch finds
inside the forward is explained on leaving a ``with guard(module):`` block
(:mod:`devicekit._checks._forward_error`). Stands apart from the checks of data
(:mod:`devicekit._checks._checks`) because it lives on a module's calls, where every
microsecond is paid again on each step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import torch

from devicekit._base import (
    META,
    DeviceMismatchError,
    flag,
    listing,
    meta_fix,
    registered_table,
    shown,
)
from devicekit._checks._checks import describe_devices, input_names, split_model, tensors_of
from devicekit._checks._forward_error import made_inside
from devicekit._core import Stray, read_again, strays, tensor_paths

__all__ = ["GuardHandle", "guard"]


def _input_paths(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    names, var = input_names(type(module).forward)
    for index, value in enumerate(args):
        name = names[index] if index < len(names) else f"{var or 'args'}[{index - len(names)}]"
        if isinstance(value, torch.Tensor):
            yield name, value
        else:
            yield from tensor_paths(value, name)
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            yield name, value
        else:
            yield from tensor_paths(value, name)


class GuardHandle:
    """The hooks :func:`guard` installed: ``remove()`` them, or leave a ``with`` block.

    Leaving a ``with`` block on PyTorch's own error for mixed devices, raised inside the
    guarded forward, the handle names the tensors the forward made on another device.

    >>> import torch, devicekit as dk
    >>> model = torch.nn.Linear(2, 2)
    >>> handle = dk.guard(model)
    >>> def run():  # an input on another device than the model's
    ...     try:
    ...         model(torch.ones(1, 2, device="meta"))
    ...     except dk.DeviceMismatchError:
    ...         return "guarded"
    ...     except RuntimeError:
    ...         return "PyTorch's own error"
    >>> run()
    'guarded'
    >>> handle.remove()
    >>> run()
    "PyTorch's own error"

    Args:
        handles: The hooks' handles, one a guarded module.
        module: The module guarded, read on leaving a ``with`` block (weakly held).

    Raises:
        DeviceMismatchError: Leaving a ``with`` block on PyTorch's mixed-device error from
            the forward: in its place (its ``__cause__``), naming what the forward made.
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
        explained = made_inside(module, error)
        if explained is not None:
            raise explained from error


def _first_tensor(module: torch.nn.Module, *, own: bool) -> Callable[[], torch.Tensor | None]:
    """A function giving the module's first parameter or buffer, cheaply, call after call.

    Listing a module's parameters costs microseconds per forward call; the first one
    is found once and then read through its owner's own table, so a parameter that is
    replaced (Module.to does so for some device pairs) is still the one read.
    """

    def look() -> torch.Tensor | None:
        return next((t for _, t in tensors_of(module, own=own)), None)

    for name, _ in tensors_of(module, own=own):
        owner_name, _, key = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        table = registered_table(owner, key)

        def first(table: dict[str, Any] = table, key: str = key) -> torch.Tensor | None:
            tensor = table.get(key)
            return look() if tensor is None else tensor  # None: removed since, look again

        return first
    return look


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
    whole: Callable[[], torch.nn.Module | None],
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
    params = [name for name, t in tensors_of(module, own=own) if t.device == home]
    (device, paths), *_ = where.items()
    said = (
        f"{paths[0]} is on {device} but the parameters of {label} (e.g. "
        f"{', '.join(params[:2])}) are on {home}."
    )
    found = {home: [f"{label}.{name}" for name in params], **where}
    root = whole()
    split = None if root is None else split_model(root, type(root).__name__, device)
    if split is not None:  # a part left behind: the model moves, not the inputs
        parts, fix, by_device = split
        for each, names in where.items():
            by_device[each] = [*by_device.get(each, []), *names]
        msg = f"{said} {parts} {fix}"
        raise DeviceMismatchError(msg, by_device)
    seen = describe_devices({home: [f"the parameters of {label}"], **where})
    fix = (
        f" Move the inputs with devicekit.to_device(..., {str(home)!r}), or the module to the "
        "inputs' device."
    )
    if home.type == "meta":  # the module was built there: it needs storage, not a move
        fix += f" {META.capitalize()}: {meta_fix(device)}."
    msg = f"{said} Devices seen: {seen}.{fix}"
    raise DeviceMismatchError(msg, found)


def _check_strays(
    module: torch.nn.Module, label: str, home: torch.device, *, own: bool, left: _Strays
) -> None:
    """Name a tensor Module.to() left on another device than the parameters, and the fix."""
    elsewhere = left.elsewhere(home)
    if not elsewhere:
        return
    stray, device = elsewhere[0]
    params = [name for name, t in tensors_of(module, own=own) if t.device == home]
    named = [f"{label}.{each.path}" for each, _ in elsewhere]
    more = f" Off {home} too: {listing(named[1:])}." if len(named) > 1 else ""
    msg = (
        f"{label}.{stray.path} is on {device} but the parameters of {label} (e.g. "
        f"{', '.join(params[:2])}) are on {home}.{more} {stray.fix()}."
    )
    found: dict[torch.device, list[str]] = {home: [f"{label}.{name}" for name in params]}
    for each, where in elsewhere:
        found.setdefault(where, []).append(f"{label}.{each.path}")
    raise DeviceMismatchError(msg, found)


def guard(module: torch.nn.Module, /, *, recurse: bool = False) -> GuardHandle:
    """Check a module's inputs against its parameters before every forward call.

    PyTorch's own error names an aten argument (``mat1``); a guarded module names your
    input and the layer. With ``recurse=True`` every submodule with parameters is
    checked against its own, which catches a layer left behind on another device. Where
    the module's parameters are split across devices, the message says so, names the part
    elsewhere, and advises moving the module to where most of it is, never the inputs.

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
        TypeError: ``module`` is not a :class:`torch.nn.Module`, or ``recurse`` is not
            True or False.
        TransferError: The module's attributes, or (from the forward call) its inputs,
            nest containers deeper than :func:`~devicekit.to_device` takes.
    """
    if not isinstance(module, torch.nn.Module):  # for untyped callers
        msg = (  # type: ignore[unreachable]
            f"Expected a torch.nn.Module to guard, got {type(module).__name__} {shown(module)}."
        )
        raise TypeError(msg)
    recurse = flag(recurse, "recurse")
    handles = []
    targets = (
        [
            (name, sub)
            for name, sub in module.named_modules()
            if next(tensors_of(sub, own=True), None)
        ]
        if recurse
        else [("", module)]
    )
    root = type(module).__name__
    whole = weakref.ref(module)  # weakly: the hooks on its layers must not keep it alive
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
            _check_inputs(
                sub, label, args, kwargs, own=recurse, first=first, left=left, whole=whole
            )

        handles.append(sub.register_forward_pre_hook(check, with_kwargs=True))
    return GuardHandle(handles, module)
