"""``stand_in()``: start the stand-in accelerator, once per process.

Starting it renames PyTorch's PrivateUse1 device type for the whole process (PyTorch
allows that once), registers the device module, a kernel for factories, the pinning of
CPU tensors and the save format, and points ``torch.accelerator``'s functions at the
device module. Nothing of this is undone: a process that starts it keeps it.
"""

from __future__ import annotations

import atexit
import functools
import sys
from collections.abc import Callable
from typing import Any, Final

import torch

from devicekit._base import (
    DeviceKitError,
    parse_bytes,
    privateuse1_name,
    python_backends,
    register_python_backend,
    swap_on_module_conversion,
    whole_number,
)
from devicekit.testing._stand_in import _device, _memory, _module, _saving, _tensor

__all__ = ["NAME", "stand_in"]

NAME: Final = "standin"
"""The stand-in's device type: ``torch.device("standin:1")``."""

_FIRST_RELEASE = "2.9"  # the first PyTorch with Python backends (pytorch#157859, July 2025)
_libraries: list[torch.library.Library] = []  # kept alive: dropping one unregisters its kernels

# torch.accelerator's functions that a Python backend's C++ side cannot serve, and what
# serves them instead.
_ACCELERATOR_FUNCTIONS: Final = {
    "device_count": _module.device_count,
    "current_device_index": _module.current_device,
    "current_device_idx": _module.current_device,
    "set_device_index": _module.set_device,
    "set_device_idx": _module.set_device,
    "current_stream": _module.current_stream,
    "set_stream": _module.set_stream,
    "synchronize": _module.synchronize,
    "empty_cache": _module.empty_cache,
    "get_memory_info": _module.mem_get_info,
    "max_memory_allocated": _module.max_memory_allocated,
    "max_memory_reserved": _module.max_memory_reserved,
    "memory_allocated": _module.memory_allocated,
    "memory_reserved": _module.memory_reserved,
    "memory_stats": _module.memory_stats,
    "reset_peak_memory_stats": _module.reset_peak_memory_stats,
}


def stand_in(devices: int = 2, *, memory: int | str | None = None) -> str:
    """Start a CPU-backed accelerator that PyTorch and devicekit treat as a GPU.

    Tensors on it hold real values, computed on the CPU, so a loop run on it computes
    what it computes on the CPU, bit for bit. It keeps CUDA's rules: mixing it with CPU
    tensors raises CUDA's error, and work that CUDA may run late (non-blocking copies,
    work on a side stream) runs as late as the program's waits allow, reading as NaN
    until then. See :doc:`/guide/testing`.

    Started once per process: it renames PyTorch's PrivateUse1 device. Asked again with
    the same arguments, it returns the same name.

    .. doctest::
       :skipif: True  # run by the tests, not the docs build, which it would change

       >>> import torch, devicekit.testing
       >>> name = devicekit.testing.stand_in()
       >>> x = torch.ones(2, device=f"{name}:1")
       >>> (x * 2).cpu(), x.device
       (tensor([2., 2.]), device(type='standin', index=1))

    Args:
        devices: How many devices, 1 or more.
        memory: Each device's capacity, in bytes or as ``"2GiB"``; None for the host's
            memory. Allocations past it raise :class:`torch.OutOfMemoryError`.

    Returns:
        Its device type, ``"standin"``.

    Raises:
        DeviceKitError: Started before with other arguments; another PrivateUse1 backend
            is registered; or this PyTorch has no Python backends (before 2.9).
        TypeError: ``devices`` is no whole number, or ``memory`` is neither a whole
            number nor a string.
        ValueError: ``devices`` is below 1, or ``memory`` is negative or a string that is
            no size.
    """
    asked = _asked(devices, memory)
    if _device._started:
        if _device.started() != asked:
            msg = (
                f"The stand-in accelerator was started with {_said(_device.started())} and "
                f"cannot start again with {_said(asked)}: it is started once per process."
            )
            raise DeviceKitError(msg)
        return NAME
    _refuse_where_unfit()
    _register(asked)
    return NAME


def _asked(devices: object, memory: object) -> _device.Started:
    """The stand-in ``stand_in(devices, memory=memory)`` asks for, its options checked."""
    count = whole_number(devices, 1, "devices")
    capacity = None if memory is None else parse_bytes(memory, "memory")
    return _device.Started(NAME, count, capacity)


def _said(record: _device.Started) -> str:
    memory = "the host's memory" if record.capacity is None else f"memory={record.capacity}"
    return f"devices={record.count} and {memory}"


def _refuse_where_unfit() -> None:
    if not python_backends():
        msg = (
            f"The stand-in accelerator needs PyTorch {_FIRST_RELEASE} or later (Python "
            f"backends); this is PyTorch {torch.__version__}."
        )
        raise DeviceKitError(msg)
    taken = privateuse1_name()
    if taken != "privateuseone":
        msg = (
            f"The stand-in accelerator cannot start: PyTorch's PrivateUse1 device is taken "
            f"by the {taken!r} backend, and a process has one."
        )
        raise DeviceKitError(msg)


