"""fit_batch: the largest batch that fits in device memory, found once, agreed by every rank.

The search runs the user's own training step at a size and watches only for running
out of memory::

    agree:   every option that shapes the search, the same on every rank (one all-reduce)
    keep:    a host copy of what restore= names, and of the random generators
    grow:    start, 2x start, 4x start, ...   until a step runs out of memory (or limit)
    narrow:  between the last size that fit and the first that did not, halving the gap
             until the size that fits is within a tenth of the one that did not
    room:    with headroom, the size shrinks until its measured peak leaves that share free
    put back: the copy, on every way out (a fit, an error, Ctrl-C), then dropped

Each try is freed before the next: the step's exception is dropped before the next
step starts (its traceback holds the failed step's frames, and their tensors), then
garbage is collected and the allocator's cache emptied, and the peak statistics are
reset. Under a process group every rank makes the same collective calls in the same
order, so that none waits for another: the options are agreed before the first try
(ranks given different ones all refuse, together), every try ends with one all-reduce
(MIN) of its outcome, so all ranks take the same sizes and end on the same one, and a
rank whose step fails otherwise tells the others before it raises. A step that
synchronises a DistributedDataParallel's gradients cannot keep that promise (a rank out
of memory inside it leaves the others in its all-reduce): where the wrapper is named
in ``restore=``, that is seen and refused after the first try, on every rank.

What the device can tell of its memory sits behind one small seam, :data:`MEMORY`, as
the loader's streams do: the tests stand in for a GPU there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math
import random
import struct
import sys
from collections.abc import Callable, Sequence
from typing import Any, Final, NamedTuple, Protocol, TypeGuard

import torch
from torch import nn

from devicekit import _tree
from devicekit._compat import ddp_forward_syncs, is_out_of_memory
from devicekit._current import current_device
from devicekit._devices import DeviceLike, resolve_device, shown
from devicekit._errors import DeviceKitError
from devicekit._transfer import to_device
from devicekit._units import nbytes

__all__ = ["MEMORY", "BatchFit", "DeviceMemory", "fit_batch"]

_NEAR: Final = 0.10
"""The search stops narrowing once the size that fits is within this share of the one
that did not: at least 90% of the largest size that fits, in a few more tries."""
_MOST: Final = 2**20
"""The largest size tried without a ``limit``, on devices that never run out of memory."""
_FIT, _OUT_OF_MEMORY, _FAILED = 1, 0, -1  # what a try came to, as ranks agree on it
_HOST: Final = torch.device("cpu")
"""Where the copy of restore= lives: not on the device, whose free memory the search measures."""


class DeviceMemory(Protocol):
    """What fit_batch asks of a device's memory; None where the device cannot tell."""

    def reset_peak(self) -> None:
        """Start measuring the peak anew."""

    def peak(self) -> int | None:
        """The most bytes allocated since the last reset."""

    def free(self) -> tuple[int, int] | None:
        """Free and total bytes of the device now."""

    def release(self) -> None:
        """Give the allocator's cached blocks back to the device."""


