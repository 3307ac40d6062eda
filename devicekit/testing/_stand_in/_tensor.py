"""The stand-in's tensors: CPU tensors behind a device of their own, under CUDA's rules.

A :class:`StandInTensor` is a wrapper: PyTorch sees a tensor of the stand-in's device
(``tensor.device``, dispatch, autograd, ``Module.to``), and every operation on it reaches
:meth:`StandInTensor.__torch_dispatch__`, which checks CUDA's rule on mixing devices
(:data:`MIXES`), runs the operation on the CPU tensors inside, in the order the streams
allow (``_streams``), and wraps what comes out. A factory given the device
(``torch.zeros(3, device=...)``) has no such tensor to dispatch on and reaches
:func:`factory` instead. The values are the CPU's, so a loop on the stand-in computes
what it computes on the CPU, bit for bit.

Mixing devices, as CUDA allows it. Each row is read from PyTorch's own checks:
TensorIterator takes a 0-dim CPU tensor as a number; indexing takes CPU indices ("indices
should be either on cpu or on the same device as the indexed tensor"); a ``_foreach_`` op
pairs its lists' tensors position by position. ``tests/test_stand_in.py`` runs the same
cases on CUDA where a GPU is visible (marked ``cuda``):

=========================================  =============================================
Operation                                  Tensors it takes from another device
=========================================  =============================================
``copy_``, ``to``/``_to_copy``             any: that is what a copy is for
every other operation                      0-dim CPU tensors, read as numbers
                                           (TensorIterator's CPU scalars)
indexing (``index``, ``index_put_``)       also CPU index tensors ("indices should be
                                           either on cpu or on the same device")
``_foreach_*``                             each position of the lists on its own device
=========================================  =============================================
"""

from __future__ import annotations

import copy
from typing import Any, Final

import torch

from devicekit._base import (
    not_traced,
    op_leaves,
    op_rebuilt,
    op_schema,
    tensor_text,
    wrapper_tensor,
)
from devicekit.testing._stand_in import _memory, _saving, _streams
from devicekit.testing._stand_in._device import index_of, started

__all__ = ["MIXES", "StandInTensor", "factory", "mismatch"]

_aten = torch.ops.aten
_COPIES: Final = frozenset({_aten.copy_.default, _aten._to_copy.default})
_INDEXING: Final = frozenset(
    {
        _aten.index.Tensor,
        _aten.index_put_.default,
        _aten.index_put.default,
        _aten._index_put_impl_.default,
    }
)

# Operations whose result the host reads before they return: a number (``item()``,
# ``equal``), or a tensor whose shape its input's values decide (``nonzero``, a boolean
# mask's selection). CUDA synchronizes the current stream for them.
_SHAPED_BY_VALUES: Final = frozenset(
    {
        _aten.nonzero.default,
        _aten.masked_select.default,
        _aten._unique2.default,
        _aten.unique_dim.default,
        _aten.unique_consecutive.default,
        _aten.repeat_interleave.Tensor,
        _aten.bincount.default,
    }
)
_NUMBERS: Final = frozenset({"NumberType", "BoolType", "IntType", "FloatType", "ComplexType"})

MIXES: Final = {
    "copies": "any device",
    "indexing": "0-dim CPU tensors and CPU index tensors",
    "_foreach_*": "each list position on one device; 0-dim CPU tensors",
    "others": "0-dim CPU tensors",
}
"""What each kind of operation takes from another device (the table above)."""


