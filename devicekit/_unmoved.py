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

from collections.abc import Iterator, Sequence
from typing import Any, Final, NamedTuple, TypeAlias

import torch

from devicekit._compat import recomputed_attributes
from devicekit._errors import TransferError
from devicekit._kinds import Node, decide, mapping_items
from devicekit._tree import MAX_DEPTH, too_deep_at

__all__ = ["Stray", "read_again", "strays"]

# The tables and hooks every module has: nothing of the user's in them.
_MODULE_OWN: Final = frozenset(vars(torch.nn.Module()))
_DISTRIBUTIONS: Final = (torch.distributions.Distribution, torch.distributions.Transform)
_TENSOR_HOLDERS: Final = (torch.Tensor, *_DISTRIBUTIONS)  # what the table's READ view misses

# How to read a value again from its owner: (the route to its container, (is an
# attribute, name or key)), linked from _AT_OWNER, so that a level costs one tuple
# however deep it is, and values met in one reading are shared by the strays below them.
_Route: TypeAlias = "tuple[_Route, tuple[bool, Any]] | tuple[()]"
_AT_OWNER: Final[tuple[()]] = ()


class Stray(NamedTuple):
    """A tensor Module.to() does not move, where it is, and how to read it again."""

    path: str
    """As a user writes it, from the module walked: ``prior.loc``, ``blocks.1.table[0]``."""
    tensor: torch.Tensor
    owner: torch.nn.Module
    """The module whose attribute leads to it."""
    route: _Route | None
    """How to read it from ``owner`` (:func:`read_again`); None where a set holds it."""
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
    nested thousands deep cost a reading a level, not a level per stray.

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
    read: dict[int, Any] = {}  # id(route) -> its value: routes live as long as the strays
    values = []
    for stray in found:
        if stray.route is None:
            values.append(stray.tensor)
            continue
        unread: list[tuple[_Route, tuple[bool, Any]]] = []
        route: _Route = stray.route
        while route and id(route) not in read:  # _AT_OWNER, empty, ends it
            unread.append(route)
            route = route[0]
        value: Any = read[id(route)] if route else stray.owner
        for link in reversed(unread):
            attribute, key = link[1]
            value = getattr(value, key) if attribute else value[key]
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
            (:data:`devicekit._tree.MAX_DEPTH`); the message names the path from ``root``.
    """
    walk = _Walk(module, root)
    subs = [("", module)] if own else module.named_modules()
    for prefix, sub in subs:
        recomputed = recomputed_attributes(sub)
        for name, value in vars(sub).items():
            if name in _MODULE_OWN or name in recomputed:
                continue
            walk.attribute(sub, f"{prefix}.{name}" if prefix else name, name, value)
    return walk.found


class _Place(NamedTuple):
    """A container the walk entered: where it is, and how many contain it."""

    path: str
    route: _Route | None
    trail: _Trail | None
    """Its path fragments, linked: the refusal of too deep a container shows them."""
    depth: int
    """Containers above it within the attribute (-1: the module, above the attribute)."""


_Trail: TypeAlias = "tuple[_Trail | None, str]"  # (the container's trail, a fragment)
# A value to look at: (it, the place of its container, its fragment there, the step that
# reads it there or None, what holds it). Its own path is joined only where it is a
# tensor found or a container entered: scalars cost no string.
_Pending: TypeAlias = tuple[Any, _Place, str, "tuple[bool, Any] | None", str]
_OWNER: Final = _Place("", _AT_OWNER, None, -1)


class _Walk:
    """One module tree's walk: what its attributes reach, never twice, until a tensor or a leaf."""

    def __init__(self, module: torch.nn.Module, root: str) -> None:
        self.root = root
        self.registered = {id(sub) for sub in module.modules()}
        self.moved_in_place = {id(param) for param in module.parameters()}
        # What was seen, kept alive: an id is never reused by a temporary within the walk.
        self.seen: dict[int, Any] = {}
        self.found: list[Stray] = []

    def attribute(self, owner: torch.nn.Module, path: str, name: str, value: Any) -> None:
        """Walk one attribute's value, depth first, in the order its containers list it."""
        if not isinstance(value, _TENSOR_HOLDERS) and not isinstance(
            decide(type(value)).read, Node
        ):
            return  # the usual attribute: a number, a string, a setting
        seen = self.seen
        stack: list[_Pending] = [(value, _OWNER, path, (True, name), "attribute")]
        while stack:
            value, place, fragment, step, kind = stack.pop()
            if id(value) in seen:
                continue
            route = None if place.route is None or step is None else (place.route, step)
            if isinstance(value, torch.Tensor):
                seen[id(value)] = value
                if id(value) not in self.moved_in_place:  # a registered parameter moves in place
                    self.found.append(Stray(place.path + fragment, value, owner, route, kind))
                continue
            node = decide(type(value)).read
            distribution = isinstance(value, _DISTRIBUTIONS)
            if not isinstance(node, Node) and not distribution:
                continue  # a scalar, a string, an object the table sees no tensor in
            trail = (place.trail, fragment)
            if place.depth + 1 >= MAX_DEPTH:  # to_device's rule, at the same level
                raise self._too_deep(trail)
            seen[id(value)] = value
            here = _Place(place.path + fragment, route, trail, place.depth + 1)
            children: list[_Pending]
            if isinstance(value, torch.nn.Module):
                if id(value) in self.registered:
                    continue  # Module.to() moves it
                # Kept in a plain list, so not moved; read where it is found (no step).
                children = [
                    (tensor, here, f".{key}", None, "module")
                    for key, tensor in (*value.named_parameters(), *value.named_buffers())
                ]
            elif distribution:
                children = [
                    (child, here, f".{key}", (True, key), "distribution")
                    for key, child in vars(value).items()
                ]
            else:
                children = [
                    (child, here, key, read, kind) for key, child, read in _children(node, value)
                ]
            stack += reversed(children)  # popped in the order the container lists them

    def _too_deep(self, trail: _Trail) -> TransferError:
        fragments: list[str] = []
        link: _Trail | None = trail
        while link is not None:
            link, fragment = link
            fragments.append(fragment)
        attribute, *below = reversed(fragments)
        return too_deep_at(f"{self.root}.{attribute}" if self.root else attribute, below)


def _children(node: Node, value: Any) -> Iterator[tuple[str, Any, tuple[bool, Any] | None]]:
    """A container's children as the table names them, with the step that reads each."""
    fragments = list(node.keys(value))
    children = list(node.children(value))
    if node.mapping:
        steps: list[tuple[bool, Any] | None] = [(False, key) for key, _ in mapping_items(value)]
    elif node.names is not None:
        steps = [(True, name) for name in node.names(value)]
    elif isinstance(value, list | tuple):
        steps = [(False, index) for index in range(len(children))]
    else:  # a set, or contents read another way: no step reads them again
        steps = [None] * len(children)
    yield from zip(fragments, children, steps, strict=True)
