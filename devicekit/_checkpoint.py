"""load: torch.load onto the device devicekit selected, safely by default."""

from __future__ import annotations

import os
from typing import IO, Any

import torch

from devicekit._devices import DeviceLike, resolve_device
from devicekit._manager import current_device

__all__ = ["load"]


def load(
    f: str | os.PathLike[str] | IO[bytes],
    device: DeviceLike | None = None,
    *,
    weights_only: bool = True,
) -> Any:
    """``torch.load`` with every tensor mapped to the device, wherever it was saved.

    A checkpoint saved on ``cuda:3`` of another machine loads onto this process's
    device; under torchrun that is ``cuda:LOCAL_RANK``, so eight ranks do not all land
    on ``cuda:0``. ``weights_only=True`` refuses pickles that would run code.

    >>> import io, torch, devicekit as dk
    >>> buffer = io.BytesIO()
    >>> torch.save({"weight": torch.ones(2)}, buffer)
    >>> _ = buffer.seek(0)
    >>> dk.load(buffer, "meta")["weight"].device
    device(type='meta')

    Args:
        f: A path or a binary file object, as ``torch.load`` takes.
        device: Where the tensors go; None for :func:`~devicekit.current_device`.
        weights_only: Load tensors, containers and plain data only (PyTorch's safe
            mode). Pass False only for checkpoints you trust.

    Returns:
        What was saved, its tensors on ``device``.
    """
    target = current_device() if device is None else resolve_device(device)
    return torch.load(f, map_location=target, weights_only=weights_only)
