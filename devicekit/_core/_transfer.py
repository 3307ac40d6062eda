"""to_device: move tensors, modules, optimizers and nested batches to a device.

A call finds its :class:`_Plan` (cached per device and options, with the plan's mover)
and crosses into the engine once: ``_tree.map_leaves(plan.move, ...)`` for host targets,
``_tree.map_flat(plan.move_all, ...)`` for accelerators, whose small tensors go packed
(:mod:`devicekit._core._packing`). The mover and what one call keeps are in
:mod:`devicekit._core._call`; anything but a tensor moves as the table says its type does
(:mod:`devicekit._core._moves`).
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator
from typing import Any, Final, Literal, NamedTuple, TypeAlias, TypeVar

import torch

from devicekit._base import (
    HOST_TYPES,
    DeviceKitError,
    DeviceLike,
    DeviceUnavailableError,
    TransferError,
    current_device,
    one_graph,
    raise_past_the_compiler,
    resolve_device,
    run_while_tracing,
)
from devicekit._core import _packing, _tree
from devicekit._core._call import REMEMBER, Call, TracedCall, mover, traced_mover

T = TypeVar("T")
NonBlocking: TypeAlias = bool | Literal["auto"]
"""``"auto"``, True or False; see :func:`to_device`."""

_Tensor = torch.Tensor  # one global lookup on the hot path instead of two
_is_compiling = torch.compiler.is_compiling  # likewise; torch.compile knows the function


class Options(NamedTuple):
    """to_device's options, each under its one name."""

    non_blocking: NonBlocking = "auto"
    dtype: torch.dtype | None = None
    copy: bool = False
    memory_format: torch.memory_format | None = None
    strict: bool = False


_DEFAULTS: Final = Options()


def _check(options: Options) -> Options:
    """The options, checked; ``preserve_format`` is the same as no memory format."""
    given: tuple[object, ...] = options  # as objects: untyped callers pass anything
    non_blocking, dtype, copy, memory_format, strict = given
    for name, value in (("copy", copy), ("strict", strict)):
        if value is not True and value is not False:
            msg = f"Expected {name} to be True or False, got {value!r}."
            raise TypeError(msg)
    if not (non_blocking is True or non_blocking is False or (non_blocking == "auto") is True):
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


def _skip_set(keys: object) -> frozenset[Hashable] | None:
    """``skip_keys`` as a set: one key alone (a string is not its letters, 5 is key 5), or many."""
    one = isinstance(keys, str | bytes) or not isinstance(keys, Iterable)
    try:
        found = frozenset((keys,) if one else keys)  # type: ignore[call-overload]
    except TypeError:
        msg = (
            "Expected skip_keys to be a mapping key such as 'raw_text', or a collection of "
            f"hashable keys, got {type(keys).__name__} {keys!r}: "
            + ("a key must be hashable." if one else "each of its items must be a hashable key.")
        )
        raise TypeError(msg) from None
    return found or None


_simulated: set[str] = set()


@contextlib.contextmanager
def as_accelerator(device_type: str) -> Iterator[None]:
    """Move data to ``device_type`` (``"meta"``) as to an accelerator, packing included.

    For the tests and the host-side benchmark, on machines without one.
    """
    _simulated.add(device_type)
    _plans.clear()
    try:
        yield
    finally:
        _simulated.discard(device_type)
        _plans.clear()


