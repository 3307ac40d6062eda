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
reset. Under a process group every rank takes the same sizes, agreed try by try
(:mod:`devicekit._memory._ranks`); what the tries trained is put back by
:mod:`devicekit._memory._restore`.

What the device can tell of its memory sits behind one small seam, :data:`MEMORY`, as
the loader's streams do: the tests stand in for a GPU there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
from collections.abc import Callable
from typing import Any, Final, NamedTuple, Protocol

import torch

from devicekit._base import (
    DeviceKitError,
    DeviceLike,
    current_device,
    is_out_of_memory,
    nbytes,
    privateuse1_name,
    resolve_device,
    shown,
    whole_number,
)
from devicekit._memory._ranks import AGREED, Ranks, Watch, ddp_wrappers
from devicekit._memory._restore import Kept, restorable

__all__ = ["MEMORY", "BatchFit", "DeviceMemory", "fit_batch"]

_NEAR: Final = 0.10
"""The search stops narrowing once the size that fits is within this share of the one
that did not: at least 90% of the largest size that fits, in a few more tries."""
_MOST: Final = 2**20
"""The largest size tried without a ``limit``, on devices that never run out of memory."""
_FIT, _OUT_OF_MEMORY, _FAILED = 1, 0, -1  # what a try came to, as ranks agree on it


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


class _Readings:
    """A device's memory, through its PyTorch module (``torch.cuda``, ``torch.xpu``).

    A backend registered as PrivateUse1 (the stand-in of :mod:`devicekit.testing`) is read
    through its own module too, where that has CUDA's functions. Other devices (the CPU,
    meta) have none here: nothing to read, nothing to release.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        own = device.type == privateuse1_name()
        read = device.type in ("cuda", "xpu") or own
        self.module: Any = getattr(torch, device.type, None) if read else None

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


MEMORY: dict[str, Callable[[torch.device], DeviceMemory]] = {}
"""Memory readers by device type, besides the built-in ones: the tests register a stand-in."""


def _memory_of(device: torch.device) -> DeviceMemory:
    return MEMORY.get(device.type, _Readings)(device)


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
    still steers it. A ``GradScaler`` named there gets back its scale and growth tracker,
    and is left between two steps after each try that ran out of memory and at the end:
    a step stopped after ``scaler.unscale_(optimizer)`` leaves the next one free to unscale.
    The copy is kept on the host, so it takes none of the memory the
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
        TypeError: ``step`` is not callable, ``start``, ``limit`` or ``target`` is no whole
            number, or ``restore`` holds something that cannot be put back (a module
            whose parameters are not initialised yet: a lazy module before its first
            forward); or ``device`` is of the wrong type.
        DeviceUnavailableError: ``device`` does not parse or is not on this machine.
    """
    ranks = Ranks()
    options: dict[str, int | float | None] = {
        "start": start,
        "limit": limit,
        "target": target,
        "headroom": headroom,
    }
    kept, wrappers, where, refusal = None, [], None, None
    try:
        options.update(_checked(step, start, limit, target, headroom))
        entries = restorable(restore)
        where = current_device() if device is None else resolve_device(device)
        wrappers = ddp_wrappers(entries)
        options["wrappers"] = len(wrappers)
        kept = Kept(entries, where)
    except Exception as error:  # raised below, once the other ranks hear of it
        refusal = error
    ranks.agree_on(options, refusal, where)
    assert kept is not None  # for mypy: refused above otherwise
    assert where is not None
    try:
        with Watch(wrappers) as watch:
            search = _Search(
                step, _memory_of(where), where, ranks, watch, between_steps=kept.between_steps
            )
            return _search(search, options)
    finally:
        kept.put_back()


def _search(search: _Search, options: dict[str, Any]) -> BatchFit:
    """The search itself, with options every rank agreed on."""
    start, limit, target, headroom = (options[name] for name in AGREED[:4])
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


def _checked(
    step: object, start: object, limit: object, target: object, headroom: object
) -> dict[str, int | None]:
    """The batch sizes asked for, each an int (None: not given), once every option passed."""
    if not callable(step):
        msg = f"Expected step to be a function of a batch size, got {type(step).__name__}."
        raise TypeError(msg)
    sizes = {
        name: None if value is None and name != "start" else whole_number(value, 1, name)
        for name, value in (("start", start), ("limit", limit), ("target", target))
    }
    first, most = sizes["start"], sizes["limit"]
    if first is not None and most is not None and most < first:
        msg = f"Expected limit to be at least start ({first}), got {most}."
        raise ValueError(msg)
    if not isinstance(headroom, int | float) or isinstance(headroom, bool) or not 0 <= headroom < 1:
        msg = f"Expected headroom to be a share between 0 and 1 (0.1: 10%), got {shown(headroom)}."
        raise ValueError(msg)
    return sizes


class _Search:
    """The tries of one search, on one rank, agreed with the others where there are any."""

    def __init__(
        self,
        step: Callable[[int], object],
        memory: DeviceMemory,
        device: torch.device,
        ranks: Ranks,
        watch: Watch,
        *,
        between_steps: Callable[[], None],
    ) -> None:
        self.step, self.memory, self.device = step, memory, device
        self.ranks, self.watch, self.between_steps = ranks, watch, between_steps
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
            self.watch.stop_where_out_of_step(size, error, self._tell_the_others)
            outcome = _OUT_OF_MEMORY
        else:
            self.watch.stop_where_out_of_step(size, None, self._tell_the_others)
            outcome = _FIT
        peak = self.memory.peak() if outcome == _FIT else None
        if outcome == _OUT_OF_MEMORY:
            # Here, out of the except block, the failed step's frames and their tensors
            # went with its exception; what is left in cycles goes now, and the cache the
            # failed step grew goes back to the device. (A step that fit freed its own:
            # a collection with PyTorch loaded costs 0.1-0.2 s, once per failure is enough.)
            # A GradScaler the step left halfway (after unscale_) is left between steps.
            self.between_steps()
            gc.collect()
            self.memory.release()
        agreed = self._agree(outcome)
        self.tries.append(BatchFit.Try(size, agreed == _FIT, peak))
        return agreed == _FIT

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
        """From a size that fits and a larger one that failed to within a tenth: (fits, failed)."""
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
