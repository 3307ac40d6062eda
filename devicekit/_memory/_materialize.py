"""materialize: storage and initialisation for a meta model, and a name for what nothing wrote.

``Module.to_empty()`` gives meta tensors storage holding whatever memory held, and only
the tensors some initialiser then writes are right: a buffer computed in ``__init__``
(a rotary embedding's ``inv_freq``) or a parameter no ``reset_parameters()`` touches
stays garbage, silently. :func:`materialize` gives each meta tensor storage filled with
a filler (a NaN whose bits ``float('nan')`` never has; 0x5A in every byte of an
integer: ``_filler.py``) and notes its version counter; then it runs the modules' own
initialisers and the user's ``init``. Afterwards every element still holding the filler
is unwritten, whatever wrote the rest: a counted in-place write is evidence of a write,
not of every element written (``w[:4] = ...``, ``mul_``). A tensor whose place holds
another is written; so is one of a type in which a write can leave the filler on
purpose (an 8- or 16-bit integer), once a write on it is counted. What is left is named,
path by path, as is a tensor still on meta afterwards, and the module is given back its
meta tensors, as it was, for a retry with ``init=``.

The initialisers write only what materialize gave storage to: while they run, every
tensor that was real before the call (loaded from a checkpoint) is replaced in its
module by a meta stand-in of its shape, so a reset that rewrites its whole module
(``Linear``'s weight beside a meta bias, ``MultiheadAttention``'s child ``out_proj``)
writes nothing there. Only the running step's own module holds its real tensors, to read
them; they are copied first and written back after. The real tensors, the same objects,
are back in their places afterwards.

Sharded modules (FSDP2's ``fully_shard``, DTensor parameters) get storage on their mesh
through ``Module._apply``, the path ``to_empty`` takes, which FSDP2 follows to keep its
own references. Each rank checks what it holds, then the ranks agree, in one all-reduce
over the mesh's group, on every count (a DTensor's shards summed; a plain tensor, which
each rank holds whole, counted on each), on what is left on meta, and on whether a rank
failed: so all raise or none does, and none is left waiting in a later collective.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from devicekit._base import (
    DeviceKitError,
    DeviceLike,
    apply_to_own_tensors,
    current_device,
    listing,
    own_tensors,
    registered_table,
    resolve_device,
    shown,
    version_of,
)
from devicekit._core import Stray, read_again, strays
from devicekit._memory._filler import Filler, count_fillers, fill, filler_of

__all__ = ["materialize"]

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)  # no mesh, no local shard: no lookup
_SHOWN = 20  # the unwritten tensors a message lists by path; the rest are counted
_STORAGE = 1  # a rank's failure code while giving storage; initialiser k is _STORAGE + 1 + k
_PLAIN_SAID = "a plain attribute, not a parameter or buffer"  # left on meta, as listed
_MADE_SAID = "put there on meta by an initialiser"
_HIDDEN = (
    "(devicekit.materialize: while an initialiser runs, every tensor that was real before "
    "the call is a meta stand-in, so that none is overwritten, except those of the module "
    "it runs for.)"
)


def materialize(
    module: torch.nn.Module,
    device: DeviceLike | None = None,
    /,
    *,
    init: Callable[[torch.nn.Module], object] | None = None,
) -> torch.nn.Module:
    """Give a module's meta tensors storage on ``device``, initialise them, and check.

    Each meta parameter and buffer gets storage on ``device`` (sharded ones on their
    mesh), in place; tied parameters stay one parameter. Then every submodule that
    holds one runs its own ``reset_parameters()`` (or ``_reset_parameters()``), and
    then ``init(submodule)`` runs on every submodule, children first, so ``init`` need
    only set what the modules' own initialisers do not. Tensors already on a real device
    are kept exactly, the same objects with the same values: while an initialiser runs,
    they are meta tensors of the same shape, which it writes to without effect, except
    those of the module it runs for, which it can read (they are written back after).

    >>> import torch, devicekit as dk
    >>> with torch.device("meta"):
    ...     model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    >>> model = dk.materialize(model, "cpu")
    >>> model[0].weight.device, int(model[1].num_batches_tracked)
    (device(type='cpu'), 0)

    Args:
        module: The model, built on the meta device (``with torch.device("meta"):``),
            sharded or not.
        device: Where the storage goes; None for :func:`~devicekit.current_device`.
            Sharded tensors go to their mesh's device type.
        init: Called with each submodule after the modules' own initialisers, to set
            what they leave unset (a buffer computed in ``__init__``, a parameter no
            ``reset_parameters`` covers, a plain tensor attribute left on meta).

    Returns:
        ``module`` itself, every tensor on real storage and written.

    Raises:
        DeviceKitError: Elements of a tensor given storage were written by no
            initialiser: they still hold the filler (a NaN whose bits ``float('nan')``
            never has, or 0x5A in every byte of an integer), whether no write was
            counted on the tensor or one covered part of it (``w[:4] = ...``) or
            computed from what it held (``mul_``). Or a tensor of the module is on meta
            after the initialisers (a plain attribute, or one an initialiser made there),
            or a lazy module's parameter has no shape yet. The message names each by its
            path and the fix; the module's meta tensors are put back, so a retry with
            ``init=`` starts from the same model. A NaN written on purpose,
            ``float('nan')``'s, is written. In an 8- or 16-bit integer, where any value
            can be data, one counted write counts as the whole tensor's; bool and float4
            tensors have no filler and are not checked. Sharded, each rank reads its own
            shards, and every rank raises if one does: a rank whose initialiser raised
            re-raises that error, the others name that rank.
        TypeError: ``module`` is not a module, ``init`` is not callable, or ``device``
            is of the wrong type.
        ValueError: ``device`` is the meta device.
        DeviceUnavailableError: ``device`` does not parse or is not on this machine.
    """
    if not isinstance(module, torch.nn.Module):
        msg = (  # type: ignore[unreachable]  # for untyped callers
            f"Expected a torch.nn.Module to materialize, got {type(module).__name__} "
            f"{shown(module)}."
        )
        raise TypeError(msg)
    if init is not None and not callable(init):
        msg = (  # type: ignore[unreachable]  # for untyped callers
            f"Expected init to be a function of a submodule, got {type(init).__name__} "
            f"{shown(init)}."
        )
        raise TypeError(msg)
    target = current_device() if device is None else resolve_device(device)
    if target.type == "meta":
        msg = (
            "Expected a device with storage to materialize on, got meta: the module's "
            "tensors are there already. Name a device such as 'cuda' or 'cpu'."
        )
        raise ValueError(msg)
    slots = _meta_slots(module)
    _refuse_lazy(slots)
    plain = _plain_on_meta(module)
    if not slots and not plain:
        return module
    mesh = _mesh_of(module)
    steps = _steps(module, {id(submodule) for submodule, _, _, _ in slots}, init)
    storage = _Storage(target)
    try:
        watched, failed = _initialise(module, slots, storage, steps)
    except BaseException:  # an interrupt or an exit: now, without waiting for other ranks
        _put_back(module, slots)
        raise
    if failed:  # as many counts as a rank that got further has: every rank's line up
        found = _Found.failing(len(_watchable(slots)), failed.code)
    else:
        found = _Found.here(watched, module, plain)
    if mesh is not None:
        found = found.agreed(mesh)
    if found.failures:
        _put_back(module, slots)
        if failed:
            raise failed.error
        raise DeviceKitError(_failed_message(found.failures, steps, target))
    unwritten = _unwritten(watched, found, mesh)
    if unwritten or found.left:
        _put_back(module, slots)
        raise DeviceKitError(_message(unwritten, len(storage.made), found, target))
    return module


class _Failed(NamedTuple):
    """What raised on this rank, which the other ranks hear of before it is raised again."""

    code: int
    """_STORAGE, or _STORAGE + 1 + the position of the initialiser that raised."""
    error: Exception


def _initialise(
    module: torch.nn.Module, slots: list[Slot], storage: _Storage, steps: list[_Step]
) -> tuple[list[_Watched], _Failed | None]:
    """Storage for every slot, then every step, real tensors kept out of their reach.

    Returns the new tensors to check, or what raised.
    """
    failure = _STORAGE
    kept = None
    try:
        with torch.no_grad():
            for _, submodule in _post_order(module):
                # Children first: an FSDP2 unit re-reads its parameters from their modules
                # after its own _apply, so every module of the unit holds its new tensors then.
                apply_to_own_tensors(submodule, storage.give)
            _tie_again(slots)
            watched = [_Watched.now(slot) for slot in _watchable(slots)]
            kept = _Kept(module, {id(getattr(sub, name)) for sub, name, _, _ in slots})
            try:
                kept.hide()
                for position, step in enumerate(steps):
                    failure = _STORAGE + 1 + position
                    with kept.open_to(step.module):
                        step.run()
            finally:
                kept.show()
    except Exception as error:
        if (
            kept is not None
            and kept.stand_ins
            and failure > _STORAGE
            and hasattr(error, "add_note")
        ):
            error.add_note(_HIDDEN)  # Python 3.11 and later: the error keeps its type
        return [], _Failed(failure, error)
    return watched, None


# A submodule, a meta tensor's name on it, its path, and the meta tensor itself.
Slot = tuple[torch.nn.Module, str, str, torch.Tensor]


class _Storage:
    """The new tensors, each filled with its filler, one per meta tensor however often held."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.made: dict[int, torch.Tensor] = {}  # id(meta tensor) -> its new tensor

    def give(self, tensor: torch.Tensor) -> torch.Tensor:
        """Storage for a meta tensor (the same for each place it is held); others as they are."""
        if not tensor.is_meta:
            return tensor
        made = self.made.get(id(tensor))
        if made is None:
            made = _empty_like(tensor, self._on(tensor))
            filler = filler_of(made.dtype)
            if filler is not None:
                fill(_local(made), filler)
            self.made[id(tensor)] = made
        return made

    def _on(self, tensor: torch.Tensor) -> torch.device:
        mesh = getattr(tensor, "device_mesh", None)
        if mesh is not None and mesh.device_type != self.device.type:
            return torch.device(mesh.device_type)
        return self.device


