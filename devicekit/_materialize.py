"""materialize: storage and initialisation for a meta model, and a name for what nothing wrote.

``Module.to_empty()`` gives meta tensors storage holding whatever memory held, and only
the tensors some initialiser then writes are right: a buffer computed in ``__init__``
(a rotary embedding's ``inv_freq``) or a parameter no ``reset_parameters()`` touches
stays garbage, silently. :func:`materialize` fills each new tensor with a sentinel
(NaN; an integer type's largest value), runs the modules' own initialisers and the
user's ``init``, then looks for the sentinel: what still holds it is named, path by path,
and the module is given back its meta tensors, as it was, for a retry with ``init=``.

Sharded modules (FSDP2's ``fully_shard``, DTensor parameters) get storage on their mesh
through ``Module._apply``, the path ``to_empty`` takes, which FSDP2 follows to keep its
own references; each rank checks its shard, and the ranks agree on the verdict in one
all-reduce per mesh, so that all raise or none does.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from devicekit._compat import apply_to_own_tensors
from devicekit._current import current_device
from devicekit._devices import DeviceLike, resolve_device, shown
from devicekit._errors import DeviceKitError

__all__ = ["materialize"]

_SHOWN = 20  # the unwritten tensors a message lists by path; the rest are counted


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
    are left as they are.

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
            ``reset_parameters`` covers).

    Returns:
        ``module`` itself, every tensor on real storage and written.

    Raises:
        DeviceKitError: A tensor given storage was written by no initialiser (it still
            holds the sentinel, NaN or an integer type's largest value, somewhere). The
            message names each by its path and the fix; the module's meta tensors are
            put back, so a retry with ``init=`` starts from the same model. Boolean
            tensors have no sentinel and are not checked.
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
    if not slots:
        return module
    storage = _Storage(target)
    with torch.no_grad():
        for _, submodule in _post_order(module):
            # Children first: an FSDP2 unit re-reads its parameters from their modules after
            # its own _apply, so every module of the unit must hold its new tensors by then.
            apply_to_own_tensors(submodule, storage.give)
    _tie_again(slots)
    try:
        with torch.no_grad():
            holders = {id(submodule) for submodule, _, _, _ in slots}
            for _, submodule in _post_order(module):
                if id(submodule) in holders:
                    _reset(submodule)
            if init is not None:
                for _, submodule in _post_order(module):
                    init(submodule)
    except BaseException:  # an initialiser failed: the model as it was, then its error
        _put_back(module, slots)
        raise
    unwritten = _unwritten(slots)
    if unwritten:
        _put_back(module, slots)
        raise DeviceKitError(_message(unwritten, len(storage.made), target))
    return module


# A submodule, a meta tensor's name on it, its path, and the meta tensor itself.
Slot = tuple[torch.nn.Module, str, str, torch.Tensor]


class _Storage:
    """The new tensors, each filled with its sentinel, one per meta tensor however often held."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.made: dict[int, torch.Tensor] = {}  # id(meta tensor) -> its new tensor

    def give(self, tensor: torch.Tensor) -> torch.Tensor:
        """Storage for a meta tensor (the same for each place it is held); others as they are."""
        if not tensor.is_meta:
            return tensor
        made = self.made.get(id(tensor))
        if made is None:
            made = self._empty(tensor)
            sentinel = _sentinel(made.dtype)
            if sentinel is not None:
                _local(made).fill_(sentinel)
            self.made[id(tensor)] = made
        return made

    def _empty(self, tensor: torch.Tensor) -> torch.Tensor:
        if type(tensor) in (torch.Tensor, torch.nn.Parameter):
            # empty_like of a meta tensor runs PyTorch's Python reference of it (~50 us);
            # empty_strided, the same layout, took materialize from 1.65x to 0.97x of
            # to_empty + reset_parameters (benchmarks/bench_materialize.py).
            return torch.empty_strided(
                tensor.size(), tensor.stride(), dtype=tensor.dtype, device=self.device
            )
        # A DTensor's empty_like keeps its mesh and placements: its shard gets the storage,
        # on the mesh's device type.
        return torch.empty_like(tensor, device=self._on(tensor))

    def _on(self, tensor: torch.Tensor) -> torch.device:
        mesh = getattr(tensor, "device_mesh", None)
        if mesh is not None and mesh.device_type != self.device.type:
            return torch.device(mesh.device_type)
        return self.device


def _meta_slots(module: torch.nn.Module) -> list[Slot]:
    """Every place a meta parameter or buffer is held: a tied one once per place."""
    return [
        (submodule, name, f"{prefix}.{name}" if prefix else name, tensor)
        for prefix, submodule in module.named_modules()
        for name, tensor in _own_named(submodule)
        if tensor.is_meta
    ]