class StandInTensor(torch.Tensor):
    """A tensor of the stand-in device: a CPU tensor (``_data``) under a device of its own."""

    _data: torch.Tensor

    @staticmethod
    def __new__(cls: type[StandInTensor], data: torch.Tensor, index: int) -> StandInTensor:
        """Wrap ``data`` as a tensor of device ``index``, counted against its memory."""
        wrapper: StandInTensor = wrapper_tensor(cls, data, torch.device(started().name, index))
        wrapper._data = data
        _memory.charge(index, data)
        return wrapper

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        # As a GPU tensor prints: its values read to the host (a blocking copy), then
        # PyTorch's own suffixes (device, dtype, grad_fn).
        text = tensor_text(self, self.detach().cpu())
        return text.replace(f"{type(self).__name__}(", "tensor(", 1)

    def tolist(self) -> Any:
        """The values as nested lists, read to the host first as on CUDA."""
        return self.cpu().tolist()

    def __format__(self, format_spec: str) -> str:
        # Tensor.__format__ formats a 0-dim tensor's value for its own class only.
        if self.dim() == 0:
            return str(self.item().__format__(format_spec))
        return str(super().__format__(format_spec))  # type: ignore[no-untyped-call]

    def numpy(self, *, force: bool = False) -> Any:
        """Refused, as on CUDA: the values are on the device."""
        if force:
            return self.cpu().numpy()
        msg = (
            f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to "
            "copy the tensor to host memory first."
        )
        raise TypeError(msg)

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        # Tensor.__deepcopy__ clones, then deep-copies the attributes over the clone's:
        # the CPU tensor inside too, which would leave the copy's memory uncounted.
        if id(self) in memo:
            return memo[id(self)]  # type: ignore[no-any-return]
        with torch.no_grad():  # a StandInTensor: clone() runs through __torch_dispatch__
            copied = self.clone().requires_grad_(self.requires_grad)
        memo[id(self)] = copied
        for name, value in vars(self).items():
            if name != "_data":
                setattr(copied, name, copy.deepcopy(value, memo))
        if self.grad is not None:
            copied.grad = copy.deepcopy(self.grad, memo)
        return copied

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Saved as its values on the host, their storage tagged with this device, so that
        # torch.load's map_location moves them as it would a GPU's (see _saving).
        return _saving.reduce(self)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch's stub omits func
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Run ``func`` on the CPU tensors inside, in stream order, and wrap its results."""
        return _dispatch(func, args, kwargs or {})


@not_traced  # the device's kernels: not the program's to trace
def _dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if func is _aten.record_stream.default:
        # Tells a caching allocator not to reuse the memory before the stream's work is
        # done; here queued work holds the memory it uses until it runs: nothing to note.
        return None
    with _streams.LOCK:
        if func in _COPIES:
            return _copy(func, args, kwargs)
        return _run(func, args, kwargs)


def _name() -> str:
    return started().name


def _is_ours(device: Any) -> bool:
    return isinstance(device, torch.device) and device.type == _name()


def _unwrap(value: Any) -> Any:
    return value._data if isinstance(value, StandInTensor) else value


def mismatch(first: object, second: object) -> RuntimeError:
    """CUDA's refusal of two devices in one operation.

    >>> print(mismatch("standin:0", "cpu"))  # doctest: +NORMALIZE_WHITESPACE
    Expected all tensors to be on the same device, but found at least two devices,
    standin:0 and cpu!
    """
    return RuntimeError(
        "Expected all tensors to be on the same device, but found at least two devices, "
        f"{first} and {second}!"
    )


def _one_device(tensors: list[torch.Tensor], *, indices: bool = False) -> None:
    """Refuse tensors on two devices, except what CUDA takes from the CPU (see :data:`MIXES`)."""
    seen: torch.device | None = None
    for tensor in tensors:
        device = tensor.device
        if device.type == "cpu" and (tensor.dim() == 0 or indices):
            continue
        if seen is None:
            seen = device
        elif device != seen:
            raise mismatch(seen, device)


def _check_mix(func: Any, flat: list[Any], args: tuple[Any, ...]) -> None:
    if func.__name__.startswith("_foreach_"):
        lists = [arg for arg in args if isinstance(arg, (list, tuple))]
        singles = [arg for arg in args if isinstance(arg, torch.Tensor)]
        for position in zip(*lists, strict=False):
            _one_device([t for t in (*position, *singles) if isinstance(t, torch.Tensor)])
        return
    tensors = [value for value in flat if isinstance(value, torch.Tensor)]
    if func in _INDEXING:
        indices = args[1] if len(args) > 1 else ()
        index_ids = {id(t) for t in indices if isinstance(t, torch.Tensor)}
        _one_device([t for t in tensors if id(t) not in index_ids])
        for index in indices:
            if isinstance(index, torch.Tensor) and index.device.type != "cpu":
                _one_device([tensors[0], index])
        return
    _one_device(tensors)


def _target(flat: list[Any], kwargs: dict[str, Any]) -> int | None:
    """The stand-in device index the result goes to; None for a result on the host."""
    device = kwargs.get("device")
    if device is not None:
        return index_of(device) if _is_ours(device) else None
    for value in flat:
        if isinstance(value, StandInTensor):
            return int(value.device.index)
    return None


def _host_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the stand-in's device swapped for the CPU, where the work runs."""
    if not _is_ours(kwargs.get("device")):
        return kwargs
    return {**kwargs, "device": torch.device("cpu")}


