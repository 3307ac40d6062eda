"""to_device: move tensors, modules, optimizers and nested batches to a device.

A call finds its :class:`Plan` (cached per device and options, with the plan's mover)
and crosses into the engine once: ``_tree.map_leaves(plan.move, ...)`` for host targets,
``_tree.map_flat(plan.move_all, ...)`` for accelerators, whose small tensors go packed
(:mod:`devicekit._core._packing`). A :class:`Call` is one to_device call: its memo (an
object moves once a call), the ids it copied, and the devices whose copies it waits for
before it returns. Anything but a tensor moves as the table says its type does
(:mod:`devicekit._core._moves`).
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Sequence
from typing import Any, Final, Literal, NamedTuple, TypeAlias, TypeVar

import torch

from devicekit._base import (
    HOST_TYPES,
    META,
    DeviceKitError,
    DeviceLike,
    DeviceUnavailableError,
    LeafError,
    TransferError,
    auto_or_flag,
    current_device,
    flag,
    mesh_of,
    new_event,
    one_graph,
    raise_past_the_compiler,
    resolve_device,
    run_while_tracing,
)
from devicekit._core import _packing, _tree
from devicekit._core._kinds import Leaf, leaf_how
from devicekit._core._moves import MOVES, keep

T = TypeVar("T")
NonBlocking: TypeAlias = bool | Literal["auto"]
"""``"auto"``, True or False; see :func:`to_device`."""

# One global lookup a tensor instead of two: without it, bench_to_device.py --quick (3
# alternated runs each) moved 64 per-image dicts cpu -> cpu in 69.5-127.7 us, not
# 64.3-66.4, cpu -> meta in 248.6-657.9, not 246.0-249.7, and the mixed batch in 7.2-20.4,
# not 6.6-7.1.
_Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling  # likewise; torch.compile knows the function
_UNSEEN: Any = object()
REMEMBER: Final[list[int]] = []
"""Call.notes where tensors move through the memo: a call whose notes repeat, made again."""


class Options(NamedTuple):
    """to_device's options, each under its one name."""

    non_blocking: NonBlocking = "auto"
    dtype: torch.dtype | None = None
    copy: bool = False
    memory_format: torch.memory_format | None = None
    strict: bool = False


_DEFAULTS: Final = Options()


def _check(options: Options) -> Options:
    """The options, checked, each flag as Python's; ``preserve_format`` is no memory format."""
    given: tuple[object, ...] = options  # as objects: untyped callers pass anything
    non_blocking, dtype, copy, memory_format, strict = given
    checked = (
        auto_or_flag(non_blocking, "non_blocking"),
        flag(copy, "copy"),
        flag(strict, "strict"),
    )
    if checked[0] is not non_blocking or checked[1] is not copy or checked[2] is not strict:
        # numpy's bools, made Python's: rebuilt only then, as _replace costs 1 us a call
        options = options._replace(non_blocking=checked[0], copy=checked[1], strict=checked[2])
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


