"""Packed transfers, checked on the CPU: values, what is packed, the sharing bound, autograd.

The packed path stages small host tensors in one buffer and sends it in chunks. With the
CPU as the target (each chunk still its own allocation) the values are checked against
the sources themselves; with ``meta`` standing in for the accelerator, to_device's use
of it (aliasing, what goes packed and what alone) is checked through the whole walk.
"""

from __future__ import annotations

import io
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import devicekit as dk
from devicekit._base import _devices
from devicekit._core import _packing
from devicekit._core._packing import CHUNK_BYTES, PACK_MAX_BYTES, pack
from devicekit._core._transfer import as_accelerator
from devicekit.testing import tensors

from .helpers import CPU, META, tensor_leaves

PACKABLE_DTYPES = sorted(_packing._PACKABLE_DTYPES, key=str)


def _packed(sources: list[torch.Tensor], **options: Any) -> dict[int, torch.Tensor]:
    return pack(sources, CPU, non_blocking=False, pin=False, **options)


def _many(make: Any, count: int = 16) -> list[torch.Tensor]:
    return [make(index) for index in range(count)]


def _assert_copies(sources: list[torch.Tensor], moved: dict[int, torch.Tensor]) -> None:
    for source in sources:
        copy = moved[id(source)]
        assert copy.dtype == source.dtype
        assert copy.shape == source.shape
        assert torch.equal(copy, source)
        assert copy.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", PACKABLE_DTYPES, ids=str)
def test_every_packable_dtype_arrives_exact(dtype: torch.dtype) -> None:
    values = torch.arange(-30, 30).reshape(4, 15)
    sources = _many(lambda i: (values + i).to(dtype) if dtype is not torch.bool else values > i)
    moved = _packed(sources)
    assert len(moved) == len(sources)
    _assert_copies(sources, moved)


def test_shapes_scalars_views_and_mixed_first_dimensions_arrive_exact() -> None:
    base = torch.arange(600.0).reshape(20, 30)
    sources = [
        *_many(lambda i: torch.tensor(float(i))),  # 0-d: stacked, then unbound
        *_many(lambda i: torch.rand(i + 1, 4)),  # boxes of every count: one cat, one split
        *_many(lambda i: base[i : i + 3, ::2]),  # strided views of one base
        *_many(lambda i: base[:, i].clone().reshape(5, 2, 2)),
        *_many(lambda i: torch.randn(3, dtype=torch.complex64).conj()),  # the conj bit
    ]
    moved = _packed(sources)
    assert len(moved) == len(sources)
    _assert_copies(sources, moved)


@given(st.lists(tensors(), min_size=0, max_size=40))
def test_whatever_is_packed_equals_its_source(sources: list[torch.Tensor]) -> None:
    moved = _packed(sources)
    assert set(moved) <= {id(source) for source in sources}
    for source in sources:
        if id(source) in moved:
            copy = moved[id(source)]
            assert (copy.dtype, copy.shape) == (source.dtype, source.shape)
            assert torch.equal(copy, source)


def test_what_is_left_to_go_alone() -> None:
    alike = _many(lambda i: torch.ones(8))
    left = {
        "tracked by autograd": _many(lambda i: torch.ones(8, requires_grad=True)),
        "too large to gain": _many(lambda i: torch.ones(PACK_MAX_BYTES // 4 + 1), 4),
        "empty": _many(lambda i: torch.ones(0, 3)),
        "not on the host": _many(lambda i: torch.ones(8, device="meta")),
        "sparse": _many(lambda i: torch.ones(8).to_sparse()),
        "an exotic dtype": _many(lambda i: torch.ones(8, dtype=torch.float8_e4m3fn)),
    }
    moved = _packed(alike + [t for group in left.values() for t in group])
    assert set(moved) == {id(t) for t in alike}


def _nested() -> torch.Tensor:
    with warnings.catch_warnings():  # PyTorch: nested tensors are a prototype
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])


@pytest.mark.parametrize("odd", ["sparse", "nested", "tracked by autograd"])
def test_tensors_packing_cannot_take_are_left_out_wherever_they_come(odd: str) -> None:
    # Packing reads shapes and sizes and gathers without checking each tensor first:
    # PyTorch refuses these, first in their group or not, and packing goes on without them.
    make = {
        "sparse": lambda: torch.ones(8).to_sparse(),
        "nested": _nested,
        "tracked by autograd": lambda: torch.ones(8, requires_grad=True),
    }[odd]
    alike = _many(lambda i: torch.full((8,), float(i)))
    first, middle = make(), make()
    moved = _packed([first, *alike[:8], middle, *alike[8:]])
    assert set(moved) == {id(t) for t in alike}
    _assert_copies(alike, moved)
    if odd == "nested":
        return  # PyTorch moves no nested tensor to meta: to_device is checked with the others
    # meta stands in for the accelerator: no sparse tensor goes to the stand-in.
    with as_accelerator("meta"):
        batch = dk.to_device({"odd": [first, middle], "alike": alike}, "meta")
    assert [t.device for t in batch["odd"]] == [META, META]
    assert [t.layout for t in batch["odd"]] == [first.layout, middle.layout]
    assert all(t.untyped_storage().nbytes() > t.nbytes for t in batch["alike"])  # packed


