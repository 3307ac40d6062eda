"""load: torch.load onto the device devicekit selected, safely by default."""

from __future__ import annotations

import os
import pickle
from typing import IO, Any

import torch

from devicekit._checks import find_devices
from devicekit._devices import DeviceLike, resolve_device, shown
from devicekit._errors import TransferError
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

    Raises:
        TypeError: ``weights_only`` is not True or False: anything else could be read as
            permission to run the pickle's code.
        ValueError: The file is empty, or not one written by ``torch.save``.
        TransferError: The checkpoint holds tensors on the meta device (a shape and no
            data), which no map_location can give data to; the message names them.
    """
    if weights_only is not True and weights_only is not False:  # for untyped callers
        msg = (  # type: ignore[unreachable]
            f"Expected weights_only to be True or False, got {weights_only!r}: False runs "
            "the code a pickle holds, so devicekit takes nothing else for it."
        )
        raise TypeError(msg)
    target = current_device() if device is None else resolve_device(device)
    try:
        loaded = torch.load(f, map_location=target, weights_only=weights_only)
    except (EOFError, pickle.UnpicklingError, KeyError, UnicodeDecodeError) as err:
        # What torch.load raises for a file it cannot read: an empty one (EOFError
        # without a message), text (KeyError: 101, the byte 'e'), a truncated pickle.
        # Its refusal of a real checkpoint under weights_only says what to do: kept.
        if "Weights only load failed" in str(err):
            raise
        name = getattr(f, "name", f) if not isinstance(f, str | os.PathLike) else f
        if isinstance(err, EOFError):
            why = "is empty, or ends before its first object"
        else:
            why = f"is not one (reading it, PyTorch raised {type(err).__name__}: {shown(str(err))})"
        msg = f"Expected a file written by torch.save, but {shown(str(name), limit=300)} {why}."
        raise ValueError(msg) from err
    if target.type != "meta":
        without_data = find_devices(loaded).get(torch.device("meta"))
        if without_data:
            listed = ", ".join(without_data[:3]) + (
                f" and {len(without_data) - 3} more" if len(without_data) > 3 else ""
            )
            msg = (
                f"Expected a checkpoint with data to load onto {target}, but it holds "
                f"tensors on the meta device, which have a shape and no data: {listed}. It "
                "was saved from a model that was never given its weights (created on meta, "
                "or with to_empty() still to come); save it after the weights are loaded."
            )
            raise TransferError(msg)
    return loaded
