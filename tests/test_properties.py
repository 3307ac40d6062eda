"""Properties of to_device over random nested batches (st.recursive over every container kind)."""

from __future__ import annotations

import os
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import devicekit as dk
from devicekit._core._transfer import as_accelerator
from devicekit.testing import assert_batches_equal, batches, tensors

from .helpers import CPU, META, assert_unchanged, snapshot, tensor_leaves
from .reference import assert_moved_like, reference_move


@given(batches(), st.sampled_from([META, CPU]), st.sampled_from([None, torch.float16]))
def test_to_device_does_what_the_reference_does(
    batch: Any, device: torch.device, dtype: torch.dtype | None
) -> None:
    # The reference (tests/reference.py) knows nothing of devicekit's walker.
    assert_moved_like(
        dk.to_device(batch, device, dtype=dtype), reference_move(batch, device, dtype=dtype)
    )


@given(batches())
def test_every_tensor_lands_on_the_target(batch: Any) -> None:
    moved = dk.to_device(batch, META)
    assert all(tensor.device == META for tensor in tensor_leaves(moved))


@given(batches(), st.sampled_from([None, torch.float64, torch.float16]))
def test_values_are_equal_after_a_cpu_round_trip(batch: Any, dtype: torch.dtype | None) -> None:
    moved = dk.to_device(batch, CPU, dtype=dtype, copy=True)
    for before, after in zip(tensor_leaves(batch), tensor_leaves(moved), strict=True):
        expected = before.to(dtype) if dtype is not None and before.is_floating_point() else before
        assert after.dtype == expected.dtype
        assert torch.equal(after, expected)


@given(batches())
def test_the_input_is_unchanged(batch: Any) -> None:
    before = snapshot(batch)
    dk.to_device(batch, META, dtype=torch.float16)
    assert_unchanged(batch, before)


@given(st.lists(tensors(), min_size=1, max_size=4), st.data())
def test_aliasing_is_preserved(pool: list[torch.Tensor], data: st.DataObject) -> None:
    # Build a batch whose leaves are drawn, with repeats, from a small pool of tensors.
    batch = data.draw(batches(leaves=st.sampled_from(pool)))
    moved = dk.to_device(batch, META)
    originals = list(tensor_leaves(batch))
    copies = list(tensor_leaves(moved))
    for i, a in enumerate(originals):
        for j, b in enumerate(originals):
            assert (a is b) == (copies[i] is copies[j])


def test_ci_runs_each_property_on_at_least_200_examples() -> None:
    assert settings.get_profile("ci").max_examples >= 200
    if os.environ.get("CI") and not os.environ.get("HYPOTHESIS_PROFILE"):
        assert settings.default.max_examples >= 200


_ALIKE = tensors(dtypes=[torch.float32, torch.int64], shapes=st.sampled_from([(2, 3), (4,), ()]))


# Batches of every kind, and of many alike tensors, some of them twice, nested: batches
# that go packed.
_PACKED_OR_NOT = batches() | st.lists(_ALIKE, min_size=11, max_size=40).flatmap(
    lambda items: st.builds(
        lambda picks, split: {"a": items[:split] + picks, "b": tuple(items[split:])},
        st.lists(st.sampled_from(items), max_size=3),
        st.integers(0, len(items)),
    )
)


@given(_PACKED_OR_NOT)
def test_the_accelerator_path_keeps_structure_shapes_dtypes_and_aliases(batch: Any) -> None:
    # meta standing in for an accelerator: the batch is taken apart, its small tensors
    # packed where that pays, and rebuilt; compared with the reference move to meta,
    # which has shapes and no values (the next property has the values, on the stand-in).
    with as_accelerator("meta"):
        moved = dk.to_device(batch, META)
    assert_moved_like(moved, reference_move(batch, META))
    before, after = list(tensor_leaves(batch)), list(tensor_leaves(moved))
    assert len(before) == len(after)
    copies: dict[int, torch.Tensor] = {}
    for source, copy in zip(before, after, strict=True):
        assert copy.device == META
        assert (copy.shape, copy.dtype) == (source.shape, source.dtype)
        assert copies.setdefault(id(source), copy) is copy  # one copy per source tensor


