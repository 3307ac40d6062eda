"""What fit_batch's tries train, put back: a host copy of ``restore=`` and of the generators.

The search runs the user's real training step. Before the first try :class:`Kept`
copies what ``restore=`` names, and where each global random generator stands, to the
host (not the device, whose free memory the search measures); once the search ends,
however it ends, it puts all of it back. Its one invariant: everything goes back *into
the objects it came from* (parameters, gradients, an optimizer's groups and state, a
tensor ``lr``), which the optimizer, an LR scheduler or the user may hold; only objects
that keep their state their own way go back through their ``load_state_dict``. The
search (:mod:`devicekit._memory._fit_batch`) only says when. A try that ran out of memory can stop
a step halfway; :meth:`Kept.between_steps` leaves no half-done step to the next one.
"""

from __future__ import annotations

import functools
import random
import sys
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeGuard

import torch
from torch import nn

from devicekit._base import HOST_TYPES, scaler_between_steps, scaler_marks_kept
from devicekit._core import map_leaves, to_device

__all__ = ["Kept", "restorable"]

_HOST: Final = torch.device("cpu")
"""Where the copy lives: not on the device, whose free memory the search measures."""


def restorable(restore: object) -> tuple[object, ...]:
    """The entries of ``restore=``, each one a module or has a state to save and load."""
    if isinstance(restore, nn.Module) or _stateful(restore):
        named = [("restore", restore)]
    elif isinstance(restore, tuple | list):
        named = [(f"restore[{index}]", entry) for index, entry in enumerate(restore)]
    else:
        msg = (
            "Expected restore to be a module, an optimizer, an object with state_dict() "
            "and load_state_dict(), or a tuple of them such as restore=(model, optimizer), "
            f"got {type(restore).__name__}."
        )
        raise TypeError(msg)
    for name, entry in named:
        if isinstance(entry, nn.Module):
            _refuse_uninitialised(entry, name)
        elif not _stateful(entry):
            msg = (
                f"Expected {name} to be a module, an optimizer or an object with "
                f"state_dict() and load_state_dict(), got {type(entry).__name__}: "
                "fit_batch could not put it back after the search."
            )
            raise TypeError(msg)
    return tuple(entry for _, entry in named)


_UNINITIALISED: Final = (nn.parameter.UninitializedParameter, nn.parameter.UninitializedBuffer)


def _refuse_uninitialised(module: nn.Module, name: str) -> None:
    """Refuse a lazy module not yet run: its parameters have no values to copy, nor put back."""
    for kind, named in (
        ("parameter", module.named_parameters()),
        ("buffer", module.named_buffers()),
    ):
        for path, tensor in named:
            if isinstance(tensor, _UNINITIALISED):
                msg = (
                    f"Expected every parameter and buffer of {name} to be initialised, so that "
                    f"fit_batch can keep a copy to put back, got the {kind} '{path}' not "
                    "initialised yet: a lazy module (such as torch.nn.LazyLinear) makes its "
                    "parameters in its first forward. Run one forward first (model(batch)), "
                    "or leave it out of restore= (the search then initialises and trains it)."
                )
                raise TypeError(msg)


def _stateful(entry: object) -> bool:
    return callable(getattr(entry, "state_dict", None)) and callable(
        getattr(entry, "load_state_dict", None)
    )


class Kept:
    """A host copy of what ``restore=`` names, and of the random generators, put back once.

    An optimizer goes back through :class:`_KeptOptimizer` where it can; other objects
    through their own ``load_state_dict``, from a copy of their ``state_dict`` made by
    :func:`to_device`. A ``GradScaler`` and the optimizers are also left between two
    steps, which ``load_state_dict`` does not do (see :meth:`between_steps`).
    """

    def __init__(self, entries: Sequence[object], device: torch.device) -> None:
        self.tensors: list[tuple[torch.Tensor, torch.Tensor]] = []  # (the live one, its copy)
        self.grads: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.flags: list[tuple[nn.Module, bool]] = []
        self.states: list[Callable[[], object]] = []  # each puts one object's state back
        self.scalers: list[torch.amp.GradScaler] = []
        self.marks: list[Callable[[], None]] = []  # each puts a scaler's marks on an optimizer back
        seen: set[int] = set()
        for entry in entries:
            if isinstance(entry, torch.amp.GradScaler):
                self.scalers.append(entry)
            if isinstance(entry, torch.optim.Optimizer):
                self.marks.append(scaler_marks_kept(entry))
            if isinstance(entry, nn.Module):
                self._keep_module(entry, seen)
            elif _optimizer_in_place(entry):
                self.states.append(_KeptOptimizer(entry).put_back)
            else:
                state = to_device(entry.state_dict(), _HOST, copy=True)  # type: ignore[attr-defined]
                self.states.append(functools.partial(entry.load_state_dict, state))  # type: ignore[attr-defined]
        self.generators = _generators(device)

    def _keep_module(self, module: nn.Module, seen: set[int]) -> None:
        self.flags.extend((each, each.training) for each in module.modules())
        for tensor in (*module.parameters(), *module.buffers()):
            if id(tensor) in seen or tensor.is_meta:  # a meta tensor has no values to keep
                continue
            seen.add(id(tensor))
            self.tensors.append((tensor, tensor.detach().to(_HOST, copy=True)))
            if isinstance(tensor, nn.Parameter):
                grad = tensor.grad
                self.grads.append((tensor, None if grad is None else grad.to(_HOST, copy=True)))

    def between_steps(self) -> None:
        """Leave no step half-done: each GradScaler's record of it, and its marks on optimizers.

        A step stopped after ``scaler.unscale_(optimizer)`` would make the next one refuse
        to unscale again; one stopped inside a fused optimizer's step would make the next
        divide its gradients by the scale twice.
        """
        for scaler in self.scalers:
            scaler_between_steps(scaler)
        for put in self.marks:
            put()

    def put_back(self) -> None:
        """Put everything back as it was, then drop the copy."""
        self.between_steps()
        with torch.no_grad():
            for tensor, copy in self.tensors:
                tensor.copy_(copy)
            for parameter, grad in self.grads:
                now = parameter.grad
                if grad is None:
                    parameter.grad = None
                elif now is not None and now.shape == grad.shape and now.dtype == grad.dtype:
                    now.copy_(grad)  # in place: DDP's gradients may be views of its buckets
                else:
                    parameter.grad = grad.to(parameter.device)
        for module, training in self.flags:
            module.training = training  # not train(): its recursion would overwrite the rest
        for put in (*self.states, *self.generators):
            put()
        self.tensors, self.grads, self.flags, self.states, self.generators = [], [], [], [], []
        self.scalers, self.marks = [], []