def _empty_like(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """An uninitialised tensor of ``tensor``'s shape, layout and dtype on ``device``."""
    if type(tensor) in _PLAIN_TYPES:
        # empty_like of a meta tensor runs PyTorch's Python reference of it (~50 us);
        # empty_strided, the same layout, took materialize from 1.65x to 0.97x of
        # to_empty + reset_parameters (benchmarks/bench_materialize.py).
        return torch.empty_strided(
            tensor.size(), tensor.stride(), dtype=tensor.dtype, device=device
        )
    # A DTensor's empty_like keeps its mesh and placements: its shard gets the storage.
    return torch.empty_like(tensor, device=device)


def _meta_slots(module: torch.nn.Module) -> list[Slot]:
    """Every place a meta parameter or buffer is held: a tied one once per place."""
    return [
        (submodule, name, f"{prefix}.{name}" if prefix else name, tensor)
        for prefix, submodule in module.named_modules()
        for name, tensor in own_tensors(submodule)
        if tensor.is_meta
    ]


def _plain_on_meta(module: torch.nn.Module) -> list[Stray]:
    """The meta tensors the module holds outside its parameters and buffers (a rotary cache)."""
    return [stray for stray in strays(module) if stray.tensor.is_meta]


def _still_on_meta(plain: list[Stray], module: torch.nn.Module) -> list[str]:
    """The paths of those still on meta once the initialisers ran (init may set them)."""
    if not plain:
        return []
    try:
        now = read_again(plain)
    except (AttributeError, LookupError, TypeError):  # an initialiser removed one: look again
        return [stray.path for stray in _plain_on_meta(module)]
    return [
        stray.path
        for stray, value in zip(plain, now, strict=True)
        if isinstance(value, torch.Tensor) and value.is_meta
    ]


def _refuse_lazy(slots: list[Slot]) -> None:
    """A lazy module's parameters have no shape to give storage to until its first forward."""
    lazy = [
        (path, submodule)
        for submodule, _, path, tensor in slots
        if isinstance(tensor, torch.nn.UninitializedParameter | torch.nn.UninitializedBuffer)
    ]
    if not lazy:
        return
    paths = listing([path for path, _ in lazy])
    kinds = ", ".join(dict.fromkeys(type(submodule).__name__ for _, submodule in lazy))
    msg = (
        f"Expected meta tensors with a shape to give storage to, but {paths} (of {kinds}) "
        "are uninitialized: a lazy module's shapes are set by its first forward. "
        "Run one forward first (inputs on meta of the right shape are enough, such as "
        "torch.empty(8, 128, device='meta')), or build the module's non-lazy form "
        "(nn.Linear for nn.LazyLinear). Nothing was changed."
    )
    raise DeviceKitError(msg)


def _mesh_of(module: torch.nn.Module) -> Any:
    """The largest device mesh a DTensor of the module lives on; None for a plain module."""
    meshes: dict[int, Any] = {}
    for submodule in module.modules():
        for _, tensor in own_tensors(submodule):
            mesh = None if type(tensor) in _PLAIN_TYPES else getattr(tensor, "device_mesh", None)
            if mesh is not None:
                meshes.setdefault(id(mesh), mesh)
    return max(meshes.values(), key=lambda mesh: mesh.size(), default=None)


def _post_order(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Submodules, children before their parents, as ``Module.apply`` visits them."""
    return list(reversed(list(module.named_modules())))


class _Step(NamedTuple):
    """One initialiser call: a submodule's own reset, or the user's init on a submodule."""

    module: torch.nn.Module
    run: Callable[[], object]
    said: str
    """As a message names it: "Rotary.reset_parameters() of 'rotary'", "init on 'rotary'"."""


def _steps(
    module: torch.nn.Module,
    holders: set[int],
    init: Callable[[torch.nn.Module], object] | None,
) -> list[_Step]:
    """The initialisers in the order they run: every holder's reset, then init, children first.

    The same list on every rank of a sharded model: a rank names another's by position.
    """
    steps = []
    order = _post_order(module)
    for path, submodule in order:
        if id(submodule) not in holders:
            continue
        for name in ("reset_parameters", "_reset_parameters"):
            reset = getattr(submodule, name, None)
            if callable(reset):
                place = f"'{path}'" if path else "the module"
                said = f"{type(submodule).__name__}.{name}() of {place}"
                steps.append(_Step(submodule, reset, said))
                break
    if init is not None:
        for path, submodule in order:
            place = f"'{path}' ({type(submodule).__name__})" if path else "the module itself"
            run = functools.partial(init, submodule)
            steps.append(_Step(submodule, run, f"init on {place}"))
    return steps


def _tie_again(slots: list[Slot]) -> None:
    """One parameter object in every place that held one meta parameter (tied weights).

    ``_apply`` wraps the one new tensor in a new Parameter per place that held it.
    """
    first: dict[int, torch.Tensor] = {}
    for submodule, name, _, meta in slots:
        kept = first.setdefault(id(meta), getattr(submodule, name))
        if kept is not getattr(submodule, name):
            setattr(submodule, name, kept)


class _Kept:
    """The tensors real before the call, which no initialiser may change.

    A reset writes its module's tensors whole, and its children's (MultiheadAttention's
    ``out_proj.bias``); ``init`` may write any. While the initialisers run, every real
    tensor is replaced in its module by a meta stand-in of its shape, on which writes do
    nothing, except the running step's own module's, which it may read (a cache computed
    from a buffer): those are in place, copied first and written back after, a copy the
    size of one module's own tensors at a time, not of the model's. The tables are
    written directly, so no ``__setattr__`` (FSDP2's) sees a stand-in.
    """

    def __init__(self, module: torch.nn.Module, new: set[int]) -> None:
        self.module = module
        # The modules themselves, kept: one an initialiser takes out of the tree gets its own back.
        self.places = [
            (submodule, name, tensor)
            for submodule in module.modules()
            for name, tensor in own_tensors(submodule)
            if not tensor.is_meta and id(tensor) not in new
        ]
        self.own: dict[int, list[tuple[str, torch.Tensor]]] = {}  # id(module) -> its places
        for submodule, name, tensor in self.places:
            self.own.setdefault(id(submodule), []).append((name, tensor))
        self.stand_ins: dict[int, torch.Tensor] = {}  # id(real tensor) -> its stand-in
        self.real: dict[int, torch.Tensor] = {}  # id(stand-in) -> its real tensor

    def hide(self) -> None:
        for submodule, name, tensor in self.places:
            registered_table(submodule, name)[name] = self._stand_in(tensor)

    @contextlib.contextmanager
    def open_to(self, submodule: torch.nn.Module) -> Iterator[None]:
        """The step's own module's real tensors in place, as they were again after it."""
        own = self.own.get(id(submodule), [])
        copies = []
        for name, tensor in own:
            registered_table(submodule, name)[name] = tensor
            copies.append(tensor.clone())  # a write through .data is counted nowhere
        try:
            yield
        finally:
            for (name, tensor), copy in zip(own, copies, strict=True):
                tensor.copy_(copy)
                registered_table(submodule, name)[name] = self._stand_in(tensor)

    def show(self) -> None:
        """Every real tensor in its place; in a place an initialiser tied to a stand-in too."""
        for submodule, name, tensor in self.places:
            registered_table(submodule, name)[name] = tensor
        if self.real:
            for submodule in self.module.modules():
                for name, tensor in own_tensors(submodule):
                    if id(tensor) in self.real:
                        registered_table(submodule, name)[name] = self.real[id(tensor)]

    def _stand_in(self, tensor: torch.Tensor) -> torch.Tensor:
        stand_in = self.stand_ins.get(id(tensor))
        if stand_in is None:
            stand_in = _empty_like(tensor, "meta")
            if isinstance(tensor, torch.nn.Parameter):
                stand_in = torch.nn.Parameter(stand_in, tensor.requires_grad)
            self.stand_ins[id(tensor)] = stand_in
            self.real[id(stand_in)] = tensor
        return stand_in


class _Watched(NamedTuple):
    """A tensor given storage and filled with its filler, as the initialisers found it."""

    module: torch.nn.Module
    name: str
    path: str
    tensor: torch.Tensor
    versions: tuple[int | None, int | None]
    """Its in-place writes counted, and its local shard's (a DTensor counts its own)."""

    @classmethod
    def now(cls, slot: Slot) -> _Watched:
        submodule, name, path, _ = slot
        tensor = getattr(submodule, name)
        return cls(submodule, name, path, tensor, _versions(tensor))

    def replaced(self) -> bool:
        """Whether an initialiser put another tensor in its place (or deleted it): written."""
        return registered_table(self.module, self.name).get(self.name) is not self.tensor

    def counted(self) -> bool:
        """Whether an in-place write on it was counted: a write, of some elements at least."""
        versions = _versions(self.tensor)
        return None not in versions and versions != self.versions

    def to_read(self) -> Filler | None:
        """The filler to look for in its elements; None where they are not read.

        Not read where it was replaced, nor where a write counted on it can have left the
        filler on purpose: there one counted write is the whole tensor's.
        """
        filler = filler_of(self.tensor.dtype)
        if filler is None or self.replaced() or (filler.whole and self.counted()):
            return None
        return filler

    @property
    def sharded(self) -> bool:
        return getattr(self.tensor, "device_mesh", None) is not None


def _watchable(slots: list[Slot]) -> list[Slot]:
    """The slots whose new tensors get a filler to watch, a tied tensor once."""
    chosen = []
    seen: set[int] = set()
    for slot in slots:
        meta = slot[3]
        if id(meta) not in seen and filler_of(meta.dtype) is not None:
            seen.add(id(meta))
            chosen.append(slot)
    return chosen


def _versions(tensor: torch.Tensor) -> tuple[int | None, int | None]:
    if type(tensor) in _PLAIN_TYPES:  # its own local shard: read once
        version = version_of(tensor)
        return version, version
    return version_of(tensor), version_of(_local(tensor))


def _put_back(module: torch.nn.Module, slots: list[Slot]) -> None:
    """Every slot on meta again, as before: the next ``_apply`` resyncs FSDP2's view."""
    swapped: set[int] = set()
    for submodule, name, _, meta in slots:
        if meta.is_meta:  # replaced by a new tensor: the meta one is intact
            setattr(submodule, name, meta)
        else:  # a wrapper subclass (a DTensor): _apply swapped the new contents into it
            swapped.add(id(meta))
    if swapped:
        for _, submodule in _post_order(module):
            apply_to_own_tensors(submodule, functools.partial(_to_meta, swapped))


def _to_meta(swapped: set[int], tensor: torch.Tensor) -> torch.Tensor:
    return _empty_like(tensor, "meta") if id(tensor) in swapped else tensor


class _Found(NamedTuple):
    """What the checks found, on this rank or, once agreed, on every rank of the mesh."""

    counts: list[int]
    """Per watched tensor: its elements unwritten, a DTensor's summed over its shards."""
    ranks: list[int]
    """Per watched tensor: on how many ranks it is unwritten (1 or 0 on one rank)."""
    after: list[int]
    """Per watched tensor: on how many of those an in-place write on it was counted."""
    failures: dict[int, int]
    """Rank -> the code of what raised there (:attr:`_Failed.code`)."""
    left: dict[int, int]
    """Rank -> how many of its tensors are on meta after the initialisers."""
    left_here: list[tuple[str, str]]
    """This rank's: each path, and what it is (_MADE_SAID, _PLAIN_SAID)."""

    @classmethod
    def failing(cls, watched: int, failure: int) -> _Found:
        """A rank that raised: every rank will, so nothing else needs counting."""
        return cls([0] * watched, [0] * watched, [0] * watched, {_rank(): failure}, {}, [])

    @classmethod
    def here(cls, watched: list[_Watched], module: torch.nn.Module, plain: list[Stray]) -> _Found:
        counts = [0] * len(watched)
        read = [
            (at, filler)
            for at, each in enumerate(watched)
            if (filler := each.to_read()) is not None
        ]
        numbers = count_fillers([(_local(watched[at].tensor), how) for at, how in read])
        for (position, _), number in zip(read, numbers, strict=True):
            counts[position] = number
        left = [(path, _MADE_SAID) for _, _, path, _ in _meta_slots(module)]
        left += [(path, _PLAIN_SAID) for path in _still_on_meta(plain, module)]
        ranks = [int(count > 0) for count in counts]
        after = [
            int(count > 0 and each.counted()) for each, count in zip(watched, counts, strict=True)
        ]
        return cls(counts, ranks, after, {}, {_rank(): len(left)} if left else {}, left)

    def agreed(self, mesh: Any) -> _Found:
        """Summed over the mesh's ranks in one all-reduce, each rank's own in its place.

        Every rank of the mesh materializes the same model, so each sees the tensors in
        one order: a count in the same place on every rank, and every rank's verdict alike.
        """
        import torch.distributed as dist  # noqa: PLC0415 - only sharded models get here

        size, rank, watched = dist.get_world_size(), _rank(), len(self.counts)
        mine = [0] * (2 * size)  # by rank: what failed there, then how many it left on meta
        mine[rank] = self.failures.get(rank, 0)
        mine[size + rank] = self.left.get(rank, 0)
        every = [*self.counts, *self.ranks, *self.after, *mine]
        both = torch.tensor(every, device=mesh.device_type)
        for group in _groups(mesh):
            dist.all_reduce(both, group=group)
        summed = both.tolist()
        failures, left = summed[3 * watched : -size], summed[-size:]
        return _Found(
            summed[:watched],
            summed[watched : 2 * watched],
            summed[2 * watched : 3 * watched],
            {other: code for other, code in enumerate(failures) if code},
            {other: count for other, count in enumerate(left) if count},
            self.left_here,
        )


def _rank() -> int:
    import torch.distributed as dist  # noqa: PLC0415 - loaded with torch; read where needed

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _groups(mesh: Any) -> list[Any]:
    """The process groups whose all-reduce, one after another, sums over every mesh rank.

    One group where one covers the mesh: its own (one dimension), or the default group
    (a mesh of every rank). A mesh of some ranks in several dimensions (a pipeline
    stage's) is summed over each dimension's group in turn.
    """
    import torch.distributed as dist  # noqa: PLC0415 - only sharded models get here

    if mesh.ndim == 1:
        return [mesh.get_group()]
    if mesh.size() == dist.get_world_size():
        return [None]  # the default group: every rank
    return [mesh.get_group(dimension) for dimension in range(mesh.ndim)]


class _Unwritten(NamedTuple):
    """A tensor with elements that no initialiser wrote, as its line in the message says."""

    elements: int
    """Its elements holding the filler, on every rank together (a DTensor's whole)."""
    total: int
    where: str
    """On which ranks, where not on all: " (on 1 of 2 ranks)"; or nothing."""
    after: bool
    """Whether an in-place write on it was counted (on a rank holding the filler)."""
    floating: bool
    """Whether its filler is a NaN: one a write means to keep can be told from it."""


def _unwritten(watched: list[_Watched], found: _Found, mesh: Any) -> dict[str, _Unwritten]:
    """The paths of tensors with elements no initialiser wrote."""
    ranks = 1 if mesh is None else mesh.size()
    unwritten = {}
    for each, summed, on, after in zip(
        watched, found.counts, found.ranks, found.after, strict=True
    ):
        if not summed:
            continue
        where = ""
        if each.sharded:  # each shard counted once on every rank holding a copy of it
            count = summed // (ranks // _shards(each.tensor))
        else:  # each rank counted the whole tensor: one rank's count, where they agree
            count = summed // on
            where = f" (on {on} of {ranks} ranks)" if on < ranks else ""
        floating = each.tensor.is_floating_point() or each.tensor.is_complex()
        unwritten[each.path] = _Unwritten(count, each.tensor.numel(), where, after > 0, floating)
    return unwritten


def _shards(tensor: Any) -> int:
    """Into how many pieces a DTensor is cut: its mesh's sizes along its Shard placements."""
    mesh = tensor.device_mesh
    return math.prod(
        mesh.size(dimension)
        for dimension, placement in enumerate(tensor.placements)
        if placement.is_shard()
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; a plain tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return (to_local() if callable(to_local) else tensor).detach()


def _one_a_line(items: list[str]) -> str:
    """A line an item, the first :data:`_SHOWN`, the rest counted: a report, not a listing."""
    more = [f"and {len(items) - _SHOWN} more"] if len(items) > _SHOWN else []
    return "\n".join(f"  {item}" for item in [*items[:_SHOWN], *more])


def _message(
    unwritten: dict[str, _Unwritten], made: int, found: _Found, device: torch.device
) -> str:
    parts = []
    if unwritten:
        parts.append(_unwritten_message(unwritten, made, device))
    if found.left:
        parts.append(_left_message(found, device))
    parts.append("The module's meta tensors are back in place: call materialize again with init=.")
    return " ".join(parts)


def _unwritten_message(unwritten: dict[str, _Unwritten], made: int, device: torch.device) -> str:
    lines = []
    for path, each in unwritten.items():
        part = f": {each.elements} of {each.total} elements" if each.elements < each.total else ""
        after = ", after an in-place write" if each.after else ""
        lines.append(f"{path}{part}{each.where}{after}")
    if any(each.after for each in unwritten.values()):
        why = (
            "An in-place write leaves the elements it does not cover (w[:4] = ...) as they "
            "were, and one that computes from what they held (mul_, clamp_) keeps the filler "
            "in them."
        )
        whole = " that writes them whole"
    else:
        why, whole = "No module's reset_parameters() wrote them.", ""
    nan = ""
    if any(each.after and each.floating for each in unwritten.values()):
        nan = (
            " A NaN meant to stay is told from the filler by its bits: write float('nan') "
            "itself (fill_(float('nan'))), not a NaN computed from another."
        )
    return (
        f"Expected every tensor given storage on {device} to be written by an initialiser, "
        f"but {len(unwritten)} of {made} hold what the empty storage held (checked by "
        "filling it first with a NaN whose bits float('nan') never has, or with 0x5A in "
        "every byte of an integer):\n"
        + _one_a_line(lines)
        + f"\n{why} Pass init=, a function of each submodule that sets them (a buffer "
        "computed in __init__ is computed again there), or give their modules a "
        f"reset_parameters(){whole}.{nan}"
    )


def _left_message(found: _Found, device: torch.device) -> str:
    if not found.left_here:
        rank, count = min(found.left.items())
        return (
            f"Expected every tensor of the module on {device} once the initialisers ran, but "
            f"rank {rank} has {count} still on the meta device; its own error names them."
        )
    lines = _one_a_line([f"{path}: {what}" for path, what in found.left_here])
    fixes = []
    said = {what for _, what in found.left_here}
    if _PLAIN_SAID in said:
        fixes.append(
            "materialize gives storage to parameters and buffers only: register a plain "
            "tensor attribute as a buffer (register_buffer(name, tensor, persistent=False)), "
            "or set it on the device in init=."
        )
    if _MADE_SAID in said:
        fixes.append(
            "Make what an initialiser adds on the device itself, not on another tensor's "
            "device: while it runs, another module's tensors that were real before the call "
            "are on meta."
        )
    count = len(found.left_here)
    return (
        f"Expected every tensor of the module on {device} once the initialisers ran, but "
        f"{count} {'is' if count == 1 else 'are'} still on the meta device:\n"
        + lines
        + "\n"
        + " ".join(fixes)
    )


def _failed_message(failures: dict[int, int], steps: list[_Step], device: torch.device) -> str:
    rank, failure = min(failures.items())
    where = (
        f"while giving the module's tensors storage on {device}"
        if failure == _STORAGE
        else f"in {steps[failure - _STORAGE - 1].said}"
    )
    others = len(failures) - 1
    also = f" (and {others} other rank{'s' if others > 1 else ''})" if others else ""
    return (
        f"Expected materialize to succeed on every rank, but rank {rank}{also} raised {where}; "
        "its own error, raised there, says why. The module's meta tensors are back in place "
        "on every rank, as they were: fix what raised and call materialize again."
    )
