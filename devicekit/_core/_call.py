"""One to_device call's moves: the mover a plan makes, and what a call keeps.

A plan (``_transfer._Plan``, one per device and options) makes its mover once:
``move(leaf, call)`` for a leaf and ``move_all(leaves, active, call)`` for the
accelerator path, which packs small tensors (:mod:`devicekit._core._packing`). A
:class:`Call` is one to_device call: its memo (an object moves once a call), the ids it
copied, and the devices whose copies it waits for before it returns. Objects that are
not plain tensors move as :data:`devicekit._core._moves.MOVES` says their :class:`Leaf` does.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Final, Protocol, TypeAlias

import torch

from devicekit._base import HOST_TYPES, LeafError, mesh_of
from devicekit._core import _packing
from devicekit._core._kinds import Leaf, leaf_how
from devicekit._core._moves import MOVES, keep

__all__ = ["REMEMBER", "Call", "Plan", "TracedCall", "mover", "traced_mover"]

_Tensor = torch.Tensor  # one global lookup on the hot path instead of two
_is_compiling = torch.compiler.is_compiling  # likewise; torch.compile knows the function
_UNSEEN: Any = object()
REMEMBER: Final[list[int]] = []
"""Call.notes where tensors move through the memo: a call whose notes repeat, made again."""


class Plan(Protocol):
    """What a call reads of its plan (``_transfer._Plan``): worked out once per device."""

    device: torch.device
    options: Any  # _transfer.Options
    packs: bool  # small tensors go packed
    pins: bool  # packing stages in pinned memory
    plain: bool  # no dtype, copy or memory_format
    told: bool  # what objects that move themselves are told for non_blocking
    waits: bool  # copies to the host are waited for once, before the call returns

    def asynchronous(self, source: torch.device, target: torch.device) -> bool: ...


Mover: TypeAlias = Callable[[Any, "Call"], Any]
MoveAll: TypeAlias = Callable[[list[Any], Sequence[int], "Call"], list[Any]]


def mover(plan: Plan, *, is_meta: bool) -> tuple[Mover, MoveAll]:
    """The plan's mover, ``move(leaf, call)``, and its list form, ``move_all``.

    ``move_all(leaves, active, call)`` is ``move`` at each active leaf (tests/
    test_properties.py holds them equal), after packing what pays, with distinct plain
    tensors copied in one comprehension: a call each costs a tenth of a small copy.
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
        packed = _pack([*tensors.values()], call) if packs and len(tensors) >= _MIN else {}
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

    return move, move_all


def traced_mover(plan: Plan) -> tuple[Mover, MoveAll]:
    """The mover of a compiled region: every tensor through the call's memo, keyed by itself.

    The host path's notes of ``id(tensor)`` would make the compiler guard on each input
    tensor's identity, and compile again for every fresh batch; a memo keyed by the
    tensors themselves keeps repeats one tensor without that. Nothing is packed there.
    """
    device = plan.device

    def move(obj: Any, call: Call) -> Any:
        return call.tensor(obj, device) if type(obj) is _Tensor else call.leaf(obj)

    def move_all(leaves: list[Any], active: Sequence[int], call: Call) -> list[Any]:
        return [move(leaf, call) if index in active else leaf for index, leaf in enumerate(leaves)]

    return move, move_all


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
        """Whether a copy is asynchronous (:meth:`_Plan.asynchronous`), noting the wait it needs."""
        plan, source = self.plan, tensor.device
        asynchronous = plan.asynchronous(source, device)
        if asynchronous and plan.waits and device.type in HOST_TYPES:
            self.waits = (self.waits or set()) | {source}  # the one wait, in finish()
        return asynchronous

    def leaf(self, obj: Any) -> Any:
        """Move a leaf that is not an exact tensor, as the table says its type moves."""
        how, detail = leaf_how(type(obj))
        if how is Leaf.KEPT or how is None:
            return obj
        if how is Leaf.TENSOR:
            if detail:
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
            moved = self.memo[key] = MOVES[how](obj, self, detail)
        return moved

    def meta_error(self) -> LeafError:
        """The error for a meta tensor asked onto a device with data."""
        msg = (
            f"Cannot move {{path}} to {self.plan.device}: it is a tensor on the meta device, "
            "which has a shape but no data. Create it on a real device instead, for "
            "example with torch.empty_like(tensor, device=...) or module.to_empty(device=...)."
        )
        return LeafError(msg)

    def finish(self) -> None:
        """Wait once per source device for the asynchronous copies that need it."""
        for device in self.waits or ():
            event = torch.Event(device=device)
            event.record(torch.accelerator.current_stream(device))
            event.synchronize()


class TracedCall(Call):
    """A call in a compiled region: its memo keyed by the tensors themselves.

    Only tensors reach it there (see traced_mover).
    """

    __slots__ = ()
    key = staticmethod(_itself)


def _pack(tensors: list[torch.Tensor], call: Call) -> dict[int, torch.Tensor]:
    """The small host tensors among ``tensors`` sent packed, where that pays, by id."""
    if not _packing.might_pay(tensors):
        return {}
    plan = call.plan
    blocking = plan.options.non_blocking is False
    return _packing.pack(
        tensors, plan.device, non_blocking=not blocking, dtype=plan.options.dtype, pin=plan.pins
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