class _Accelerator:
    """An accelerator's memory, through its PyTorch module (``torch.cuda``, ``torch.xpu``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.module: Any = getattr(torch, device.type)

    def reset_peak(self) -> None:
        reset = getattr(self.module, "reset_peak_memory_stats", None)
        if reset is not None:
            reset(self.device)

    def peak(self) -> int | None:
        measured = getattr(self.module, "max_memory_allocated", None)
        return None if measured is None else int(measured(self.device))

    def free(self) -> tuple[int, int] | None:
        read = getattr(self.module, "mem_get_info", None)
        if read is None:
            return None
        free, total = read(self.device)
        return int(free), int(total)

    def release(self) -> None:
        empty = getattr(self.module, "empty_cache", None)
        if empty is not None:
            empty()


class _Unmeasured:
    """A device whose memory devicekit cannot read (the CPU, meta)."""

    def reset_peak(self) -> None:
        pass

    def peak(self) -> int | None:
        return None

    def free(self) -> tuple[int, int] | None:
        return None

    def release(self) -> None:
        pass


MEMORY: dict[str, Callable[[torch.device], DeviceMemory]] = {}
"""Memory readers by device type, besides the built-in ones: the tests register a stand-in."""


def _memory_of(device: torch.device) -> DeviceMemory:
    made = MEMORY.get(device.type)
    if made is not None:
        return made(device)
    if device.type in ("cuda", "xpu"):
        return _Accelerator(device)
    return _Unmeasured()


@dataclasses.dataclass(frozen=True)
class BatchFit:
    """What :func:`fit_batch` found: the size to train at, and how it was found.

    >>> import torch, devicekit as dk
    >>> fit = dk.BatchFit(48, 2, (dk.BatchFit.Try(8, True), dk.BatchFit.Try(64, False)),
    ...                   torch.device("cpu"), "the largest size that fit")
    >>> fit.batch_size * fit.accumulation
    96
    """

    class Try(NamedTuple):
        """One step of the search: its size, whether it fit, its peak memory where known."""

        batch_size: int
        fitted: bool
        peak_memory: int | None = None
        """The most bytes allocated during the step; None where the device cannot tell."""

    batch_size: int
    """The per-step (per-rank) batch size to train at."""
    accumulation: int
    """Steps to accumulate gradients over to reach ``target``; 1 without it."""
    tries: tuple[BatchFit.Try, ...]
    """Every size run, in order, with its outcome and its peak memory where known."""
    device: torch.device
    reason: str
    """Why this size, in a sentence (the last line of :meth:`explain`)."""

    def explain(self) -> str:
        """A few lines: the size, every try, and why this size.

        >>> import torch, devicekit as dk
        >>> print(dk.BatchFit(48, 1, (dk.BatchFit.Try(64, False), dk.BatchFit.Try(48, True)),
        ...                   torch.device("cpu"), "the largest size that fit").explain())
        Batch size 48 on cpu.
        Tried: 64 out of memory, 48 fits.
        Chose 48: the largest size that fit.
        """
        times = f" (accumulating {self.accumulation} steps)" if self.accumulation > 1 else ""
        tried = ", ".join(_said(each) for each in self.tries)
        return (
            f"Batch size {self.batch_size}{times} on {self.device}.\n"
            f"Tried: {tried}.\n"
            f"Chose {self.batch_size}: {self.reason}."
        )


def _said(each: BatchFit.Try) -> str:
    peak = "" if each.peak_memory is None else f" ({nbytes(each.peak_memory)} peak)"
    return f"{each.batch_size} {'fits' if each.fitted else 'out of memory'}{peak}"


def fit_batch(
    step: Callable[[int], object],
    /,
    *,
    start: int = 8,
    limit: int | None = None,
    target: int | None = None,
    headroom: float = 0.0,
    device: DeviceLike | None = None,
    restore: object = (),
) -> BatchFit:
    """The largest batch size whose training step fits in the device's memory.

    ``step(batch_size)`` runs one real step at that size: forward, backward and the
    optimizer's step, on your data. The search grows from ``start`` until a step runs
    out of memory (never past ``limit``), then narrows to within a tenth of the largest
    size that fits, in about ``2 * log2(limit / start)`` steps at most. Only running out
    of memory is caught: any other error of the step reaches you at once, unchanged.
    Each failed try is freed before the next (``step`` should start with
    ``optimizer.zero_grad(set_to_none=True)``, so that a failed step's gradients go too).

    The steps train whatever they use. Name your model and optimizer in ``restore`` and
    they are put back exactly as they were once the search ends, however it ends (a
    size found, an error, Ctrl-C): every parameter and buffer value (in place: the
    tensors your optimizer holds stay the same), every gradient, every submodule's
    ``training`` flag, the optimizer's state and every value of its ``param_groups`` (its
    ``lr`` too), into the same dicts and tensors: a group you or an LR scheduler hold
    still steers it. The copy is kept on the host, so it takes none of the memory the
    search measures, and dropped after. The global
    random generators (PyTorch's CPU one and the device's, Python's ``random``, NumPy's
    global one where NumPy is loaded) are put back too, with or without ``restore``: a
    seeded run trains the same after the search as without it, whatever sizes this
    machine's memory made it try.

    >>> import torch, devicekit as dk
    >>> def step(batch_size):  # a stand-in: a real step runs out of memory by itself
    ...     if batch_size > 100:
    ...         raise torch.OutOfMemoryError("CUDA out of memory")
    >>> fit = dk.fit_batch(step, limit=1024, device="cpu")
    >>> fit.batch_size, len(fit.tries)
    (96, 8)

    With the model and optimizer a real step trains:

    >>> model = torch.nn.Linear(4, 2)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    >>> weight = model.weight.detach().clone()
    >>> def train_step(batch_size):
    ...     optimizer.zero_grad(set_to_none=True)
    ...     model(torch.randn(batch_size, 4)).square().mean().backward()
    ...     optimizer.step()
    >>> fit = dk.fit_batch(train_step, limit=64, device="cpu", restore=(model, optimizer))
    >>> torch.equal(model.weight, weight), model.weight.grad, optimizer.state_dict()["state"]
    (True, None, {})
    >>> group = optimizer.param_groups[0]
    >>> fit = dk.fit_batch(train_step, limit=64, device="cpu", restore=(model, optimizer))
    >>> optimizer.param_groups[0] is group
    True

    Args:
        step: Runs one training step at the batch size it is given.
        start: The first size tried.
        limit: The largest size tried; None for no limit but running out of memory
            (and 1,048,576 on devices that never do, such as the CPU).
        target: A global batch size: the found size is used up to it, and
            ``accumulation`` says how many steps to accumulate (over every rank of a
            process group) to reach it.
        headroom: The share of the device's memory to keep free (0.1: 10%), for later
            batches larger than the probe's: the size shrinks until its measured peak
            leaves it free.
        device: Where the step runs; None for :func:`~devicekit.current_device`.
        restore: What the steps change and the search puts back: a module, an
            optimizer, anything with ``state_dict()`` and ``load_state_dict()`` (an LR
            scheduler, a ``GradScaler``), or a tuple of them.

    Returns:
        The size, the accumulation, and every try.

    Raises:
        DeviceKitError: Not even a batch of 1 fits: the message names the device, its
            free memory and what was tried. Under a process group, also where the ranks
            were given different ``start``, ``limit``, ``target`` or ``headroom`` (every
            rank raises it, before any try), where another rank stopped the search, and
            where the step synchronises the gradients of a DistributedDataParallel
            named in ``restore``.
        ValueError: An option is out of range.
        TypeError: ``step`` is not callable, or ``restore`` holds something that
            cannot be put back (a module whose parameters are not initialised yet: a lazy
            module before its first forward).
    """
    ranks = _Ranks()
    options: dict[str, int | float | None] = {
        "start": start,
        "limit": limit,
        "target": target,
        "headroom": headroom,
    }
    kept, wrappers, where, refusal = None, [], None, None
    try:
        _check(step, start, limit, target, headroom)
        entries = _restorable(restore)
        where = current_device() if device is None else resolve_device(device)
        wrappers = _wrappers(entries)
        options["wrappers"] = len(wrappers)
        kept = _Kept(entries, where)
    except Exception as error:  # raised below, once the other ranks hear of it
        refusal = error
    ranks.agree_on(options, refusal, where)
    assert kept is not None  # for mypy: refused above otherwise
    assert where is not None
    try:
        with _Watch(wrappers) as watch:
            return _search(_Search(step, _memory_of(where), where, ranks, watch), options)
    finally:
        kept.put_back()


def _search(search: _Search, options: dict[str, Any]) -> BatchFit:
    """The search itself, with options every rank agreed on."""
    start, limit, target, headroom = (options[name] for name in _AGREED[:4])
    ceiling = _MOST if limit is None else limit
    if target is not None:
        ceiling = min(ceiling, max(1, math.ceil(target / search.ranks.count)))
    start = min(start, ceiling)
    best, failed = search.grow(start, ceiling)
    if best is None:
        best, failed = search.down_from(start)
    if failed is not None:
        best, failed = search.narrow(best, failed)
    reason = (
        f"the largest size that fit, within a tenth of {failed}, the first that did not"
        if failed is not None
        else f"{'the target' if target is not None and best == ceiling else 'the limit'} "
        f"({best}) fit"
    )
    if headroom > 0:
        best, reason = search.leave_room(best, headroom, reason)
    count = search.ranks.count
    accumulation = 1 if target is None else max(1, math.ceil(target / (best * count)))
    return BatchFit(best, accumulation, tuple(search.tries), search.device, reason)


def _check(step: object, start: object, limit: object, target: object, headroom: object) -> None:
    if not callable(step):
        msg = f"Expected step to be a function of a batch size, got {type(step).__name__}."
        raise TypeError(msg)
    for name, value in (("start", start), ("limit", limit), ("target", target)):
        if value is None and name != "start":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            msg = f"Expected {name} to be a whole number of 1 or more, got {shown(value)}."
            raise ValueError(msg)
    if isinstance(limit, int) and isinstance(start, int) and limit < start:
        msg = f"Expected limit to be at least start ({start}), got {limit}."
        raise ValueError(msg)
    if not isinstance(headroom, int | float) or isinstance(headroom, bool) or not 0 <= headroom < 1:
        msg = f"Expected headroom to be a share between 0 and 1 (0.1: 10%), got {shown(headroom)}."
        raise ValueError(msg)


def _restorable(restore: object) -> tuple[object, ...]:
    """The entries of ``restore=``, each one a module or has a state to save and load."""
    if isinstance(restore, nn.Module) or _stateful(restore):
        if isinstance(restore, nn.Module):
            _refuse_uninitialised(restore, "restore")
        return (restore,)
    if not isinstance(restore, tuple | list):
        msg = (
            "Expected restore to be a module, an optimizer, an object with state_dict() "
            "and load_state_dict(), or a tuple of them such as restore=(model, optimizer), "
            f"got {type(restore).__name__}."
        )
        raise TypeError(msg)
    for index, entry in enumerate(restore):
        if not isinstance(entry, nn.Module) and not _stateful(entry):
            msg = (
                f"Expected restore[{index}] to be a module, an optimizer or an object with "
                f"state_dict() and load_state_dict(), got {type(entry).__name__}: "
                "fit_batch could not put it back after the search."
            )
            raise TypeError(msg)
        if isinstance(entry, nn.Module):
            _refuse_uninitialised(entry, f"restore[{index}]")
    return tuple(restore)


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


def _wrappers(entries: Sequence[object]) -> list[nn.parallel.DistributedDataParallel]:
    """The DistributedDataParallel modules named in ``restore=``, or held by one named there."""
    found: dict[int, nn.parallel.DistributedDataParallel] = {}
    for entry in entries:
        if isinstance(entry, nn.Module):
            for module in entry.modules():
                if isinstance(module, nn.parallel.DistributedDataParallel):
                    found[id(module)] = module
    return list(found.values())


_AGREED: Final = ("start", "limit", "target", "headroom", "wrappers")
"""The options that shape the search, so that every rank must be given the same."""


class _Ranks:
    """This process's place in a process group, if any, and the all-reduces of the search."""

    def __init__(self) -> None:
        distributed = torch.distributed
        self.grouped = distributed.is_available() and distributed.is_initialized()
        self.count = distributed.get_world_size() if self.grouped else 1
        self.device = _HOST

    def agree_on(
        self,
        options: dict[str, int | float | None],
        refusal: Exception | None,
        device: torch.device | None,
    ) -> None:
        """Refuse, on every rank at once, options that are out of range or differ.

        One all-reduce (MIN) of ``[ok, code, -code, ...]`` gives every rank whether all
        are ready, and the least and the most of each option over the ranks.
        """
        if self.grouped and torch.distributed.get_backend() == "nccl":
            # NCCL reduces on the device only: the search's, or (refused) the current one.
            self.device = current_device() if device is None else device
        if not self.grouped:
            if refusal is not None:
                raise refusal
            return
        codes = [0] * len(_AGREED) if refusal is not None else [_code(options[n]) for n in _AGREED]
        agreed = self.least([int(refusal is None), *(x for code in codes for x in (code, -code))])
        if refusal is not None:
            raise refusal
        if agreed[0] == 0:
            msg = (
                "Cannot fit the batch: another rank's fit_batch refused its arguments "
                "before the first try (its own error says why), so this rank stops too."
            )
            raise DeviceKitError(msg)
        differ = []
        for index, name in enumerate(_AGREED):
            least, most = agreed[1 + 2 * index], -agreed[2 + 2 * index]
            if least != most:
                differ.append(_differs(name, least, most))
        if differ:
            msg = (
                f"{'; '.join(differ)}. Pass the same start, limit, target, headroom and "
                "restore= on every rank: ranks that search differently make different "
                "collective calls, and the group goes out of step. No rank tried a size."
            )
            raise DeviceKitError(msg)

    def smallest(self, value: int) -> int:
        """The smallest of every rank's ``value``: one all-reduce (MIN) under a group.

        Every branch of the search follows values agreed so, so that every rank takes
        the same sizes and makes the same collective calls: none waits for another.
        """
        return value if not self.grouped else self.least([value])[0]

    def least(self, values: list[int]) -> list[int]:
        """The least of each of ``values`` over the ranks (one all-reduce)."""
        distributed = torch.distributed
        flags = torch.tensor(values, device=self.device, dtype=torch.int64)
        try:
            distributed.all_reduce(flags, op=distributed.ReduceOp.MIN)
        except RuntimeError as error:
            msg = (
                "Expected every rank to reach fit_batch's all-reduce, but it failed: a rank "
                "left the search, or the ranks' collective calls went out of step. A rank "
                "that runs out of memory inside a step of DistributedDataParallel leaves the "
                "others in its gradient all-reduce: search with the module outside its "
                "wrapper (ddp.module) or under ddp.no_sync() (see the guide, 'The largest "
                f"batch that fits'). The process group said: {error}"
            )
            raise DeviceKitError(msg) from error
        return [int(each) for each in flags.tolist()]