def _register(record: _device.Started) -> None:
    capacity = record.capacity if record.capacity is not None else _host_memory()
    _device.start(record)
    _memory.start(record.count, capacity)
    register_python_backend(NAME, sys.modules[_module.__name__])
    found = torch.accelerator.current_accelerator()
    if found is None or found.type != NAME:
        msg = (
            f"The stand-in accelerator started, but torch.accelerator reports {found}: this "
            "PyTorch build has an accelerator of its own, which it prefers."
        )
        raise DeviceKitError(msg)
    # torch.library is untyped: its calls are checked by the tests, not by mypy.
    factories: Any = torch.library.Library("_", "IMPL")  # type: ignore[no-untyped-call]
    factories.fallback(_tensor.factory, "PrivateUse1")
    # autocast is accepted and casts nothing: operations run in the dtypes they are given.
    factories.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    pinning: Any = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
    pinning.impl("_pin_memory", _pin_memory, "CPU")
    pinning.impl("is_pinned", _is_pinned, "CPU")
    _libraries.extend((factories, pinning))
    _saving.register(_tensor.StandInTensor)
    # Autograd's engine gives each device index a thread, as many as the device guard
    # counts; a Python backend's counts one, so a backward on index 1 would fail an
    # internal assert. Backward passes run in the calling thread instead, as on the CPU.
    torch.autograd.backward = _in_calling_thread(torch.autograd.backward)
    torch.autograd.grad = _in_calling_thread(torch.autograd.grad)
    # torch.tensor(data, device=...) and its kin, given Python data (a list, a number),
    # fill a host tensor and copy it to the device with PyTorch's Python dispatch turned
    # off, which a Python backend's tensors cannot run without (an internal assert
    # fails). They fill it on the host here; the copy then runs as any .to() does.
    for owner, name in _BUILT_FROM_DATA:
        setattr(owner, name, _built_on_host(getattr(owner, name), method=owner is torch.Tensor))
    # Module.to keeps each Parameter object, as on CUDA, only where it can set the moved
    # tensor into it (a CPU and a CUDA tensor can; a Python backend's cannot) or swaps
    # the two, which it does for wrapper tensors it may trace. The stand-in's are not
    # for tracing (torch.compile runs its kernels eagerly), so it is named to the module
    # alone: an optimizer made before model.to() then holds the moved parameters.
    swap_on_module_conversion(lambda tensor: isinstance(tensor, _tensor.StandInTensor))
    for name, function in _ACCELERATOR_FUNCTIONS.items():
        setattr(torch.accelerator, name, function)
        if hasattr(torch.accelerator.memory, name):
            setattr(torch.accelerator.memory, name, function)
    _forget_what_devicekit_read()
    atexit.register(_memory.registered_at_exit)


_BUILT_FROM_DATA: Final = (
    (torch, "tensor"),
    (torch, "as_tensor"),
    (torch, "asarray"),
    (torch.Tensor, "new_tensor"),
)


def _built_on_host(function: Callable[..., Any], *, method: bool) -> Callable[..., Any]:
    @functools.wraps(function)
    def build(*args: Any, **kwargs: Any) -> Any:
        given = args[1:] if method else args
        data = given[0] if given else kwargs.get("data", kwargs.get("obj"))  # asarray's: obj
        device = kwargs.get("device")
        if device is None:  # new_tensor's default is its tensor's device
            device = args[0].device if method else torch.get_default_device()
        where = torch.device(device)
        if where.type != NAME or isinstance(data, torch.Tensor):
            return function(*args, **kwargs)  # a tensor's own copy to the device runs as .to()
        requires_grad = kwargs.pop("requires_grad", False)
        made = function(*args, **{**kwargs, "device": "cpu"})
        return made.to(where).requires_grad_(requires_grad)

    return build


def _in_calling_thread(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.autograd.set_multithreading_enabled(False):
            return function(*args, **kwargs)

    return run


def _pin_memory(tensor: torch.Tensor, device: Any = None) -> torch.Tensor:
    return _memory.pinned_copy(tensor)


def _is_pinned(tensor: torch.Tensor, device: Any = None) -> bool:
    return _memory.is_pinned(tensor)


def _host_memory() -> int:
    from devicekit._select import CpuBackend  # noqa: PLC0415 - the one reader of it

    total = CpuBackend().devices()[0].total_memory
    return total if total is not None else 16 << 30


def _forget_what_devicekit_read() -> None:
    """Devicekit read this build's accelerator once, as fixed; it changed."""
    from devicekit._base import forget_accelerator  # noqa: PLC0415
    from devicekit._select import forget_process_default  # noqa: PLC0415

    forget_accelerator()
    forget_process_default()
