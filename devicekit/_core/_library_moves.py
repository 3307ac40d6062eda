"""Moves for other libraries' objects that the table's generic rules do not cover.

A transformers cache (``past_key_values``) moves in place, each layer through its own
offloading API; a mapping that moves itself (a TensorDict) moves every value it holds,
so the values ``skip_keys`` names are put back after its ``.to()``. Each is reached
through the table like any other type: :class:`~devicekit._core._kinds.Leaf` ``CACHE`` for
the caches, ``TO_METHOD`` on a mapping for the other, never by a branch in the mover.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any, Final, Protocol

import torch

from devicekit._base import LeafError, TransferError
from devicekit._core import _tree
from devicekit._core._kinds import READ, Leaf, leaf_how
from devicekit._core._nodes import ATTRIBUTE, ITEM, SHOWN, Key, is_cache_layer, mapping_items

__all__ = ["CallView", "keep_skipped", "move_cache"]

_Tensor = torch.Tensor


class CallView(Protocol):
    """What a move needs of the to_device call it belongs to (a :class:`._call.Call`)."""

    plan: Any  # its device, options, and how copies are told (non_blocking)
    memo: dict[Any, Any]  # what each object became, by key: an object moves once a call
    skip: frozenset[Hashable] | None

    def tensor(self, tensor: torch.Tensor, device: torch.device, dtype: Any = ...) -> Any: ...

    def leaf(self, obj: Any) -> Any: ...

    def non_blocking(self, tensor: torch.Tensor, device: torch.device) -> bool: ...


def move_cache(cache: Any, call: CallView, detail: object) -> Any:
    """Move a transformers cache in place, layer by layer, leaving no tensor behind.

    A layer that knows its device is told the new one and moves there in its own
    ``prefetch()`` (its offloading API); what that leaves behind (a static layer's
    ``cumulative_length``, a sliding window's tensor, a hybrid layer's keys, quantized
    pairs, linear-attention states in dicts), whatever its name, is then moved where it
    is, attribute by attribute, as the checks see it. The layers of the caches it holds
    (an encoder-decoder's two) move too. Copies from an accelerator to the host under
    ``"auto"`` are waited for, as every other copy is.
    """
    options, device = call.plan.options, call.plan.device
    if options.copy or options.dtype is not None or options.memory_format is not None:
        asked = "copy=True" if options.copy else "dtype" if options.dtype else "memory_format"
        msg = (
            f"Cannot move {{path}} with {asked}: a transformers {type(cache).__name__} moves "
            "in place, each layer through its own prefetch(), which neither copies nor casts. "
            "Move it on its own, without the option (its tensors keep their dtype), or "
            "leave it out of the call with skip_keys."
        )
        raise LeafError(msg)
    for layer in _cache_layers(cache):
        state = getattr(layer, "__dict__", {})
        knows = [name for name, value in state.items() if isinstance(value, torch.device)]
        if knows:  # not initialised otherwise: it takes its device from its first keys
            for value in state.values():
                for leaf in _tree.flatten(value, view=READ).leaves:
                    if isinstance(leaf, _Tensor):
                        call.non_blocking(leaf, device)  # notes the wait prefetch's copies need
            for name in knows:
                setattr(layer, name, device)
            layer.prefetch()
        for name, value in list(state.items()):
            flat = _tree.flatten(value)
            leaves = flat.leaves.copy()
            for index in flat.active:
                leaves[index] = _in_layer(leaves[index], call)
            if any(new is not old for new, old in zip(leaves, flat.leaves, strict=True)):
                setattr(layer, name, _tree.unflatten(flat.spec, leaves))
                # The memo knows tensors by id: one it moved must outlive the call, or a
                # tensor made later (by the next layer's prefetch) could take its id.
                call.memo.setdefault(_OUTLIVING, []).append(value)
    return cache


_OUTLIVING: Final = object()
"""The memo's key for what a call replaced in place and keeps alive to its end."""


def _in_layer(leaf: Any, call: CallView) -> Any:
    """A leaf of a cache layer, moved as it moves elsewhere; settings and helpers kept.

    A layer's other leaves (its quantizer, a class to build layers with) are no data:
    neither moved nor refused with ``strict=True``.
    """
    how = leaf_how(type(leaf))[0]
    if how is Leaf.KEPT or how is Leaf.OTHER or how is Leaf.ARRAY:
        return leaf
    return call.leaf(leaf)


def _cache_layers(cache: Any) -> list[Any]:
    """The layers of a transformers cache, those of the caches it holds included."""

    def expand(value: Any) -> list[tuple[Key, Any]] | None:  # a cache's lists and caches
        if leaf_how(type(value))[0] is not Leaf.CACHE:
            return None
        found = []
        for name, held in vars(value).items():
            if isinstance(held, list):
                found += [(Key(SHOWN, f".{name}[{i}]"), x) for i, x in enumerate(held)]
            elif leaf_how(type(held))[0] is Leaf.CACHE:
                found.append((Key(ATTRIBUTE, name), held))
        return found

    return [
        value for _, value in _tree.walk(cache, expand=expand, seen={}) if is_cache_layer(value)
    ]


def keep_skipped(original: Mapping[Any, Any], moved: Any, skip: frozenset[Hashable]) -> None:
    """Put back what ``skip_keys`` names in a mapping that moved itself (a TensorDict).

    Its own ``.to()`` moved everything it holds: the values under skipped keys, at any
    depth, are set back as they were. A TensorDict with a device would move them again,
    so it gives up its device first (``clear_device_()``), as one holding several
    devices has none.
    """

    def expand(value: Any) -> Any:  # the mappings inside, but not those under skipped keys
        if not isinstance(value, Mapping):
            return None
        return [(Key(ITEM, k), v) for k, v in mapping_items(value) if not _skipped(k, skip)]

    theirs: dict[int, Any] = {}  # id(path) -> the moved mapping there
    kept: list[_tree.Path] = []  # where something was put back, parents before children
    try:
        for path, mine in _tree.walk(original, expand=expand, root=_HERE):
            if not isinstance(mine, Mapping):
                continue
            there = theirs[id(path)] = theirs[id(path[0])][path[1].name] if path else moved
            for key, value in mapping_items(mine):
                if _skipped(key, skip):
                    _put_back(there, key, value, path)
                    kept.append(path)
    except TransferError as err:  # too deep: a template, whose path the outer walk knows
        raise LeafError(_escaped(str(err)).replace(_HERE, "{path}")) from None
    cleared: set[int] = set()
    for path in reversed(kept):  # children before their parents
        link: _tree.Path = path
        while id(link) not in cleared:
            cleared.add(id(link))
            there = theirs[id(link)]
            if getattr(there, "device", None) is not None and callable(
                getattr(there, "clear_device_", None)
            ):
                there.clear_device_()  # it holds values on several devices now
            if not link:
                break
            link = link[0]


_HERE: Final = "\x00"  # the outer walk's path, in a message made inside a leaf


def _skipped(key: Any, skip: frozenset[Hashable]) -> bool:
    return isinstance(key, Hashable) and key in skip


def _put_back(moved: Any, key: Any, value: Any, path: _tree.Path) -> None:
    moved[key] = value
    if moved[key] is not value and callable(getattr(moved, "clear_device_", None)):
        moved.clear_device_()
        moved[key] = value
    if moved[key] is not value:
        where = _escaped(_tree.format_path("", [*_tree.keys_of(path), Key(ITEM, key)]))
        msg = (
            f"Cannot keep {{path}}{where} as it is: the "
            f"{type(moved).__name__} moves every value set in it to its device. Move it out "
            "of the batch before to_device instead of naming it in skip_keys."
        )
        raise LeafError(msg)


def _escaped(text: str) -> str:
    """Text as a message template holds it: braces doubled for format()."""
    return text.replace("{", "{{").replace("}", "}}")