def _code(value: int | float | None) -> int:
    """An option as a whole number: None 0, a share its float's bits (ordered, as it is >= 0)."""
    if value is None:
        return 0
    if isinstance(value, float):
        bits: int = struct.unpack("<q", struct.pack("<d", value + 0.0))[0]  # -0.0 is 0.0
        return bits
    return min(int(value), 2**62)  # in an int64, negated too; no batch is larger


def _differs(name: str, least: int, most: int) -> str:
    if name == "wrappers":
        return (
            "restore= names a different number of DistributedDataParallel modules on "
            f"different ranks: {least} on some, {most} on others"
        )

    def said(code: int) -> str:
        if name == "headroom":
            return shown(struct.unpack("<d", struct.pack("<q", code))[0])
        return "None" if code == 0 else str(code)

    return f"{name} differs between ranks: {said(least)} on some, {said(most)} on others"


class _Kept:
    """A host copy of what ``restore=`` names, and of the random generators, put back once.

    Module tensors go back in place (an optimizer holds them), gradients in place where
    the step left one of the same shape; an optimizer's groups and state into the same
    objects (:class:`_KeptOptimizer`); other objects through their own
    ``load_state_dict``, from a copy of their ``state_dict`` made by :func:`to_device`.
    """

    def __init__(self, entries: Sequence[object], device: torch.device) -> None:
        self.tensors: list[tuple[torch.Tensor, torch.Tensor]] = []  # (the live one, its copy)
        self.grads: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.flags: list[tuple[nn.Module, bool]] = []
        self.states: list[Callable[[], object]] = []  # each puts one object's state back
        seen: set[int] = set()
        for entry in entries:
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

    def put_back(self) -> None:
        """Put everything back as it was, then drop the copy."""
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

    ``load_state_dict`` would put new dicts in ``param_groups``: a group that the user
    or an LR scheduler holds would then no longer steer the optimizer. Here the list,
    each group's dict, the ``state`` mapping and each parameter's dict stay the objects
    they were, with the keys they had (keys added during the search go, keys removed
    come back) and their values as they were, tensors in place. A group's ``params`` are
    the optimizer's own and are left alone.
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

    Containers are copied (a step may append to a list in place) and given back as
    copies; each tensor goes back into the tensor it was, in place (a compiled step, a
    scheduler or the user may hold it: a tensor ``lr`` is filled in place by schedulers).
    Other leaves are kept as they are, as ``load_state_dict`` keeps them.
    """

    def __init__(self, value: object) -> None:
        self.tensors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by id of the copy
        self.copy = _tree.map_leaves(self._keep, value, root=None)

    def _keep(self, leaf: Any, _: object) -> Any:
        if not isinstance(leaf, torch.Tensor) or leaf.is_meta:  # meta: no values to keep
            return leaf
        copy = leaf.detach().to(_HOST, copy=True)
        self.tensors[id(copy)] = (leaf, copy)
        return copy

    def value(self) -> Any:
        """The value as it was: its containers anew, its tensors the same, refilled."""
        return _tree.map_leaves(self._back, self.copy, root=None)

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
    backend: Any = getattr(torch, device.type, None) if device.type not in ("cpu", "meta") else None
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


class _Watch:
    """The DistributedDataParallel modules named in ``restore=``: what each try synchronised.

    A forward pre-hook reads what the forward is about to synchronise, a forward hook
    that it ended. Both are removed when the search ends.
    """

    def __init__(self, wrappers: Sequence[nn.Module]) -> None:
        self.wrappers = wrappers
        self.handles: list[Any] = []
        self.gradients = False
        """A forward of this try began that synchronises gradients in its backward."""
        self.broadcasting: set[int] = set()
        """The wrappers whose forward began broadcasting buffers and did not end."""

    def __enter__(self) -> _Watch:
        for wrapper in self.wrappers:
            self.handles.append(wrapper.register_forward_pre_hook(self._began))
            self.handles.append(wrapper.register_forward_hook(self._ended))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()

    def start(self) -> None:
        self.gradients, self.broadcasting = False, set()

    def _began(self, module: nn.Module, args: object) -> None:
        syncs = ddp_forward_syncs(module)
        self.gradients = self.gradients or syncs.gradients
        if syncs.buffers:
            self.broadcasting.add(id(module))

    def _ended(self, module: nn.Module, args: object, output: object) -> None:
        self.broadcasting.discard(id(module))


class _Search:
    """The tries of one search, on one rank, agreed with the others where there are any."""

    def __init__(
        self,
        step: Callable[[int], object],
        memory: DeviceMemory,
        device: torch.device,
        ranks: _Ranks,
        watch: _Watch,
    ) -> None:
        self.step, self.memory, self.device = step, memory, device
        self.ranks, self.watch = ranks, watch
        self.tries: list[BatchFit.Try] = []

    def fits(self, size: int) -> bool:
        """Run the step at ``size``: whether it fit, on every rank."""
        self.memory.reset_peak()
        self.watch.start()
        try:
            self.step(size)
        except Exception as error:
            if not is_out_of_memory(error):
                if not self.watch.gradients:  # else DDP's all-reduce may hold the others
                    self._tell_the_others()
                raise
            self._stop_where_out_of_step(size, error)
            outcome = _OUT_OF_MEMORY
        else:
            self._stop_where_out_of_step(size, None)
            outcome = _FIT
        peak = self.memory.peak() if outcome == _FIT else None
        if outcome == _OUT_OF_MEMORY:
            # Here, out of the except block, the failed step's frames and their tensors
            # went with its exception; what is left in cycles goes now, and the cache the
            # failed step grew goes back to the device. (A step that fit freed its own:
            # a collection with PyTorch loaded costs 0.1-0.2 s, once per failure is enough.)
            gc.collect()
            self.memory.release()
        agreed = self._agree(outcome)
        self.tries.append(BatchFit.Try(size, agreed == _FIT, peak))
        return agreed == _FIT

    def _stop_where_out_of_step(self, size: int, out_of_memory: BaseException | None) -> None:
        """Raise where a DistributedDataParallel named in restore= makes agreeing unsafe.

        Gradients synchronised in a try: on every rank, at the same try, since every
        rank runs the same step; none calls the all-reduce of the try, which a rank
        out of memory inside the step would meet with DDP's own. A forward stopped while
        it broadcast buffers: this rank's next forward would broadcast again, the
        others' not; the others hear of it through the try's all-reduce.
        """
        if self.watch.gradients:
            where = (
                f" This rank ran out of memory at batch size {size}; the other ranks may wait "
                "in that all-reduce until this process ends."
                if out_of_memory is not None
                else ""
            )
            msg = (
                "Cannot search with a step that synchronises the gradients of a "
                "DistributedDataParallel named in restore=: where one rank runs out of "
                "memory inside such a step and another does not, the other waits in its "
                "gradient all-reduce, and the process group hangs or aborts. Run the step "
                "on the wrapped module (ddp.module) or under ddp.no_sync(), keep "
                f"restore=(ddp, optimizer), and train with the wrapper as usual.{where}"
            )
            raise DeviceKitError(msg) from out_of_memory
        if self.watch.broadcasting and out_of_memory is not None:
            self._tell_the_others()
            msg = (
                f"Cannot go on fitting the batch: the step ran out of memory at batch size "
                f"{size} inside the forward of a DistributedDataParallel that broadcasts its "
                "buffers, so this rank's next forward would broadcast them again and the "
                "other ranks' would not. Run the step on the wrapped module (ddp.module), "
                "or build the wrapper with forward_sync_buffers=False (broadcast_buffers=False "
                "in older PyTorch)."
            )
            raise DeviceKitError(msg) from out_of_memory

    def _tell_the_others(self) -> None:
        """Stop the other ranks too, at this try's all-reduce, rather than wait for this one."""
        with contextlib.suppress(DeviceKitError):  # the group failed: this rank's error says more
            self._agree(_FAILED)

    def _agree(self, outcome: int) -> int:
        """The worst outcome of this try over every rank."""
        agreed = self.ranks.smallest(outcome)
        if agreed == _FAILED and outcome != _FAILED:
            msg = (
                "Cannot go on fitting the batch: another rank's step raised an error, "
                "or ran out of memory where the ranks cannot go on together (its own "
                "traceback says which)."
            )
            raise DeviceKitError(msg)
        return agreed

    def grow(self, start: int, ceiling: int) -> tuple[int | None, int | None]:
        """Double from ``start`` until a size fails or ``ceiling`` fits: (fits, failed)."""
        size, best = start, None
        while True:
            if not self.fits(size):
                return best, size
            best = size
            if size >= ceiling:
                return best, None
            size = min(size * 2, ceiling)

    def down_from(self, start: int) -> tuple[int, int]:
        """Halve below a ``start`` that failed, to 1: (fits, the smallest that failed)."""
        failed, size = start, start // 2
        while size >= 1:
            if self.fits(size):
                return size, failed
            failed, size = size, size // 2
        free = self.memory.free()
        said = "" if free is None else f" ({nbytes(free[0])} free of {nbytes(free[1])})"
        tried = ", ".join(str(each.batch_size) for each in self.tries)
        msg = (
            f"Cannot fit a batch on {self.device}{said}: every size tried ran out of memory, "
            f"down to 1 (tried {tried}). Make a step smaller (mixed precision, gradient "
            "checkpointing, a smaller model), or use a device with more memory."
        )
        raise DeviceKitError(msg)

    def narrow(self, fits: int, failed: int) -> tuple[int, int]:
        """Between a size that fits and a larger one that failed, to within a tenth.

        Returns (the largest size that fit, the smallest that failed).
        """
        while failed - fits > max(1, int(fits * _NEAR)):
            middle = (fits + failed) // 2
            if self.fits(middle):
                fits = middle
            else:
                failed = middle
        return fits, failed

    def leave_room(self, size: int, headroom: float, reason: str) -> tuple[int, str]:
        """Shrink ``size`` until its measured peak leaves ``headroom`` of the memory free."""
        smallest = self.ranks.smallest
        free = self.memory.free()
        peak = next(
            (each.peak_memory for each in reversed(self.tries) if each.batch_size == size), None
        )
        if not smallest(int(free is not None and peak is not None)):
            # Nothing to measure (on some rank): the share itself, off the size.
            smaller = smallest(max(1, math.floor(size * (1 - headroom))))
            return smaller, f"{reason}; {headroom:.0%} less for headroom (peak memory unknown)"
        assert free is not None  # for mypy: agreed above
        allowed = (1 - headroom) * free[1]
        while True:
            wanted = size
            if peak is not None and peak > allowed:
                wanted = max(1, min(size - 1, math.floor(size * allowed / peak)))
            wanted = smallest(wanted)
            if wanted == size:
                break
            size = wanted
            if self.fits(size):
                peak = self.tries[-1].peak_memory
            # Where even the smaller size ran out of memory, the old peak shrinks it again.
        return (
            size,
            f"{reason}; its peak fits under {nbytes(int(allowed))} ({headroom:.0%} headroom)",
        )
