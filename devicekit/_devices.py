"""Device specifications: what users write, checked against this machine.

Every devicekit function that takes ``device=`` goes through :func:`resolve_device`,
so ``"gpu"``, ``"cuda:7"`` on a one-GPU machine and ``"cuda:-1"`` fail the same way
everywhere, with the valid choices listed, before any data moves.
"""

from __future__ import annotations

import functools
from typing import TypeAlias, cast

import torch

from devicekit._errors import DeviceUnavailableError

__all__ = ["DeviceLike", "available_devices", "parse_device", "resolve_device"]

DeviceLike: TypeAlias = torch.device | str | int
"""What a ``device=`` argument accepts: a :class:`torch.device`, a string such as
``"cuda:0"``, or the index of a device of this machine's accelerator."""

# Devices that exist on every machine and carry no index.
_ALWAYS_AVAILABLE = ("cpu", "meta")
# Accelerator families in the order devicekit prefers them when nothing is asked for.
_ACCELERATORS = ("cuda", "xpu", "mps")
_EXAMPLES = "'cpu', 'cuda', 'cuda:0', 'mps', 'xpu' or 'meta'"

# Resolutions that cannot change while the process runs: "cpu", "meta", "cuda:1".
# Index-less accelerator specs are left out: they follow the current device.
_resolved: dict[object, torch.device] = {}


@functools.cache
def _device_count(device_type: str) -> int | None:
    """How many devices of a family this machine has; None for families devicekit cannot count."""
    if device_type == "mps":
        return 1 if torch.backends.mps.is_available() else 0
    module = getattr(torch, device_type, None)
    count = getattr(module, "device_count", None)
    if not callable(count):
        return None
    return int(count())


def available_devices() -> list[str]:
    """The devices this machine offers, as strings, for error messages and listings.

    >>> available_devices()[-2:]
    ['cpu', 'meta']
    """
    found = [
        f"{kind}:{index}" for kind in _ACCELERATORS for index in range(_device_count(kind) or 0)
    ]
    return [*found, *_ALWAYS_AVAILABLE]


def _choices() -> str:
    return ", ".join(repr(name) for name in available_devices())


@functools.cache
def _default_family() -> str:
    """The accelerator family a bare index refers to: the first found, else cpu."""
    return next((kind for kind in _ACCELERATORS if _device_count(kind)), "cpu")


def parse_device(spec: object) -> torch.device:
    """Parse a device spec without checking that this machine has the device.

    >>> parse_device("cuda:1"), parse_device(torch.device("cpu"))
    (device(type='cuda', index=1), device(type='cpu'))

    Raises:
        DeviceUnavailableError: The spec does not parse, or is an index with no accelerator.
        TypeError: The spec is neither a device, a string, nor an index.
    """
    if isinstance(spec, torch.device):
        return spec
    if isinstance(spec, str):
        try:
            return torch.device(spec)
        except RuntimeError:
            msg = (
                f"Expected a device such as {_EXAMPLES}, got {spec!r}. "
                f"Available here: {_choices()}."
            )
            raise DeviceUnavailableError(msg) from None
    if isinstance(spec, int) and not isinstance(spec, bool):
        accelerator = _default_family()
        if accelerator == "cpu":
            msg = (
                f"Expected an accelerator for the device index {spec}, but this machine has none. "
                f"Available here: {_choices()}."
            )
            raise DeviceUnavailableError(msg)
        if spec < 0:
            msg = f"Expected a device index of 0 or more, got {spec}. Available here: {_choices()}."
            raise DeviceUnavailableError(msg)
        return torch.device(accelerator, spec)
    msg = (
        f"Expected a device as a torch.device, a string such as {_EXAMPLES}, or an index, "
        f"got {type(spec).__name__} {spec!r}."
    )
    raise TypeError(msg)


def _check_available(device: torch.device, spec: object) -> torch.device:
    if device.type in _ALWAYS_AVAILABLE:
        return torch.device(device.type)  # "cpu:0" and "cpu" are one device; tensors say "cpu"
    count = _device_count(device.type)
    if count is None:
        # A family devicekit cannot count (xla, hpu, ...): trust the extension that registered it.
        return device
    if count == 0:
        why = (
            "this PyTorch build has no CUDA support"
            if device.type == "cuda" and torch.version.cuda is None and torch.version.hip is None
            else f"no {device.type} device is visible"
        )
        msg = (
            f"Expected an available device, got {spec!r}, but {why}. Available here: {_choices()}."
        )
        raise DeviceUnavailableError(msg)
    index = cast("int | None", device.index)  # None for "cuda", whatever the stubs say
    if index is None:
        index = 0 if device.type == "mps" else int(getattr(torch, device.type).current_device())
        return torch.device(device.type, index)
    if index >= count:
        msg = (
            f"Expected a {device.type} index from 0 to {count - 1}, got {spec!r}. "
            f"Available here: {_choices()}."
        )
        raise DeviceUnavailableError(msg)
    return device


def resolve_device(spec: DeviceLike) -> torch.device:
    """Turn what a user wrote into a concrete device of this machine.

    Accelerator devices always come back with an index (``"cuda"`` is the current
    CUDA device), so the result compares equal to ``tensor.device``.

    >>> resolve_device("cpu")
    device(type='cpu')
    >>> resolve_device("gpu")
    Traceback (most recent call last):
    ...
    devicekit.DeviceUnavailableError: Expected a device such as 'cpu', ... got 'gpu'. ...

    Args:
        spec: A :class:`torch.device`, a string such as ``"cuda:1"``, or an accelerator
            index.

    Returns:
        The device, with an index for accelerators.

    Raises:
        DeviceUnavailableError: The spec does not parse, or names a device this machine lacks.
        TypeError: The spec is neither a device, a string, nor an index.
    """
    try:
        return _resolved[spec]
    except (KeyError, TypeError):  # TypeError: an unhashable spec, reported by _parse below
        pass
    device = _check_available(parse_device(spec), spec)
    if isinstance(spec, int | str | torch.device) and (
        device.type in _ALWAYS_AVAILABLE or parse_device(spec).index is not None
    ):
        _resolved[spec] = device
    return device