class Plan:
    """What a call's device and options imply, worked out once, with its mover.

    It holds the one rule for ``non_blocking`` (:meth:`copy`), which the mover, the
    calls, packed copies and objects moving themselves all ask, and whether the
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
        self.host = device.type in HOST_TYPES and not simulated
        self.device, self.options, self.pins, self.traced = device, options, not simulated, traced
        self.call: type[Call] = TracedCall if traced else Call
        self.plain = options.dtype is None and not options.copy and options.memory_format is None
        self.packs = (  # not in a compiled graph: its copies are the compiler's to plan
            not traced
            and not self.host
            and options.memory_format is None
            and (_packing.packs_to(device) or (simulated and _packing.can_pack))
        )
        # What objects moving themselves, modules, rules and packed copies are told: no
        # wait can be had for them. Whether a copy from an accelerator is waited for once
        # before the call returns (Call.finish).
        self.told = self.copy(None, device)[0]
        self.waits = self.copy("cuda", device)[1]  # cuda: any accelerator
        move_each: _tree.MoveEach | None = None
        if traced:  # nothing packed there: no list form
            self.move = traced_mover(self)
        else:
            self.move, self.move_all, move_each = mover(
                self, is_meta=device.type == "meta" and not simulated
            )
        # A flat batch of plain tensors (map_leaves' ``kept``): those the mover gives back
        # as they are, read as it reads them, are copied without a call per tensor. In a
        # loop of tiny steps, whose PyTorch step leaves little of devicekit in the CPU's
        # caches, to_device((x, y), "cpu") took 12.1-17.2 us a step and takes 9.4-13.6,
        # the loader's batch 13.3-18.7 and 10.7-15.1 (benchmarks/bench_tiny_steps.py);
        # alone, 2.8 and 2.1. Those it moves go in one comprehension (move_each, below).
        self.kept: _tree.Kept | None = (
            (
                _Tensor,
                operator.attrgetter("is_cpu" if device.type == "cpu" else "is_meta"),
                move_each,
            )
            if self.host and self.plain and not traced
            else None
        )

    def copy(self, source: str | None, target: torch.device) -> tuple[bool, bool]:
        """The non_blocking rule: whether a copy is asynchronous, and whether it is waited for.

        ``source`` is the device type copied from; None where no wait can be had (an
        object moving itself, a packed copy), which is taken as from the host. Under
        ``"auto"``: to an accelerator, asynchronous (a pinned source overlaps); to the
        host, from an accelerator, asynchronous, and the call waits for it once before
        it returns; host to host, blocking: there is nothing to overlap. True and False
        apply as asked, with no wait. Copies to MPS, and from it under ``"auto"``, block
        whatever is asked, as Lightning's and Ultralytics' do: PyTorch's asynchronous
        MPS copies can corrupt data silently (pytorch#139550, #189690). In a compiled
        graph, a copy that would be waited for is blocking: a graph holds no event to
        wait on.
        """
        if target.type == "mps":
            return False, False
        if self.options.non_blocking != "auto":
            return bool(self.options.non_blocking), False
        if not (self.host if target.type == self.device.type else target.type in HOST_TYPES):
            return True, False
        waited = not self.traced and source not in HOST_TYPES and source not in (None, "mps")
        return waited, waited and target.type != "meta"


_plans: dict[object, Plan] = {}


def _plan(device: DeviceLike | None, options: Options) -> Plan:
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
            plan = _plans[key] = Plan(target, options)
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
        ValueError: ``dtype`` or ``memory_format`` has a value outside those above.
        TypeError: ``non_blocking`` is not ``"auto"``, True or False; ``copy`` or
            ``strict`` is not True or False; ``device`` or ``skip_keys`` has a value of
            the wrong type.
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
        return _run(Plan(target, Options(*checked), traced=True), data, skip)
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


def _run(plan: Plan, data: Any, skip: frozenset[Hashable] | None = None) -> Any:
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


Mover: TypeAlias = Callable[[Any, "Call"], Any]


def mover(plan: Plan, *, is_meta: bool) -> tuple[Mover, _tree.MoveAll, _tree.MoveEach | None]:
    """The plan's mover, ``move(leaf, call)``, and its list forms, ``move_all`` and ``move_each``.

    ``move_all(leaves, active, call)`` is ``move`` at each active leaf (tests/
    test_properties.py holds them equal), after packing what pays, with distinct plain
    tensors copied in one comprehension: a call each costs a tenth of a small copy.
    ``move_each(tensors)`` is ``move`` at each of a sequence of plain tensors (a flat
    batch, as the host walk finds it), in the same comprehension, or None where one
    tensor is there twice (the walk then notes it, see Call); ``move_each`` itself is
    None where ``move`` would take a tensor through the call (options, a wait).
    """
    device, asynchronous, packs, plain = plan.device, plan.told, plan.packs, plan.plain
    is_cpu = device.type == "cpu"
    host = is_cpu or is_meta
    waitless = not plan.waits  # else a copy from an accelerator goes through call.tensor

    def move(obj: Any, call: Call) -> Any:
        if type(obj) is not _Tensor:
            return call.leaf(obj)
        if not plain:
            return call.tensor(obj, device)
        if host:
            if obj.is_cpu if is_cpu else obj.is_meta:  # already there (obj.device costs more)
                return obj
            if not waitless:
                return call.tensor(obj, device)
        notes = call.notes
        if notes is REMEMBER:
            return call.tensor(obj, device)
        notes.append(id(obj))
        try:
            # A tensor already on the target comes back from .to() as it is. Keyword
            # arguments cost PyTorch more to parse than a small copy to meta takes, and one
            # operator.methodcaller per plan cost 8-13% of cpu -> meta (bench_to_device.py).
            return obj.to(device, non_blocking=True) if asynchronous else obj.to(device)
        except NotImplementedError:
            if obj.is_meta:
                raise call.meta_error() from None
            raise

    def move_all(leaves: list[Any], active: Sequence[int], call: Call) -> list[Any]:
        tensors = {id(leaf): leaf for leaf in leaves if type(leaf) is _Tensor}
        packed = _pack([*tensors.values()], plan) if packs and len(tensors) >= _MIN else {}
        if len(tensors) == len(active) and call.notes is not REMEMBER:  # each once, nothing else
            if len(packed) == len(tensors):  # all packed: placed from C
                made = list(map(packed.__getitem__, tensors))
                if len(made) == len(leaves):
                    return made
                moved = leaves.copy()
                for index, value in zip(active, made):  # noqa: B905 - one per active leaf
                    moved[index] = value
                return moved
            if not packed and plain and waitless:  # one comprehension, no call per tensor
                try:
                    if asynchronous:
                        return [
                            x.to(device, non_blocking=True) if type(x) is _Tensor else x
                            for x in leaves
                        ]
                    return [x.to(device) if type(x) is _Tensor else x for x in leaves]
                except NotImplementedError:  # a meta tensor: move says so
                    pass
        elif len(tensors) < list(map(type, leaves)).count(_Tensor):
            call.notes = REMEMBER  # one tensor twice, known before any moved
        moved = leaves.copy()
        for index in active:
            leaf = leaves[index]
            moved[index] = packed[id(leaf)] if id(leaf) in packed else move(leaf, call)
        return moved

    def move_each(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        # A call per tensor, and the walk's step per leaf, cost a third of a flat batch's
        # copies to meta: bench_to_device.py's flat dict of 8, cpu -> meta, took 1.54-1.58x
        # the handwritten comprehension and takes 1.29-1.31x, a list of 2 (x, y) 4.8 us
        # and 4.2 (fastest of 150 interleaved rounds, alternate runs against the walk).
        if len({*map(id, tensors)}) < len(tensors):
            return None  # one tensor twice: the walk notes it, and the call is made again
        if asynchronous:
            return [x.to(device, non_blocking=True) for x in tensors]
        return [x.to(device) for x in tensors]

    return move, move_all, (move_each if plain and waitless and not packs else None)


def traced_mover(plan: Plan) -> Mover:
    """The mover of a compiled region: every tensor through the call's memo, keyed by itself.

    The host path's notes of ``id(tensor)`` would make the compiler guard on each input
    tensor's identity, and compile again for every fresh batch; a memo keyed by the
    tensors themselves keeps repeats one tensor without that. Nothing is packed there.
    """
    device = plan.device

    def move(obj: Any, call: Call) -> Any:
        return call.tensor(obj, device) if type(obj) is _Tensor else call.leaf(obj)

    return move


def _itself(obj: Any) -> Any:
    return obj


_FORMAT_DIMS: Final = {torch.channels_last: 4, torch.channels_last_3d: 5}
_MIN: Final = _packing.MIN_TENSORS


class Call:
    """What one to_device call keeps: its memo, its notes, the devices to wait for.

    A tensor found twice comes back as one moved tensor. A memo write per tensor costs a
    fifth of a small copy, so the mover notes the ids it copies; a call whose notes
    repeat is made again, ``REMEMBER``-ing every tensor (a repeat is rare). 64
    per-image dicts of 3 tensors, cpu -> meta: 447-458 us a call with notes, 470-513
    with a memo write per tensor (interleaved, one run; bench_to_device.py's workload).
    Tensors with options, and objects moved by rules, ``.to()`` or in place, always use
    the memo.
    """

    __slots__ = ("memo", "notes", "plan", "skip", "waits")

    # What the memo is keyed by: an id, which any object has. A class attribute, not one
    # set per call: a call's setup is a tenth of a small batch's host time.
    key: Callable[[Any], Any] = staticmethod(id)

    def __init__(
        self,
        plan: Plan,
        notes: list[int],
        memo: dict[Any, Any] | None = None,
        skip: frozenset[Hashable] | None = None,
    ) -> None:
        self.plan, self.notes, self.skip = plan, notes, skip
        self.memo: dict[Any, Any] = {} if memo is None else memo  # key -> what it became
        self.waits: set[torch.device] | None = None

    def tensor(
        self, tensor: torch.Tensor, device: torch.device, dtype: Any = _UNSEEN
    ) -> torch.Tensor:
        """One tensor to ``device`` with the call's options, or as it is if nothing changes.

        ``dtype``, where given, is the one floating-point tensors take instead of the
        call's (an optimizer's state takes its parameter's).
        """
        key = self.key(tensor)
        moved: torch.Tensor | None = self.memo.get(key)
        if moved is not None:
            return moved
        if tensor.is_meta and device.type != "meta":
            raise self.meta_error()
        options = self.plan.options
        asked = options.dtype if dtype is _UNSEEN else dtype
        dtype = asked if asked is not None and tensor.is_floating_point() else None
        memory_format = options.memory_format
        # As nn.Module.to has it: channels_last concerns 4-d tensors (3d: 5-d), so a
        # batch's labels and masks pass untouched next to its images.
        if memory_format is not None and tensor.dim() != _FORMAT_DIMS.get(
            memory_format, tensor.dim()
        ):
            memory_format = None
        if (
            not options.copy
            and tensor.device == device
            and (dtype is None or tensor.dtype == dtype)
            and (memory_format is None or tensor.is_contiguous(memory_format=memory_format))
        ):
            return tensor
        moved = self.memo[key] = tensor.to(
            device,
            dtype=dtype,
            non_blocking=self.non_blocking(tensor, device),
            copy=options.copy,
            memory_format=memory_format or torch.preserve_format,
        )
        return moved

    def non_blocking(self, tensor: torch.Tensor, device: torch.device) -> bool:
        """Whether a copy is asynchronous (:meth:`Plan.copy`), noting the wait it needs."""
        source = tensor.device
        asynchronous, waited = self.plan.copy(source.type, device)
        if waited:
            self.waits = (self.waits or set()) | {source}  # the one wait, in finish()
        return asynchronous

    def leaf(self, obj: Any) -> Any:
        """Move a leaf that is not an exact tensor, as the table says its type moves."""
        decision = leaf_how(type(obj))
        how = decision.leaf
        if how is Leaf.KEPT or how is None:
            return obj
        if how is Leaf.TENSOR:
            if decision.meshed:
                _stays_on_its_mesh(obj, self.plan.device)
            return self.tensor(obj, self.plan.device)
        if how is Leaf.OTHER or how is Leaf.ARRAY:
            return keep(obj, self.plan.options.strict, array=how is Leaf.ARRAY)
        if _is_compiling() and how is not Leaf.PARAMETER:
            # Branches, not a dict by Leaf: the compiler cannot guard on such a lookup.
            if how is Leaf.RULE:
                what = "with the rule registered for it"
            elif how is Leaf.TO_METHOD:
                what = "with its .to()"
            elif how is Leaf.CACHE:
                what = "in place, through its layers' prefetch()"
            else:
                what = "in place, as nn.Module.to moves it"
            msg = (
                f"Cannot move {{path}} inside torch.compile: a {type(obj).__name__} moves "
                f"{what}, which a compiled graph cannot repeat as devicekit does. Move it "
                "before the compiled region."
            )
            raise LeafError(msg)
        key = self.key(obj)
        moved = self.memo.get(key, _UNSEEN)
        if moved is _UNSEEN:  # user code, or in-place moves: once per object
            moved = self.memo[key] = MOVES[how](obj, self, decision)
        return moved

    def meta_error(self) -> LeafError:
        """The error for a meta tensor asked onto a device with data."""
        msg = (
            f"Cannot move {{path}} to {self.plan.device}: it is a tensor on the meta device, "
            f"and {META}. Create it on a real device instead, for example with "
            "torch.empty_like(tensor, device=...) or module.to_empty(device=...)."
        )
        return LeafError(msg)

    def finish(self) -> None:
        """Wait once per source device for the asynchronous copies that need it."""
        for device in self.waits or ():
            event = new_event(device)
            event.record(torch.accelerator.current_stream(device))
            event.synchronize()


class TracedCall(Call):
    """A call in a compiled region: its memo keyed by the tensors themselves.

    Only tensors reach it there (see traced_mover).
    """

    __slots__ = ()
    key = staticmethod(_itself)


def _pack(tensors: list[torch.Tensor], plan: Plan) -> dict[int, torch.Tensor]:
    """The small host tensors among ``tensors`` sent packed, where that pays, by id."""
    if not _packing.might_pay(tensors):
        return {}
    options = plan.options
    return _packing.pack(
        tensors, plan.device, non_blocking=plan.told, dtype=options.dtype, pin=plan.pins
    )


def _stays_on_its_mesh(tensor: torch.Tensor, device: torch.device) -> None:
    """Refuse a DTensor to a device type other than its mesh's (meta, shapes only, is fine).

    PyTorch moves its shard and keeps the mesh: a cuda shard on a cpu mesh, which every
    collective then fails on, far from the move.
    """
    mesh_type = getattr(tensor, "device_mesh").device_type  # noqa: B009 - a DTensor's
    if device.type in (mesh_type, "meta"):
        return
    msg = (
        f"Cannot move {{path}} to {device}: it is a DTensor ({mesh_of(tensor)}), whose shards "
        f"live on its mesh's {mesh_type} devices; moved, it would hold a {device.type} shard "
        f"on a {mesh_type} mesh, which collectives cannot use. Distribute it on a "
        f"{device.type} mesh (init_device_mesh({device.type!r}, ...)), or move "
        "tensor.full_tensor() for one plain tensor."
    )
    raise LeafError(msg)
