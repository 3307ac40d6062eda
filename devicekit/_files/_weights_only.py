"""The weights-only check: what a weights-only load would refuse, found before save writes.

A weights-only load (``torch.load``'s default, and :func:`~devicekit.load`'s) builds
tensors, containers and plain data, and refuses every other global a pickle names, since
building it could run code the file chooses. Its invariant: :func:`~devicekit.save`
writes nothing that the default load refuses, unless asked to (``weights_only=False``).
So both allow the same plain data of training scripts beyond PyTorch's list while they
run (:data:`allowing`), and torch.save is given a pickler (:func:`checked_pickle`) that
checks its pickle whole with PyTorch's own scan before a byte of it is written. A
refusal, at save (:func:`save_refusal`) or at load (:func:`load_refusal`), names every
global refused at once, and the ways out.
"""

from __future__ import annotations

import argparse
import functools
import io
import pathlib
import pickle
import sys
import threading
import types
import zipfile
from collections.abc import Callable, Mapping
from typing import IO, Any, Final, cast

import torch

from devicekit._base import (
    TransferError,
    listing,
    shown,
    weights_only_build_refusal,
    weights_only_refusal,
    weights_only_refused_globals,
    weights_only_said,
)
from devicekit._core import ATTRIBUTE, MOVE, Key, contents, keys_of, walk

__all__ = [
    "Unloadable",
    "allowing",
    "checked_pickle",
    "first_sentence",
    "load_refusal",
    "save_refusal",
]


@functools.cache
def _safe_types() -> tuple[Any, ...]:
    """Plain data of training scripts that build without running a checkpoint's code.

    numpy's scalars, arrays and dtypes under numpy 2's and numpy 1's module names
    (``np.float64(loss)``, ``np.random.get_state()``); ``args`` and its ``pathlib`` paths.
    """
    allowed: list[Any] = [
        argparse.Namespace,
        pathlib.PurePosixPath,
        pathlib.PureWindowsPath,
        type(pathlib.Path()),
    ]
    try:
        import numpy  # noqa: PLC0415 - optional; PyTorch imports it where installed
    except ImportError:
        return tuple(allowed)
    core = getattr(numpy, "_core", None) or numpy.core
    allowed += [
        (getattr(core.multiarray, name), f"{module}.{name}")
        for module in ("numpy._core.multiarray", "numpy.core.multiarray")
        for name in ("scalar", "_reconstruct")
    ]
    dtypes = getattr(numpy, "dtypes", None)
    allowed += [numpy.dtype, numpy.ndarray]
    allowed += [getattr(dtypes, name) for name in getattr(dtypes, "__all__", ())]
    return tuple(allowed)


