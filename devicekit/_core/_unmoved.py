"""What ``Module.to()`` leaves behind: a module tree's tensors outside parameters and buffers.

``Module.to()`` moves parameters, buffers and submodules. A tensor kept anywhere else
stays where it was: a plain attribute (``self.scale = torch.ones(3)``), a
``torch.distributions`` object built in ``__init__`` (``Normal(loc, scale)``), a list
or dict of tensors, a module kept in a plain list (not a ``ModuleList``), and an alias
of a buffer (``Module.to`` puts a new tensor in the buffer's place; the alias keeps the
old one). The walk here finds them, by the path a user writes (``prior.loc``,
``table[0]``, ``blocks.1.scale``): through each module's own attributes, the containers
the type table knows (its READ view), dataclasses, and distributions with their base
distributions and transforms; never into registered parameters, buffers or
submodules, which ``Module.to()`` moves, nor into what PyTorch's reparametrisations
(pruning, weight_norm, spectral_norm) recompute from them before each forward. Each
tensor found comes with its route from its module, so :func:`devicekit.guard` reads it
again on every call (:func:`read_again`) without walking again. The walk keeps its own
stack, and refuses nesting deeper than to_device takes, as to_device does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Final, NamedTuple

import torch

from devicekit._base import recomputed_attributes
from devicekit._core._kinds import READ, decide
from devicekit._core._nodes import ATTRIBUTE, SHOWN, Key, Node
from devicekit._core._tree import Path, contents, flatten, keys_of, paths, walk

__all__ = ["Stray", "read_again", "strays", "tensor_paths"]

# The tables and hooks every module has: nothing of the user's in them.
_MODULE_OWN: Final = frozenset(vars(torch.nn.Module()))
_DISTRIBUTIONS: Final = (torch.distributions.Distribution, torch.distributions.Transform)
_TENSOR_HOLDERS: Final = (torch.Tensor, *_DISTRIBUTIONS)  # what the table's READ view misses


class Stray(NamedTuple):
    """A tensor Module.to() does not move, where it is, and how to read it again."""

    path: str
    """As a user writes it, from the module walked: ``prior.loc``, ``blocks.1.table[0]``."""
    tensor: torch.Tensor
    owner: torch.nn.Module
    """The module whose attribute leads to it."""
    route: Path
    """Its keys from ``owner``, linked (:func:`read_again` reads it there again)."""
    kind: str
    """What holds it: an "attribute" (or a container in one), a "distribution", a "module"
    kept in a plain container; each has its own fix (:meth:`fix`)."""

    def fix(self) -> str:
        """Why Module.to() leaves it, and what to do instead, in a sentence."""
        if self.kind == "distribution":
            return (
                "Module.to() does not move a torch.distributions object: keep its tensors "
                "as buffers (register_buffer) and build the distribution in forward()"
            )
        if self.kind == "module":
            return (
                "Module.to() does not move a module kept in a plain list or dict: use "
                "torch.nn.ModuleList or torch.nn.ModuleDict"
            )
        return (
            "Module.to() does not move a plain attribute: make it a buffer with "
            "register_buffer(name, tensor, persistent=False)"
        )


def read_again(found: Sequence[Stray]) -> list[Any]:
    """The values at the strays' places now (moved since, or replaced), in their order.

    Each container on the way is read once for all the strays below it, so strays
    nested thousands deep cost a reading a level, not a level per stray. A stray no key
    reads again (a set's member, a module's tensor kept in a plain list) is itself.

    >>> layer = torch.nn.Linear(2, 2)
    >>> layer.table = {"scale": [torch.ones(1), torch.ones(2)]}
    >>> found = strays(layer)
    >>> layer.table["scale"][1] = torch.zeros(3)
    >>> [value.shape for value in read_again(found)]
    [torch.Size([1]), torch.Size([3])]

    Raises:
        AttributeError, LookupError, TypeError: A place that is gone: an attribute
            deleted, a key removed, a container replaced by another kind.
    """
    read: dict[int, Any] = {}  # id(path) -> its value: paths live as long as the strays
    values = []
    for stray in found:
        unread: list[tuple[Path, Key]] = []
        path = stray.route
        while path and id(path) not in read:  # the owner's own path, (), ends it
            unread.append(path)
            path = path[0]
        if not all(link[1].readable for link in unread):
            values.append(stray.tensor)
            continue
        value: Any = read[id(path)] if path else stray.owner
        for link in reversed(unread):
            value = link[1].get(value)
            read[id(link)] = value
        values.append(value)
    return values


def strays(module: torch.nn.Module, *, own: bool = False, root: str = "") -> list[Stray]:
    """The tensors ``module`` (and, unless ``own``, its submodules) holds that Module.to() leaves.

    A cycle is walked once; a tensor reached twice is found at its first path. An
    attribute PyTorch's own reparametrisations recompute before each forward from
    parameters and buffers (pruning, weight_norm, spectral_norm) is no stray. The walk
    keeps its own stack: nesting depth costs no Python frames.

    >>> layer = torch.nn.Linear(2, 2)
    >>> layer.table = {"scale": [torch.ones(1)]}
    >>> [(stray.path, stray.kind) for stray in strays(layer)]
    [("table['scale'][0]", 'attribute')]

    Raises:
        TransferError: An attribute nests containers deeper than to_device takes
            (:data:`devicekit._core._tree.MAX_DEPTH`); the message names the path from ``root``.
    """
    registered = {id(sub) for sub in module.modules()}
    moved_in_place = {id(param) for param in module.parameters()}
    seen: dict[int, Any] = {}  # what was walked, for every attribute: each value once
    found: list[Stray] = []
    for prefix, sub in [("", module)] if own else module.named_modules():
        recomputed = recomputed_attributes(sub)
        for name, value in vars(sub).items():
            if name in _MODULE_OWN or name in recomputed or not _may_hold_tensors(value):
                continue  # the usual attribute: a number, a string, a setting
            # What holds a value: the nearest distribution or plain-listed module above it.
            holders: dict[int, str] = {}

            def expand(value: Any, holders: dict[int, str] = holders) -> Any:
                if isinstance(value, torch.Tensor):
                    return None
                kind = holders.get(id(value), "attribute")
                children = _inside(value, registered)
                if isinstance(value, torch.nn.Module):
                    kind = "module"
                elif isinstance(value, _DISTRIBUTIONS):
                    kind = "distribution"
                if children is not None:
                    children = list(children)
                    holders.update((id(child), kind) for _, child in children)
                return children

            at = ((), Key(ATTRIBUTE, name))
            attribute = f"{prefix}.{name}" if prefix else name
            where = f"{root}.{attribute}" if root else attribute
            for path, tensor in walk(value, expand=expand, seen=seen, root=where, at=at):
                if not isinstance(tensor, torch.Tensor) or id(tensor) in seen:
                    continue
                seen[id(tensor)] = tensor
                if id(tensor) not in moved_in_place:  # a registered parameter moves in place
                    shown = attribute + "".join(map(str, keys_of(path)[1:]))
                    kind = holders.get(id(tensor), "attribute")
                    found.append(Stray(shown, tensor, sub, path, kind))
    return found


def _may_hold_tensors(value: Any) -> bool:
    return isinstance(value, _TENSOR_HOLDERS) or isinstance(decide(type(value)).read, Node)


def _inside(value: Any, registered: set[int]) -> Iterable[tuple[Key, Any]] | None:
    """What the walk looks into: containers, distributions, modules Module.to() misses."""
    if isinstance(value, torch.nn.Module):
        if id(value) in registered:
            return None  # Module.to() moves it
        # Kept in a plain list, so not moved; its tensors are read where they are found.
        named = (*value.named_parameters(), *value.named_buffers())
        return [(Key(SHOWN, f".{key}"), tensor) for key, tensor in named]
    if isinstance(value, _DISTRIBUTIONS):
        return [(Key(ATTRIBUTE, key), child) for key, child in vars(value).items()]
    return contents(value)


def tensor_paths(data: Any, root: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in ``data`` with its path, as the READ view of the table sees them.

    That is every tensor to_device would move, inside modules, optimizers and objects
    that move themselves too (a PackedSequence's ``.data``, a graph's ``.x``), and the
    tensors a module holds that Module.to() leaves behind (:func:`strays`).
    """
    flat = flatten(data, view=READ)
    tensors = [index for index in flat.active if isinstance(flat.leaves[index], torch.Tensor)]
    modules = [
        (number, container)
        for number, (_, _, container, _) in enumerate(flat.spec)
        if isinstance(container, torch.nn.Module)
    ]
    if not tensors and not modules:  # a million ints, a config: no path is made
        return
    leaf_paths, container_paths = paths(flat)
    for index in tensors:
        yield _rooted(root, leaf_paths[index]), flat.leaves[index]
    for number, module in modules:
        # A refusal names the data as to_device's does where it has no name of its own.
        for stray in strays(module, root=(root or "data") + container_paths[number]):
            yield _rooted(root, f"{container_paths[number]}.{stray.path}"), stray.tensor


def _rooted(root: str, path: str) -> str:
    return root + path if root or not path.startswith(".") else path[1:]