def _wrap(result: Any, inputs: dict[int, StandInTensor], index: int | None) -> Any:
    """Put results on the stand-in: an input's own data comes back as that input."""
    flat, spec = op_leaves(result)
    return op_rebuilt([_placed(value, inputs, index) for value in flat], spec)


def _placed(value: Any, inputs: dict[int, StandInTensor], index: int | None) -> Any:
    if not isinstance(value, torch.Tensor) or isinstance(value, StandInTensor):
        return value
    kept = inputs.get(id(value))
    if kept is not None:
        return kept
    return value if index is None else StandInTensor(value, index)


def _writes(func: Any) -> bool:
    return any(
        arg.alias_info is not None and arg.alias_info.is_write for arg in op_schema(func).arguments
    )


def _is_view(func: Any) -> bool:
    return any(
        ret.alias_info is not None and not ret.alias_info.is_write
        for ret in op_schema(func).returns
    )


def _reads_values(func: Any, args: tuple[Any, ...]) -> bool:
    """Whether ``func`` hands the host what its inputs' values decide (it synchronizes)."""
    if func in _SHAPED_BY_VALUES:
        return True
    if func is _aten.index.Tensor:  # a boolean mask selects as many as it holds True
        masks = (torch.bool, torch.uint8)
        return any(isinstance(i, torch.Tensor) and i.dtype in masks for i in args[1])
    return any(ret.type.kind() in _NUMBERS for ret in op_schema(func).returns)


