"""Packed copies, checked on the CPU: bytes, dtypes, shapes and shared storage."""

from __future__ import annotations

import torch

from devicekit._staging import PACK_MAX_BYTES, is_packable, packed_copy


def test_packed_copies_keep_values_dtypes_and_shapes() -> None:
    sources = [
        torch.arange(3, dtype=torch.int8),
        torch.randn(2, 5),
        torch.tensor(True),
        torch.zeros(0, 4),
        torch.randn(3, dtype=torch.complex64),
        torch.arange(7, dtype=torch.float64).reshape(7, 1),
        torch.randn(4, dtype=torch.float16),
    ]
    copies = packed_copy(sources, torch.device("cpu"), non_blocking=False, pin=False)
    for source, copy in zip(sources, copies, strict=True):
        assert copy.dtype == source.dtype
        assert copy.shape == source.shape
        assert torch.equal(copy, source)
        assert copy.data_ptr() != source.data_ptr() or source.numel() == 0


def test_packed_copies_share_one_buffer_with_aligned_views() -> None:
    sources = [torch.ones(3, dtype=torch.int8), torch.ones(2, dtype=torch.float64)]
    copies = packed_copy(sources, torch.device("cpu"), non_blocking=False, pin=False)
    storages = {copy.untyped_storage().data_ptr() for copy in copies}
    assert len(storages) == 1
    for copy in copies:
        assert copy.data_ptr() % copy.element_size() == 0


def test_what_is_packable() -> None:
    assert is_packable(torch.ones(4))
    assert not is_packable(torch.ones(4, requires_grad=True))
    assert not is_packable(torch.ones(4, 4).t())  # not contiguous
    assert not is_packable(torch.ones(PACK_MAX_BYTES // 4 + 1))  # too large to gain
    assert not is_packable(torch.ones(2, device="meta"))
    assert not is_packable(torch.nn.Parameter(torch.ones(2)))