@given(batch=_PACKED_OR_NOT)
def test_the_accelerator_path_gives_back_every_value(
    stand_in_device: torch.device, batch: Any
) -> None:
    # On the stand-in, with real values: packed or not, every tensor arrives whole, once.
    moved = dk.to_device(batch, stand_in_device)
    assert_batches_equal(dk.to_device(moved, "cpu"), batch)
    copies: dict[int, torch.Tensor] = {}
    for source, copy in zip(tensor_leaves(batch), tensor_leaves(moved), strict=True):
        assert copy.device == stand_in_device
        assert copies.setdefault(id(source), copy) is copy  # one copy per source tensor


@given(batches(), st.sampled_from(["meta", "accelerator"]))
def test_the_movers_list_form_moves_as_the_mover_does_leaf_by_leaf(
    stand_in_device: torch.device, batch: Any, how: str
) -> None:
    # move_all is move applied at every active leaf, with fewer calls: compare the two.
    from devicekit._core import _transfer, _tree  # noqa: PLC0415 - the two forms are private

    def both(device: torch.device) -> tuple[list[Any], list[Any]]:
        plan = _transfer._plan(device, _transfer._DEFAULTS)
        flat = _tree.flatten(batch)
        listed = plan.move_all(flat.leaves, flat.active, _transfer.Call(plan, []))
        call = _transfer.Call(plan, [])
        one_by_one = list(flat.leaves)
        for index in flat.active:
            one_by_one[index] = plan.move(flat.leaves[index], call)
        return listed, one_by_one

    listed, one_by_one = both(stand_in_device if how == "accelerator" else META)
    assert len(listed) == len(one_by_one)
    for mine, theirs in zip(listed, one_by_one, strict=True):
        assert type(mine) is type(theirs)
        if isinstance(theirs, torch.Tensor):
            assert (mine.device, mine.dtype, mine.shape) == (
                theirs.device,
                theirs.dtype,
                theirs.shape,
            )
            if not theirs.is_meta:
                assert torch.equal(mine, theirs)
        else:
            assert mine is theirs


@given(
    st.lists(tensors() | tensors().map(lambda t: t.to(META)), max_size=12).flatmap(
        lambda given: st.lists(st.sampled_from(given), max_size=12) if given else st.just([])
    ),
    st.sampled_from([META, CPU]),
    st.sampled_from(["auto", True, False]),
    st.sampled_from([list, tuple, dict]),
)
def test_a_flat_batch_moves_as_the_mover_moves_it_leaf_by_leaf(
    leaves: list[torch.Tensor], device: torch.device, non_blocking: Any, kind: type
) -> None:
    # move_each, the list form the host walk hands a flat batch to, is move at each leaf:
    # the same tensors back, or new ones alike, one per distinct tensor.
    from devicekit._core import _transfer  # noqa: PLC0415 - the two forms are private

    leaves = [leaf for leaf in leaves if not (leaf.is_meta and device == CPU)]
    plan = _transfer._plan(device, _transfer.Options(non_blocking=non_blocking))
    call = _transfer.Call(plan, [])
    one_by_one = [plan.move(leaf, call) for leaf in leaves]
    assert plan.kept is not None
    move_each = plan.kept[2]
    if move_each is not None:
        listed = move_each(leaves)
        if len({id(leaf) for leaf in leaves}) < len(leaves):
            assert listed is None  # walked, noting the repeat
        else:
            assert listed is not None
            for mine, theirs, leaf in zip(listed, one_by_one, leaves, strict=True):
                assert type(mine) is type(theirs)
                assert (mine.device, mine.dtype, mine.shape) == (
                    theirs.device,
                    theirs.dtype,
                    theirs.shape,
                )
                assert (mine is leaf) == (theirs is leaf)
    batch: Any = dict(enumerate(leaves)) if kind is dict else kind(leaves)
    moved = dk.to_device(batch, device, non_blocking=non_blocking)
    assert type(moved) is kind
    assert_moved_like(moved, reference_move(batch, device))