def _own_named(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(recurse=False, remove_duplicate=False)
    yield from module.named_buffers(recurse=False, remove_duplicate=False)


def _post_order(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Submodules, children before their parents, as ``Module.apply`` visits them."""
    return list(reversed(list(module.named_modules())))


def _tie_again(slots: list[Slot]) -> None:
    """One parameter object in every place that held one meta parameter (tied weights).

    ``_apply`` wraps the one new tensor in a new Parameter per place that held it.
    """
    first: dict[int, torch.Tensor] = {}
    for submodule, name, _, meta in slots:
        kept = first.setdefault(id(meta), getattr(submodule, name))
        if kept is not getattr(submodule, name):
            setattr(submodule, name, kept)


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
    return torch.empty_like(tensor, device="meta") if id(tensor) in swapped else tensor


def _unwritten(slots: list[Slot]) -> dict[str, tuple[int, int]]:
    """The paths of new tensors still holding their sentinel: (elements unwritten, all)."""
    counts: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    checked: set[int] = set()
    for submodule, name, path, meta in slots:
        tensor = getattr(submodule, name)
        if id(meta) in checked or _sentinel(tensor.dtype) is None:
            continue
        checked.add(id(meta))
        counts.append((path, tensor, _count_sentinel(_local(tensor))))
    _agree(counts)
    numbers = _numbers([count for _, _, count in counts])
    return {
        path: (number, tensor.numel())
        for (path, tensor, _), number in zip(counts, numbers, strict=True)
        if number
    }


def _numbers(counts: list[torch.Tensor]) -> list[int]:
    """The counts as Python ints: one copy to the host per device, not one wait per tensor."""
    by_device: dict[torch.device, list[int]] = {}
    for position, count in enumerate(counts):
        by_device.setdefault(count.device, []).append(position)
    numbers = [0] * len(counts)
    for positions in by_device.values():
        stacked = torch.stack([counts[position] for position in positions]).tolist()
        for position, number in zip(positions, stacked, strict=True):
            numbers[position] = int(number)
    return numbers


def _reset(module: torch.nn.Module) -> None:
    for name in ("reset_parameters", "_reset_parameters"):
        reset = getattr(module, name, None)
        if callable(reset):
            reset()
            return


def _sentinel(dtype: torch.dtype) -> float | int | None:
    """What a new tensor holds until written: NaN, an integer's largest value; bool none."""
    if dtype.is_floating_point or dtype.is_complex:
        return math.nan
    if dtype == torch.bool:
        return None
    return int(torch.iinfo(dtype).max)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; a plain tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return (to_local() if callable(to_local) else tensor).detach()


def _count_sentinel(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        return torch.isnan(tensor).sum()
    return torch.eq(tensor, _sentinel(tensor.dtype) or 0).sum()


def _agree(counts: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
    """Sum each sharded tensor's count over its mesh, one all-reduce per mesh dimension.

    Every rank of the mesh materializes the same model, so each sees its sharded tensors
    in one order: a count in the same place on every rank, and every rank's verdict alike.
    """
    by_mesh: dict[int, tuple[Any, list[int]]] = {}
    for position, (_, tensor, _) in enumerate(counts):
        mesh = getattr(tensor, "device_mesh", None)
        if mesh is not None:
            by_mesh.setdefault(id(mesh), (mesh, []))[1].append(position)
    for mesh, positions in by_mesh.values():
        import torch.distributed as dist  # noqa: PLC0415 - only sharded models get here

        summed = torch.stack([counts[p][2] for p in positions]).to(mesh.device_type)
        for dimension in range(mesh.ndim):
            dist.all_reduce(summed, group=mesh.get_group(dimension))
        for position, count in zip(positions, summed.cpu(), strict=True):
            path, tensor, _ = counts[position]
            counts[position] = (path, tensor, count)


def _message(unwritten: dict[str, tuple[int, int]], made: int, device: torch.device) -> str:
    lines = [
        f"  {path}: {count} of {total} elements" if count < total else f"  {path}"
        for path, (count, total) in list(unwritten.items())[:_SHOWN]
    ]
    more = len(unwritten) - len(lines)
    if more:
        lines.append(f"  and {more} more")
    return (
        f"Expected every tensor given storage on {device} to be written by an initialiser, but "
        f"{len(unwritten)} of {made} hold what the empty storage held (checked by filling "
        "it with NaN, or an integer type's largest value, first):\n"
        + "\n".join(lines)
        + "\nNo module's reset_parameters() wrote them. Pass init=, a function of each "
        "submodule that sets them (a buffer computed in __init__ is computed again there), "
        "or give their modules a reset_parameters(). The module's meta tensors are back in "
        "place: call materialize again with init=."
    )