def _optimizer_in_place(entry: object) -> TypeGuard[torch.optim.Optimizer]:
    """Whether ``entry`` is an optimizer whose whole state is its groups and ``state``.

    So it is where its class keeps Optimizer's own ``state_dict`` and ``load_state_dict``,
    which read and write nothing else; a class that defines its own (ZeroRedundancyOptimizer
    keeps its shard in an inner optimizer, accelerate's wrapper hands on to one) is put
    back through them.
    """
    base = torch.optim.Optimizer
    return (
        isinstance(entry, base)
        and type(entry).state_dict is base.state_dict
        and type(entry).load_state_dict is base.load_state_dict
    )


class _KeptOptimizer:
    """An optimizer's ``param_groups`` and ``state`` as they were, put back into the same objects.

    Not through ``load_state_dict``, which puts new dicts in ``param_groups``. The list,
    each group, ``state`` and each parameter's dict keep the keys they had (keys added
    during the search go, keys removed come back); a group's ``params`` are left alone.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.groups = [(group, _kept_values(group, "params")) for group in self.param_groups]
        self.state = optimizer.state
        self.parameters: list[tuple[object, object, dict[Any, _Value] | _Value]] = [
            (key, each, _kept_values(each) if isinstance(each, dict) else _Value(each))
            for key, each in self.state.items()
        ]

    def put_back(self) -> None:
        optimizer = self.optimizer
        if optimizer.param_groups is not self.param_groups:  # a step replaced the list
            optimizer.param_groups = self.param_groups
        self.param_groups[:] = [group for group, _ in self.groups]  # add_param_group undone
        for group, values in self.groups:
            _refill(group, values, "params")
        if optimizer.state is not self.state:
            optimizer.state = self.state
        state: dict[Any, Any] = self.state
        kept = {id(key) for key, _, _ in self.parameters}
        for key in [key for key in state if id(key) not in kept]:  # state the search began
            del state[key]
        for key, each, kept_values in self.parameters:
            if isinstance(kept_values, _Value):
                state[key] = kept_values.value()
            else:
                assert isinstance(each, dict)  # for mypy: kept as one above
                state[key] = each
                _refill(each, kept_values)


def _kept_values(mapping: dict[Any, Any], *left: object) -> dict[Any, _Value]:
    return {key: _Value(value) for key, value in mapping.items() if key not in left}


def _refill(mapping: dict[Any, Any], values: dict[Any, _Value], *left: object) -> None:
    """``mapping`` holding ``values`` again, and no other key but those ``left`` alone."""
    for key in [key for key in mapping if key not in values and key not in left]:
        del mapping[key]
    for key, value in values.items():
        mapping[key] = value.value()


class _Value:
    """One value of an optimizer's groups or state, copied with its tensors on the host.

    Containers are copied (a step may append to a list in place) and given back anew;
    each tensor goes back into the tensor it was; other leaves are kept as they are, as
    ``load_state_dict`` keeps them.
    """

    def __init__(self, value: object) -> None:
        self.tensors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by id of the copy
        self.copy = map_leaves(self._keep, value, root=None)

    def _keep(self, leaf: Any, _: object) -> Any:
        if not isinstance(leaf, torch.Tensor) or leaf.is_meta:  # meta: no values to keep
            return leaf
        copy = leaf.detach().to(_HOST, copy=True)
        self.tensors[id(copy)] = (leaf, copy)
        return copy

    def value(self) -> Any:
        """The value as it was: its containers anew, its tensors the same, refilled."""
        return map_leaves(self._back, self.copy, root=None)

    def _back(self, leaf: Any, _: object) -> Any:
        kept = self.tensors.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
        if kept is None:
            return leaf
        tensor, copy = kept
        with torch.no_grad():
            tensor.copy_(copy)
        return tensor


def _generators(device: torch.device) -> list[Callable[[], object]]:
    """What puts each global random generator back as it is now."""
    kept: list[Callable[[], object]] = [
        functools.partial(torch.set_rng_state, torch.get_rng_state()),
        functools.partial(random.setstate, random.getstate()),
    ]
    backend: Any = getattr(torch, device.type, None) if device.type not in HOST_TYPES else None
    get, put = getattr(backend, "get_rng_state", None), getattr(backend, "set_rng_state", None)
    if callable(get) and callable(put):
        if device.type == "mps":  # one generator, no device argument
            kept.append(functools.partial(put, get()))
        else:
            kept.append(functools.partial(put, get(device), device))
    numpy: Any = sys.modules.get("numpy")
    if numpy is not None:  # NumPy's global generator, read only where NumPy is loaded
        kept.append(functools.partial(numpy.random.set_state, numpy.random.get_state()))
    return kept
