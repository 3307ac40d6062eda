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
submodules, which ``Module.to()`` moves. Each tensor found comes with the steps that
reach it from its module, so :func:`devicekit.guard` reads it again on every call
without walking again.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final, NamedTuple

import torch

from devicekit._kinds import Node, decide, mapping_items

__all__ = ["Stray", "strays"]

# The tables and hooks every module has: nothing of the user's in them.
_MODULE_OWN: Final = frozenset(vars(torch.nn.Module()))
_DISTRIBUTIONS: Final = (torch.distributions.Distribution, torch.distributions.Transform)


class Stray(NamedTuple):
    """A tensor Module.to() does not move, where it is, and how to read it again."""

    path: str
    """As a user writes it, from the module walked: ``prior.loc``, ``blocks.1.table[0]``."""
    tensor: torch.Tensor
    owner: torch.nn.Module
    """The module whose attribute leads to it."""
    steps: tuple[tuple[bool, Any], ...] | None
    """(is an attribute, name or key) from ``owner`` to the tensor; None where a set holds it."""
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

    def read(self) -> Any:
        """The value at the stray's place now (it may have been moved since, or replaced)."""
        if self.steps is None:
            return self.tensor
        value: Any = self.owner
        for attribute, key in self.steps:
            value = getattr(value, key) if attribute else value[key]
        return value


def strays(module: torch.nn.Module, *, own: bool = False) -> list[Stray]:
    """The tensors ``module`` (and, unless ``own``, its submodules) holds that Module.to() leaves.

    A cycle is walked once; a tensor reached twice is found at its first path.
    """
    registered = {id(sub) for sub in module.modules()}
    moved_in_place = {id(param) for param in module.parameters()}
    seen: set[int] = set()
    found: list[Stray] = []
    subs = [("", module)] if own else module.named_modules()
    for prefix, sub in subs:
        # A hook that computes an attribute before each forward from parameters
        # (torch.nn.utils.spectral_norm's and weight_norm's ``weight``) moves with them.
        recomputed = {getattr(hook, "name", None) for hook in sub._forward_pre_hooks.values()}
        for name, value in vars(sub).items():
            if name in _MODULE_OWN or name in recomputed:
                continue
            path = f"{prefix}.{name}" if prefix else name
            walk = _Walk(sub, registered, moved_in_place, seen, found)
            walk.visit(value, path, ((True, name),), kind="attribute")
    return found


class _Walk:
    """One attribute's walk: what it reaches, never twice, until a tensor or a leaf."""

    def __init__(
        self,
        owner: torch.nn.Module,
        registered: set[int],
        moved_in_place: set[int],
        seen: set[int],
        found: list[Stray],
    ) -> None:
        self.owner, self.registered, self.moved_in_place = owner, registered, moved_in_place
        self.seen, self.found = seen, found

    def visit(
        self,
        value: Any,
        path: str,
        steps: tuple[tuple[bool, Any], ...] | None,
        *,
        kind: str,
    ) -> None:
        if id(value) in self.seen:
            return
        if isinstance(value, torch.Tensor):
            self.seen.add(id(value))
            if id(value) not in self.moved_in_place:  # a registered parameter moves in place
                self.found.append(Stray(path, value, self.owner, steps, kind))
            return
        decision = decide(type(value))
        node = decision.read
        if not isinstance(node, Node) and not isinstance(value, _DISTRIBUTIONS):
            return  # a scalar, a string, an object the table sees no tensor in
        self.seen.add(id(value))
        if isinstance(value, torch.nn.Module):
            if id(value) not in self.registered:  # kept in a plain list: not moved
                for name, tensor in (*value.named_parameters(), *value.named_buffers()):
                    self.visit(tensor, f"{path}.{name}", None, kind="module")
            return
        if isinstance(value, _DISTRIBUTIONS):
            for name, child in vars(value).items():
                child_steps = None if steps is None else (*steps, (True, name))
                self.visit(child, f"{path}.{name}", child_steps, kind="distribution")
            return
        for fragment, child, step in _children(node, value):
            child_steps = None if steps is None or step is None else (*steps, step)
            self.visit(child, path + fragment, child_steps, kind=kind)


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
