"""The exception hierarchy: every error devicekit raises on purpose derives from one base."""

from __future__ import annotations

import torch

__all__ = [
    "DeviceKitError",
    "DeviceMismatchError",
    "DeviceUnavailableError",
    "LeafError",
    "TransferError",
]


class DeviceKitError(RuntimeError):
    """Base class of every error devicekit raises on purpose.

    It derives from :class:`RuntimeError`, the class PyTorch raises for device
    problems, so code that already catches PyTorch's errors keeps working.

    >>> import torch, devicekit as dk
    >>> try:
    ...     dk.to_device(torch.ones(1), "gpu")
    ... except dk.DeviceKitError as error:
    ...     print(type(error).__name__)
    DeviceUnavailableError
    """

    __module__ = "devicekit"


class DeviceUnavailableError(DeviceKitError):
    """A device was asked for that cannot be used here.

    Raised for device specifications that do not parse (``"gpu"``,
    ``"cuda:abc"``) and for devices this machine does not have (``"cuda:7"``
    with one GPU). The message lists the devices that are available.

    >>> import devicekit as dk
    >>> dk.DeviceManager("cuda:abc")
    Traceback (most recent call last):
    ...
    devicekit.DeviceUnavailableError: Expected a device such as 'cpu', ... got 'cuda:abc'. ...
    """

    __module__ = "devicekit"


class DeviceMismatchError(DeviceKitError):
    """Tensors that must share one device were found on several.

    >>> import torch, devicekit as dk
    >>> try:
    ...     dk.check_same_device([torch.ones(1), torch.ones(1, device="meta")])
    ... except dk.DeviceMismatchError as error:
    ...     print(error.devices)
    {device(type='cpu'): ['data[0]'], device(type='meta'): ['data[1]']}

    Attributes:
        devices: Every device seen, with the paths of the tensors found there, such as
            ``{device("cpu"): ["data['image']"], device("cuda", 0): ["Net.fc.weight"]}``.
    """

    __module__ = "devicekit"

    def __init__(self, message: str, devices: dict[torch.device, list[str]] | None = None) -> None:
        super().__init__(message)
        self.devices = {} if devices is None else devices


class TransferError(DeviceKitError):
    """Data could not be moved to a device.

    The message names the path of the offending object inside the data
    (for example ``data['batch'][3]``) and says what was expected there.

    >>> import torch, devicekit as dk
    >>> dk.to_device({"weights": [torch.ones(1, device="meta")]}, "cpu")
    Traceback (most recent call last):
    ...
    devicekit.TransferError: Cannot move data['weights'][0] to cpu: it is a tensor on the meta ...
    """

    __module__ = "devicekit"


class LeafError(Exception):
    """Raised inside a walk by code that knows what went wrong but not where.

    Internal: the traversal engine fills ``{path}`` in the message with the path of the
    object that failed and raises :class:`TransferError` in its place.
    """

    @property
    def template(self) -> str:
        """The message, with ``{path}`` where the path goes."""
        return str(self.args[0])