class _Allowing:
    """The safe types added to PyTorch's weights-only allowlist while a save or load runs.

    PyTorch's list is the process's; a save or load in another thread shares the
    additions, and the last to finish takes away only what devicekit added.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._added: Any = None  # a torch.serialization.safe_globals, entered

    def __enter__(self) -> None:
        with self._lock:
            if self._users == 0:
                present = set(torch.serialization.get_safe_globals())
                missing = [each for each in _safe_types() if each not in present]
                self._added = torch.serialization.safe_globals(missing)
                self._added.__enter__()
            self._users += 1

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0 and self._added is not None:
                self._added.__exit__(None, None, None)
                self._added = None


allowing: Final = _Allowing()
"""Entered while a save or load runs: the safe types allowed for its length."""


class Unloadable(Exception):  # noqa: N818 - carries the refusal out of torch.save
    """What a weights-only load would refuse: ``args`` are its words and the pickle refused."""


def checked_pickle(*, checks: bool, passed: Callable[[], None]) -> Any:
    """What torch.save takes as ``pickle_module``: a pickler that checks before it writes.

    torch.save pickles the object whole into memory before it writes a record: checked
    then, :class:`Unloadable` raised where the load would refuse it; ``passed()`` called
    once it has passed (at once where ``checks`` is False).
    """

    class Pickler(pickle.Pickler):
        def __init__(self, file: io.BytesIO, protocol: int | None = None) -> None:
            super().__init__(file, protocol)
            self._written = file

        def dump(self, obj: Any) -> None:
            super().dump(obj)
            if checks:
                pickled = self._written.getvalue()
                refusal = weights_only_refusal(pickled)
                if refusal is not None:
                    raise Unloadable(refusal, pickled)
            passed()

    return types.SimpleNamespace(__name__="pickle", Pickler=Pickler)


def save_refusal(obj: Any, refusal: str, where: str, pickled: bytes | None = None) -> str:
    """Why save refuses ``obj``: what a weights-only load would not build, where, and the fixes.

    Every outermost value holding a refused global is named, so one change makes the
    save pass. Allowing the classes named (built-in ones included) is advised only where
    no module, optimizer or function is refused and a trial build of ``pickled`` with them
    allowed passes (no defaultdict holding items builds: an optimizer's stepped state).
    """
    names = _refused_names(refusal, pickled)
    try:
        found = _refused_in(obj, frozenset(names))
        lost = ""
    except TransferError as err:  # a cycle, or depth past MAX_DEPTH: said with its path
        found, lost = [], f" Where it is could not be found: {err}"
    whole = (
        f" Or, to save it whole, write dk.save({_name_for(obj)}, path, weights_only=False) "
        "and load it with dk.load(path, weights_only=False) where its classes can be "
        "imported; only load such a file if you trust it, since unpickling it can execute "
        "arbitrary code."
    )
    if not found:
        refused = (
            f"to build {', '.join(names)} (building {'them' if len(names) > 1 else 'it'} "
            "could run code the file names)"
            if names
            else f"it ({first_sentence(refusal)})"
        )
        return (
            f"Cannot save to {where}: a weights-only load, dk.load's default, would refuse "
            f"{refused}.{lost} Save tensors and plain data, or allow the classes where you "
            f"save and where you load with torch.serialization.add_safe_globals([...]).{whole}"
        )
    every = ""
    if len(names) > 1:
        every = f" The load refuses {'both' if len(names) == 2 else f'all {len(names)}'} of "
        every += f"these: {', '.join(names)}."
    held = [_qualified(value if _by_reference(value) else type(value)) or "?" for _, value in found]
    at = listing(
        [
            f"{path} is {name}" if path else f"the object at the top level is {name}"
            for (path, _), name in zip(found, held, strict=True)
        ]
    )
    them = "them" if len(found) > 1 else "it"
    by_kind: dict[str, list[str]] = {}  # how to save each as data: the paths it fits
    for path, value in found:
        by_kind.setdefault(_kind_of(value), []).append(path)
    fixes = " ".join(
        _fix(kind, paths, obj, alone=len(found) == 1) for kind, paths in by_kind.items()
    )
    alternative = ""
    allowed = [*dict.fromkeys(held), *(each for each in names if each not in held)]
    # Modules and optimizers: their state_dict, or whole. Functions: never tried, since
    # the trial build would call them.
    if "state_dict" not in by_kind and all(isinstance(_loaded(each), type) for each in allowed):
        stuck = None if pickled is None else _refused_even_if_allowed(pickled, allowed)
        if stuck is None:
            yours = (
                "the class is yours and safe to build, allow it"
                if len(allowed) == 1
                else "the classes are yours and safe to build, allow them"
            )
            alternative = (
                f" Or, where {yours} before saving and before loading: {_allow_call(allowed)}."
            )
        else:
            alternative = (
                " Allowing its classes would not do: a weights-only load refuses to build "
                f"{them} even then ({stuck})."
            )
    return (
        f"Cannot save to {where}: {at}, which a weights-only load, dk.load's default, refuses "
        f"to build (building {them} could run code the file names).{every} "
        f"{fixes}{alternative}{whole}"
    )


def _kind_of(value: object) -> str:
    """How to save ``value`` as data: by name, its state_dict, as a dict, or its fields."""
    if _by_reference(value):
        return "name"
    if callable(getattr(value, "state_dict", None)):  # modules, optimizers, schedulers
        return "state_dict"
    return "mapping" if isinstance(value, Mapping) else "fields"


_FIXES: Final = {  # (for one value, for several)
    "name": ("save its name as a str instead", "save their names as str instead"),
    "state_dict": ("save its state_dict() instead", "save their state_dict() instead"),
    "mapping": (
        "save it as a plain dict instead (dict(...))",
        "save them as plain dicts instead (dict(...))",
    ),
    "fields": (
        "save its fields as a dict instead (vars(...) or dataclasses.asdict(...))",
        "save their fields as dicts instead (vars(...) or dataclasses.asdict(...))",
    ),
}


def _fix(kind: str, paths: list[str], obj: Any, *, alone: bool) -> str:
    """The way out that keeps the checkpoint weights-only for ``paths`` (``alone``: all refused)."""
    one, several = _FIXES[kind]
    if not alone:
        return f"For {listing(paths)}, {several if len(paths) > 1 else one}."
    if kind == "state_dict" and not paths[0]:  # the object saved: the code to write
        name = _name_for(obj)
        return f"Save its state_dict() instead: dk.save({name}.state_dict(), path)."
    return f"{one[0].upper()}{one[1:]}."


def _name_for(obj: object) -> str:
    """What the fixes call the object saved, in the code they show."""
    if isinstance(obj, torch.nn.Module):
        return "model"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    return "checkpoint" if isinstance(obj, Mapping) else "obj"


def load_refusal(text: str, name: str, source: str | IO[bytes], start: int | None) -> str | None:
    """The words for a weights-only refusal: what the file holds, and the ways to load it.

    Every global refused is named from the pickle read from ``start`` (a stream's
    position before the load). Allowing them is advised only where each is
    :func:`_of_the_program`: a class of Python's or PyTorch's may not build even allowed.
    """
    said = weights_only_said(text)
    if said.blocked:
        return (
            f"Refusing to load {name}: it calls {said.blocked}, which runs commands on "
            "this machine. The file is unsafe: do not load it."
        )
    if not said.names:  # an operand no pickle of torch.save's has: damaged, as load says
        return None
    with allowing:
        names = _refused_names(text, _pickle_in(source, start))
    holds = ", ".join(names)
    whole = (
        f"Cannot load {name} as weights and plain data: it holds {holds}, which a "
        "weights-only load, dk.load's default, does not build or call, since that could run "
        "code the file chooses. If you trust the file, load it whole with "
        "dk.load(path, weights_only=False) where its classes can be imported; only load a "
        "file you trust, since unpickling it can execute arbitrary code."
    )
    if not all(_of_the_program(_loaded(each)) for each in names):
        return whole
    known = (
        "it is a class of yours that is safe to build, allow it"
        if len(names) == 1
        else "they are classes of yours that are safe to build, allow them"
    )
    return f"{whole} Or, if you know {known} first: {_allow_call(names)}."


def _of_the_program(value: object) -> bool:
    """Whether ``value`` is a class of the program's own that holds data, not a module's."""
    return (
        isinstance(value, type)
        and value.__module__.split(".")[0] not in {"builtins", "collections", "torch"}
        and not callable(getattr(value, "state_dict", None))
    )


def _pickle_in(source: str | IO[bytes], start: int | None) -> bytes | None:
    """The pickle of a checkpoint in torch.save's zip format; None for the legacy format."""
    try:
        if start is not None:
            cast("IO[bytes]", source).seek(start)
        with zipfile.ZipFile(source) as archive:
            record = next(each for each in archive.namelist() if each.endswith("/data.pkl"))
            return archive.read(record)
    except (zipfile.BadZipFile, StopIteration, OSError, ValueError):
        return None


def _refused_even_if_allowed(pickled: bytes, names: list[str]) -> str | None:
    """Why a weights-only load, the globals ``names`` allowed, still refuses ``pickled``.

    None where it would, or that cannot be told (a name no loaded module holds, a class's
    own error).
    """
    found = [_loaded(name) for name in names]
    if any(each is None for each in found):
        return None
    try:
        with allowing:
            refused = weights_only_build_refusal(pickled, zip(found, names, strict=True))
    except Exception:  # a class's own code, run on meta tensors: nothing to tell
        return None
    return None if refused is None else f"PyTorch: {first_sentence(refused)}"


def _refused_names(said: str, pickled: bytes | None) -> list[str]:
    """The globals refused: from ``pickled`` in order, else as the refusal ``said`` names them."""
    found = weights_only_refused_globals(pickled) if pickled else []
    return found or weights_only_said(said).names


def _allow_call(names: list[str]) -> str:
    """The call that allows the classes ``names`` (``module.Name``), as the user would write it."""
    shorts = ", ".join(name.rsplit(".", 1)[-1] for name in names)
    return f"torch.serialization.add_safe_globals([{shorts}])"


def _loaded(qualified: str) -> Any:
    """The global pickle wrote as ``qualified`` (``module.Name``), from a loaded module."""
    parts = qualified.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:cut]))
        if module is not None:
            found: Any = module
            for part in parts[cut:]:
                found = getattr(found, part, None)
            return found
    return None