class _Plan:
    """What a call's device and options imply, worked out once, with its mover.

    It holds the one rule for ``non_blocking`` (:meth:`asynchronous`), and whether the
    stand-in for an accelerator (:func:`as_accelerator`) is in use, read here once.
    """

    __slots__ = (
        "call",
        "device",
        "host",
        "kept",
        "move",
        "move_all",
        "options",
        "packs",
        "pins",
        "plain",
        "told",
        "traced",
        "waits",
    )

    def __init__(self, device: torch.device, options: Options, *, traced: bool = False) -> None:
        simulated = device.type in _simulated
        to_accelerator = device.type not in HOST_TYPES or simulated
        self.device, self.options, self.pins, self.traced = device, options, not simulated, traced
        self.call: type[Call] = TracedCall if traced else Call
        self.plain = options.dtype is None and not options.copy and options.memory_format is None
        self.packs = (  # not in a compiled graph: its copies are the compiler's to plan
            not traced
            and to_accelerator
            and options.memory_format is None
            and (_packing.packs_to(device) or (simulated and _packing.can_pack))
        )
        auto = options.non_blocking == "auto"
        self.host = not to_accelerator
        # Copies to the host (not to meta, which copies nothing) that the call waits for
        # once before it returns, under "auto" (Call.finish); none in a compiled graph.
        self.waits = auto and self.host and device.type != "meta" and not traced
        # What objects moving themselves, modules, rules and packed copies are told: no
        # wait can be had for them, so asynchronous only where nothing must wait.
        self.told = device.type != "mps" and (
            bool(options.non_blocking) if not auto else to_accelerator
        )
        self.move, self.move_all = (
            traced_mover(self)
            if traced
            else mover(self, is_meta=device.type == "meta" and not simulated)
        )
        # The tensors the mover gives back as they are, read as it reads them: a flat
        # batch of them is copied without a call per tensor. In a loop of tiny steps,
        # whose PyTorch step leaves little of devicekit in the CPU's caches, to_device((x,
        # y), "cpu") took 12.1-17.2 us a step and takes 9.4-13.6, the loader's batch
        # 13.3-18.7 and 10.7-15.1 (benchmarks/bench_tiny_steps.py); alone, 2.8 and 2.1.
        self.kept: tuple[type, Callable[[torch.Tensor], bool]] | None = (
            (_Tensor, operator.attrgetter("is_cpu" if device.type == "cpu" else "is_meta"))
            if self.host and self.plain and not traced
            else None
        )

    def asynchronous(self, source: torch.device, target: torch.device) -> bool:
        """Whether a tensor's copy from ``source`` to ``target`` is asynchronous: the rule.

        Under ``"auto"``: to an accelerator, yes (a pinned source overlaps); to the host,
        from an accelerator, yes, and the call waits for it once before it returns;
        host to host, no: there is nothing to overlap. True and False apply as asked.
        Copies to MPS, and from it under ``"auto"``, block whatever is asked, as
        Lightning's and Ultralytics' do: PyTorch's asynchronous MPS copies can corrupt
        data silently (pytorch#139550, #189690). In a compiled graph, a copy that would
        be waited for is blocking: a graph holds no event to wait on.
        """
        if target.type == "mps":
            return False
        if self.options.non_blocking != "auto":
            return bool(self.options.non_blocking)
        host = self.host if target.type == self.device.type else target.type in HOST_TYPES
        return not host or (
            not self.traced and source.type not in HOST_TYPES and source.type != "mps"
        )


_plans: dict[object, _Plan] = {}