def _run(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    flat, spec = op_leaves((args, kwargs))
    _check_mix(func, flat, args)
    index = _target(flat, kwargs)
    inputs = {id(value._data): value for value in flat if isinstance(value, StandInTensor)}
    host_args, host_kwargs = op_rebuilt([_unwrap(value) for value in flat], spec)
    host_kwargs = _host_kwargs(host_kwargs)
    if index is None:
        return _wrap(func(*host_args, **host_kwargs), inputs, index)
    queue = _streams.current_queue(index)
    if queue.stream_id != 0 and not _is_view(func) and not _reads_values(func, args):
        return _later(func, (host_args, host_kwargs), inputs, index, queue)
    queue.run_all()  # what was issued to this stream before runs first
    return _wrap(func(*host_args, **host_kwargs), inputs, index)


def _later(
    func: Any,
    host: tuple[tuple[Any, ...], dict[str, Any]],
    inputs: dict[int, StandInTensor],
    index: int,
    queue: _streams.Queue,
) -> Any:
    """Issue ``func`` to a side stream: it reads its inputs when the stream's work runs.

    An operation that writes its arguments writes them then. One that makes new tensors
    is run now only for their shapes: they hold poison until the stream's work runs.
    """
    host_args, host_kwargs = host
    if _writes(func):
        queue.issue(lambda: func(*host_args, **host_kwargs))
        return _wrap(_written_results(func, host_args, host_kwargs), inputs, index)
    shaped = func(*host_args, **host_kwargs)
    flat, spec = op_leaves(shaped)
    poisoned = [_poisoned_like(value) for value in flat]

    def work() -> None:
        results, _ = op_leaves(func(*host_args, **host_kwargs))
        for into, value in zip(poisoned, results, strict=True):
            if isinstance(into, torch.Tensor):
                into.copy_(value)

    queue.issue(work)
    return _wrap(op_rebuilt(poisoned, spec), inputs, index)


def _poisoned_like(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    empty = torch.empty_like(value)
    _streams.poison(empty)
    return empty


def _written_results(func: Any, host_args: tuple[Any, ...], host_kwargs: dict[str, Any]) -> Any:
    """What an operation that writes its arguments returns: those arguments."""
    schema = op_schema(func)
    named = dict(zip([arg.name for arg in schema.arguments], host_args, strict=False))
    named.update(host_kwargs)
    results = []
    for ret in schema.returns:
        alias = ret.alias_info
        found = None
        if alias is not None:
            for arg in schema.arguments:
                if arg.alias_info is not None and arg.alias_info.before_set == alias.before_set:
                    found = named.get(arg.name)
        results.append(found)
    return results[0] if len(results) == 1 else tuple(results) if results else None


# The copies: where host and device meet, and where CUDA's asynchrony shows.


def _pinned(tensor: torch.Tensor) -> bool:
    return _memory.is_pinned(tensor)


def _copy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if func is _aten._to_copy.default:
        source = args[0]
        device = kwargs.get("device")
        if device is None or device == source.device:
            return _run(func, args, kwargs)
        blocking = not kwargs.get("non_blocking", False)
        rest = {
            k: v for k, v in kwargs.items() if k not in ("device", "non_blocking", "pin_memory")
        }
        shaped = func(_unwrap(source), **rest)  # the copy's dtype, layout and strides, now
        if not _is_ours(device):
            pinned = not blocking
            if pinned:
                shaped = _memory.pinned_copy(shaped)  # PyTorch pins a non-blocking copy's result
            _into_host(shaped, source, blocking=blocking)
            return shaped
        index = index_of(device)
        target = StandInTensor(shaped, index)
        _into_device(target, source, blocking=blocking)
        return target
    destination, source = args[0], args[1]
    blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    if isinstance(destination, StandInTensor) and isinstance(source, StandInTensor):
        if destination.device == source.device:
            return _run(func, args, kwargs)
        _into_device(destination, source, blocking=True)
        return destination
    if isinstance(destination, StandInTensor):
        _into_device(destination, source, blocking=blocking)
        return destination
    _into_host(destination, source, blocking=blocking or not _pinned(destination))
    return destination


def _into_device(target: StandInTensor, source: Any, *, blocking: bool) -> None:
    """Copy host memory (or a 0-dim CPU value) into a stand-in tensor, on the current stream.

    Non-blocking from pinned memory, the copy reads its source when it runs: a source
    written since it was issued gives poison. From pageable memory, CUDA reads the
    source at once; what the copy writes still waits for the stream.
    """
    index = int(target.device.index)
    queue = _streams.current_queue(index)
    data = target._data
    if isinstance(source, StandInTensor):  # from another index: a peer copy reads it now
        _streams.current_queue(int(source.device.index)).run_all()
        source = source._data
    if blocking:
        queue.run_all()
        data.copy_(source)
        return
    late = _pinned(source)
    kept = source.clone()
    _streams.poison(data)

    def work() -> None:
        if late and not _same_bytes(source, kept):
            return  # rewritten while the copy was in flight: a GPU reads a mix; poison stays
        data.copy_(kept)

    queue.issue(work)


def _into_host(target: torch.Tensor, source: StandInTensor, *, blocking: bool) -> None:
    """Copy a stand-in tensor into host memory; non-blocking, it lands when waited for."""
    queue = _streams.current_queue(int(source.device.index))
    data = source._data
    if blocking:
        queue.run_all()
        target.copy_(data)
        return
    _streams.poison(target)

    def work() -> None:
        target.copy_(data)

    queue.issue(work)


def _same_bytes(now: torch.Tensor, kept: torch.Tensor) -> bool:
    if now.dtype.is_floating_point or now.dtype.is_complex:
        return bool(
            torch.equal(now.contiguous().view(torch.uint8), kept.contiguous().view(torch.uint8))
        )
    return bool(torch.equal(now, kept))


def factory(op: Any, *args: Any, **kwargs: Any) -> Any:
    """The PrivateUse1 fallback: an operation whose only tie to the stand-in is ``device=``.

    Allocating (``empty``, the destination of every copy to the device) waits for no
    work, and gives poison, as recycled device memory holds what it held. One that writes
    values (``scalar_tensor``, ``randperm``) is work on the current
    stream: after what was issued there, and on a side stream, poison until it runs.
    """
    device = kwargs.get("device")
    if not _is_ours(device):
        msg = f"The {_name()} stand-in has no kernel for {op} without one of its tensors."
        raise NotImplementedError(msg)
    index = index_of(device)
    host = {**kwargs, "device": torch.device("cpu")}
    host.pop("pin_memory", None)
    with _streams.LOCK:
        if op_schema(op).name.startswith("aten::empty"):
            return StandInTensor(_poisoned_like(op(*args, **host)), index)
        queue = _streams.current_queue(index)
        if queue.stream_id == 0:
            queue.run_all()
            return StandInTensor(op(*args, **host), index)
        values = op(*args, **host)
        made = _poisoned_like(values)

        def work() -> None:
            made.copy_(values)

        queue.issue(work)
        return StandInTensor(made, index)