def first_sentence(refusal: str) -> str:
    """The first sentence of a weights-only refusal's own words, shown (quoted, cut short)."""
    return shown(weights_only_said(refusal).reason.split(". ")[0].strip(" ."), limit=160)


def _qualified(value: object) -> str | None:
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else None


# What pickle writes as it is, with no global to name: a value of these types is never
# the refused one (a defaultdict's list values are not its factory, builtins.list).
_WRITTEN_AS_IS: Final = frozenset({type(None), bool, int, float, str, dict, list, tuple})


def _by_reference(value: object) -> bool:
    """Whether pickle writes ``value`` as a global of its own: a class or a function."""
    return isinstance(value, type | types.FunctionType | types.BuiltinFunctionType)


def _is_refused(value: object, names: frozenset[str]) -> bool:
    if _by_reference(value) and _qualified(value) in names:
        return True
    kind = type(value)
    return kind not in _WRITTEN_AS_IS and _qualified(kind) in names


def _refused_in(root: Any, names: frozenset[str]) -> list[tuple[str, Any]]:
    """Where in ``root`` the values pickled as one of the global ``names`` are, outermost only.

    Each once (the first path to it), none inside another. Walked by
    :func:`devicekit._core._tree.walk`, containers as to_device takes them apart, then the
    ``__dict__`` pickle saves of the leaves (``argparse.Namespace``), each object once.

    Raises:
        TransferError: The data nests deeper than MAX_DEPTH, or a container holds itself.
    """
    entered: set[int] = set()  # objects whose attributes were walked: each once

    def expand(value: Any) -> Any:
        if _is_refused(value, names):
            return None  # found: what it holds goes with it
        held = contents(value, MOVE)
        if held is not None:
            return held
        state = getattr(value, "__dict__", None)
        if type(state) is not dict or id(value) in entered or _by_reference(value):
            return None
        entered.add(id(value))
        return [(Key(ATTRIBUTE, name), each) for name, each in state.items()]

    found: dict[int, tuple[str, Any]] = {}  # by id: an object saved twice is named once
    for path, value in walk(root, expand=expand):
        if _is_refused(value, names):
            found.setdefault(id(value), ("".join(map(str, keys_of(path))), value))
    return list(found.values())