def test_without_autograd_tensors_that_require_grad_are_packed_as_to_copies_them() -> None:
    sources = _many(lambda i: torch.full((8,), float(i), requires_grad=True))
    with torch.no_grad():
        moved = _packed(sources)
        one_by_one = [source.to(CPU, copy=True) for source in sources]
    _assert_copies(sources, moved)
    assert [moved[id(s)].requires_grad for s in sources] == [t.requires_grad for t in one_by_one]
    assert not any(t.requires_grad for t in one_by_one)


def test_packing_happens_only_where_the_cost_model_says_it_pays() -> None:
    assert _packed(_many(lambda i: torch.ones(8), 4)) == {}  # a few copies are cheaper
    unlike = [torch.ones(i + 1, i + 2) for i in range(12)]  # one run each, no two alike
    assert _packed(unlike) == {}
    assert len(_packed(_many(lambda i: torch.ones(8), 32))) == 32


def test_a_kept_result_shares_at_most_one_chunk() -> None:
    labels = _many(lambda i: torch.tensor([i]), 100)
    images = _many(lambda i: torch.randn(6, 1024), 100)  # 24 KiB each, 2.4 MB in all
    moved = _packed([*labels, *images])
    kept = moved[id(labels[0])]  # one label, kept beyond the batch
    assert kept.untyped_storage().nbytes() <= CHUNK_BYTES
    saved = io.BytesIO()
    torch.save(kept, saved)
    assert len(saved.getvalue()) <= CHUNK_BYTES + 4096  # the chunk, not the batch
    storages = {copy.untyped_storage().data_ptr() for copy in moved.values()}
    assert len(storages) >= 2_400_000 // CHUNK_BYTES
    own = kept.clone()  # how a tensor gets storage of its own, as the docs say
    assert own.untyped_storage().nbytes() == kept.nbytes


def test_pieces_are_tensors_of_their_own_to_autograd() -> None:
    images = _many(lambda i: torch.randn(4, 4))
    labels = _many(lambda i: torch.tensor([i, i + 1]))
    moved = _packed(images + labels)
    image, label = moved[id(images[0])], moved[id(labels[0])]
    weight = torch.ones(4, 4, requires_grad=True)
    loss = (image * weight).sum()  # saves image for backward
    label.sub_(1)  # a batch-mate changed in place: not the saved image's version
    other = moved[id(images[1])]
    other.mul_(2)
    loss.backward()
    assert torch.equal(weight.grad, images[0])
    scale = torch.ones(4, 4, requires_grad=True)
    moved[id(images[2])].mul_(scale)  # an in-place op that joins the graph
    piece = moved[id(images[3])].requires_grad_()
    (piece * 2).sum().backward()
    assert torch.equal(piece.grad, torch.full((4, 4), 2.0))


def test_a_dtype_is_applied_to_floating_runs_only() -> None:
    floats = _many(lambda i: torch.randn(3))
    ints = _many(lambda i: torch.arange(3) + i)
    moved = _packed(floats + ints, dtype=torch.float16)
    for source in floats:
        assert moved[id(source)].dtype == torch.float16
        assert torch.equal(moved[id(source)], source.half())
    for source in ints:
        assert moved[id(source)].dtype == torch.int64
        assert torch.equal(moved[id(source)], source)


def test_runs_that_span_chunks_arrive_whole() -> None:
    sources = _many(lambda i: torch.full((1024,), float(i)), 300)  # 1.2 MB: 5 chunks
    moved = _packed(sources)
    _assert_copies(sources, moved)
    assert len({copy.untyped_storage().data_ptr() for copy in moved.values()}) == 5


# to_device's use of packing, with meta standing in for the accelerator: these read how
# the copies share storage, which the stand-in's tensors (wrappers) do not show; its
# values are checked on the stand-in in tests/test_properties.py.


def test_to_device_packs_small_tensors_and_sends_the_rest_alone() -> None:
    shared = torch.ones(8)
    batch = {
        "images": _many(lambda i: torch.randn(3, 8, 8), 20),
        "shared": [shared, shared],
        "big": torch.ones(PACK_MAX_BYTES),
        "grad": torch.ones(2, requires_grad=True),
        "ids": list(range(20)),
    }
    with as_accelerator("meta"):
        moved = dk.to_device(batch, "meta")
    assert all(t.device == META for t in tensor_leaves(moved))
    assert moved["shared"][0] is moved["shared"][1]  # aliases stay aliases
    assert moved["ids"] == batch["ids"]
    storage = {t.untyped_storage().nbytes() for t in moved["images"]}
    assert max(storage) <= CHUNK_BYTES
    assert moved["images"][0].untyped_storage().nbytes() > moved["images"][0].nbytes  # packed
    assert moved["big"].untyped_storage().nbytes() == batch["big"].nbytes  # alone
    assert moved["grad"].grad_fn is not None  # alone, so autograd follows the copy


def test_packing_is_off_where_it_cannot_gain(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = _many(lambda i: torch.randn(3, 8, 8), 20)
    for moved in (dk.to_device(batch, "meta"), dk.to_device(batch, "meta", non_blocking=False)):
        assert all(t.untyped_storage().nbytes() == t.nbytes for t in moved)
    assert not _packing.packs_to(META)
    # The build's accelerator, as torch.accelerator names it, packs; MPS does not.
    for accelerator, packs in (("cuda", True), ("xpu", True), ("mps", False), (None, False)):
        monkeypatch.setattr(_devices, "accelerator_type", lambda a=accelerator: a)
        device = torch.device(accelerator or "cuda", 0)
        assert _packing.packs_to(device) is packs, accelerator