def _plan(device: DeviceLike | None, options: Options) -> _Plan:
    defaults = options is _DEFAULTS
    # The usual call is keyed by the device alone. A torch.device found there was
    # resolved already; one without an index ("cuda": the current one) is resolved anew.
    plan = _plans.get(device) if defaults and type(device) is torch.device else None
    if plan is None:
        options = options if defaults else _check(options)
        target = current_device() if device is None else resolve_device(device)
        key = target if defaults else (target, options)
        plan = _plans.get(key)
        if plan is None:
            if len(_plans) >= 256:  # option values seen at run time must not pile up
                _plans.clear()
            plan = _plans[key] = _Plan(target, options)
    return plan


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

    Containers come back new, of their exact type; the input never changes, but for
    modules and optimizers, which move in place as :meth:`torch.nn.Module.to` does. A
    tensor found twice comes back as one, one already there as it is.

    >>> import torch, devicekit as dk
    >>> batch = {"image": torch.zeros(2, 3), "label": torch.tensor([1, 0]), "id": ["a", "b"]}
    >>> moved = dk.to_device(batch, "meta")
    >>> moved["image"].device, moved["id"]
    (device(type='meta'), ['a', 'b'])
    >>> dk.to_device(batch, "cpu", dtype=torch.float16)["image"].dtype
    torch.float16

    Args:
        data: Tensors, modules, optimizers, containers of them and of other objects.
            Objects with a ``.to()`` move with it, on a shallow copy; types registered
            with :func:`register_transfer` with their rule; other leaves stay as they are.
        device: A :class:`torch.device`, a string such as ``"cuda:1"``, an accelerator
            index, or None for :func:`~devicekit.current_device`.
        non_blocking: ``"auto"`` copies host->device asynchronously, and device->host
            and MPS copies too but waits for them once, so what comes back is safe to
            read. True and False apply to every copy, as in :meth:`torch.Tensor.to`.
        dtype: A floating-point dtype for floating-point tensors, inside objects moved
            by their own ``.to()`` too; integer and boolean tensors keep theirs.
        copy: Return new tensors even where they are already on the target.
        memory_format: ``torch.channels_last`` applies to 4-d tensors,
            ``torch.channels_last_3d`` to 5-d ones, as in :meth:`torch.nn.Module.to`.
        strict: Refuse leaves that cannot move and are not plain scalars.
        skip_keys: Keys whose values, in any mapping at any depth, stay as they are, as
            in accelerate's ``send_to_device`` (``"raw_text"``); one key may be alone.

    Returns:
        The data on ``device``, with the same structure.

    Raises:
        TransferError: Something cannot move (a meta tensor to a real device, a cycle, a
            ``.to()`` that returned None, a leaf ``strict`` refuses), named by its path,
            such as ``data['x'][2]``.
        DeviceUnavailableError: ``device`` does not parse or is not on this machine.
        ValueError: An option has a value outside those above.
        TypeError: ``device``, ``copy``, ``strict`` or ``skip_keys`` has a value of the
            wrong type.
    """
    options = (
        _DEFAULTS  # identity, not truth: copy="False" is a mistake, not True
        if (non_blocking == "auto") is True  # an array compares element by element
        and dtype is None
        and memory_format is None
        and copy is False
        and strict is False
        else Options(non_blocking, dtype, copy, memory_format, strict)
    )
    skip = None if type(skip_keys) is tuple and not skip_keys else _skip_set(skip_keys)
    if _is_compiling():
        return _traced(device, options, data, skip)  # type: ignore[no-any-return]
    return _run(_plan(device, options), data, skip)  # type: ignore[no-any-return]


def _traced(
    device: DeviceLike | None, options: Options, data: Any, skip: frozenset[Hashable] | None
) -> Any:
    """to_device in a region torch.compile traces: the same result, or devicekit's refusal.

    The device and options are checked in Python while the compiler traces (their
    results are constants of the graph). A refusal in a region that must be one graph
    (``fullgraph=True``) is handed to the compiler from outside the graph, so that the
    user reads devicekit's own error, not "Observed exception" around it; elsewhere it
    breaks the graph, and the call runs eagerly, as it would without the compiler.
    """
    try:
        if device is None:
            msg = (
                "Cannot move data inside torch.compile to the current device: devicekit reads "
                "it from a context the compiler cannot follow. Pass it, as "
                "to_device(x, 'cuda:0')."
            )
            raise TransferError(msg)
        refused, target, *checked = _traced_settings(device, *options)
        if refused >= 0:
            raise _REFUSALS[refused](target)
        return _run(_Plan(target, Options(*checked), traced=True), data, skip)
    except (DeviceKitError, ValueError, TypeError) as refusal:
        if one_graph():
            raise_past_the_compiler(type(refusal), str(refusal))
        raise


@run_while_tracing
def _traced_settings(device: DeviceLike, *options: Any) -> tuple[Any, ...]:
    """The device and options a compiled region asks for, checked as a call outside one does.

    ``(-1, device, *options)``, or ``(where its class is in _REFUSALS, message, ...)`` for
    a refusal, which the caller raises in traced code. Plain values in and out, not an
    Options, an error or its class: what the compiler takes back as constants.
    """
    try:
        return (-1, resolve_device(device), *_check(Options(*options)))
    except (DeviceKitError, ValueError, TypeError) as refused:
        kind = next(i for i, kind in enumerate(_REFUSALS) if isinstance(refused, kind))
        return (kind, str(refused), *options)


# Most specific first: what a refusal of the device or the options is raised as.
_REFUSALS: Final = (DeviceUnavailableError, TransferError, DeviceKitError, ValueError, TypeError)


def in_line_mover(device: torch.device) -> Callable[[Any], Any]:
    """``to_device(data, device)`` with the default options, its plan found once.

    DeviceDataLoader's move where batches move in line: a call skips the options and the
    plan's lookup, 0.7 to 0.9 us of a small batch's 3 to 5 on the CPU
    (benchmarks/bench_loader.py).
    """
    return functools.partial(_run, _plan(device, _DEFAULTS))


def _run(plan: _Plan, data: Any, skip: frozenset[Hashable] | None = None) -> Any:
    """The call's one crossing into the engine, made again where a tensor repeats."""
    call = plan.call(plan, [], None, skip)
    while True:
        if plan.packs:
            moved = _tree.map_flat(plan.move_all, data, call, skip=skip)
        elif plan.traced:
            moved = _tree.map_leaves(
                plan.move, data, call, skip=skip, max_depth=_tree.TRACED_MAX_DEPTH
            )
        else:
            moved = _tree.map_leaves(plan.move, data, call, skip=skip, kept=plan.kept)
        notes = call.notes
        if not notes or len(set(notes)) == len(notes):
            break
        call = plan.call(plan, REMEMBER, call.memo, skip)  # a tensor found twice: see Call
    if call.waits:
        call.finish()
    return moved
