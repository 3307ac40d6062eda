"""Packed copies: many small host tensors travel to an accelerator as one.

Each host->device copy costs a fixed few microseconds however small it is, so a
batch of a thousand 4 KiB tensors spends its time launching copies, not moving
bytes. Packing gathers the small tensors into one (pinned) staging buffer on the
host, sends that buffer in one copy, and hands back views of the device buffer.

The staging buffer comes from PyTorch's caching pinned-memory allocator: it records
an event for every asynchronous copy out of a pinned block and does not hand the
block out again before that event has completed, so a buffer is never rewritten
while its copy is still in flight.
"""

from __future__ import annotations

from typing import Final

import torch

__all__ = ["PACKABLE_DEVICE_TYPES", "PACK_MAX_BYTES", "is_packable", "packed_copy"]

PACK_MAX_BYTES: Final = 256 * 1024
"""Tensors up to this size are packed; larger ones are bandwidth-bound and go alone."""

PACKABLE_DEVICE_TYPES: Final = frozenset({"cuda", "xpu"})
"""Targets whose host->device copies gain from pinned, packed staging."""


def is_packable(tensor: torch.Tensor) -> bool:
    """Whether a host tensor can travel inside a packed copy unchanged.

    Packing copies raw bytes, so it takes only plain, dense, contiguous tensors that
    no autograd graph tracks (a packed copy would cut the graph).

    >>> is_packable(torch.ones(3)), is_packable(torch.ones(3, requires_grad=True))
    (True, False)
    """
    return (
        type(tensor) is torch.Tensor
        and tensor.device.type == "cpu"
        and tensor.layout is torch.strided
        and not tensor.requires_grad
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
        and tensor.nbytes <= PACK_MAX_BYTES
        and tensor.is_contiguous()
    )


def packed_copy(
    tensors: list[torch.Tensor], device: torch.device, *, non_blocking: bool, pin: bool = True
) -> list[torch.Tensor]:
    """Copy packable host tensors to ``device`` through one staging buffer.

    >>> a, b = torch.arange(3), torch.tensor([0.5, 1.5])
    >>> packed_copy([a, b], torch.device("cpu"), non_blocking=False, pin=False)
    [tensor([0, 1, 2]), tensor([0.5000, 1.5000])]

    Args:
        tensors: Tensors for which :func:`is_packable` holds.
        device: Where the copies go.
        non_blocking: Whether the one host->device copy is asynchronous.
        pin: Stage in pinned memory (needs an accelerator); False serves tests on the CPU.

    Returns:
        The copies, in the order of ``tensors``: views of one buffer on ``device``,
        each with its source's dtype and shape.
    """
    # Widest elements first: every offset is then a multiple of each tensor's element
    # size, so each slice of the byte buffer can be viewed as its own dtype.
    order = sorted(range(len(tensors)), key=lambda i: tensors[i].element_size(), reverse=True)
    total = sum(tensor.nbytes for tensor in tensors)
    staging = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    torch.cat([tensors[i].reshape(-1).view(torch.uint8) for i in order], out=staging)
    on_device = staging.to(device, non_blocking=non_blocking)
    copies: list[torch.Tensor] = [on_device] * len(tensors)
    offset = 0
    for i in order:
        tensor = tensors[i]
        piece = on_device[offset : offset + tensor.nbytes]
        copies[i] = piece.view(tensor.dtype).view(tensor.shape)
        offset += tensor.nbytes
    return copies
