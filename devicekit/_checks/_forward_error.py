"""What a guarded forward made on another device, read from PyTorch's error about it.

PyTorch refuses to mix devices inside a forward in its own words (an aten argument,
two devices); the tensor at fault is often one the forward made itself
(``torch.zeros(n, 51)`` without ``device=``). When a ``with guard(module):`` block ends
on that error, :func:`made_inside` reads the traceback's frames of the user's code
inside the module's call, finds the failing call's source and the tensors it used off
the module's device (the cells of a closure it calls too), names each as the outermost
frame calls it, and says how to make it on the right device. A factory that made one
without ``device=`` is named in that call, or in the body of a closure, a lambda or a
helper of the user's that the call runs, whose frame is gone. It runs only then, on an
error: a forward that succeeds pays nothing. A room of its own because it reads frames
and source text, which nothing else in the checks does; :mod:`devicekit._checks._guard` asks it.
"""

from __future__ import annotations

import itertools
import linecache
import os
import re
from collections.abc import Iterator
from types import CodeType, FrameType, FunctionType
from typing import Any, NamedTuple

import torch

from devicekit._base import (
    DeviceKitError,
    DeviceMismatchError,
    is_device_mismatch,
    is_library,
    listing,
)
from devicekit._checks._checks import input_names, split_model, tensors_of
from devicekit._core import tensor_paths

__all__ = ["made_inside"]

_NAME = re.compile(r"(?<![\w.])[^\W\d]\w*")
"""A name in source text, not an attribute's (``self.h`` gives ``self``)."""
_FACTORY = re.compile(
    r"\btorch\.(?:zeros|ones|empty|full|rand|randn|randint|randperm|arange|linspace|eye|tensor)\("
)
"""A call of a tensor factory, which puts its tensor on the default device unless told."""
_COMMENT = re.compile(r"#[^\n]*")
"""A comment, to the end of its line (a factory's arguments hold no ``#`` of their own)."""
_INSIDE_PARENTHESES = re.compile(r"(?<=\()\s+|\s+(?=\))")
"""Spaces just inside parentheses, left by joining a call written over several lines."""
_SOURCE_LINES = 20
"""The most lines of a failing call read: a longer span is not one call worth showing."""
_SOURCE_SHOWN = 120
"""The most characters of a failing call a message shows."""


class _Call(NamedTuple):
    """A frame of the user's code inside the guarded forward, and the line it was at."""

    frame: FrameType
    lineno: int
    lasti: int

    @property
    def where(self) -> str:
        """``Sequence.forward (model.py:42)``."""
        code = self.frame.f_code
        qualname = getattr(code, "co_qualname", None)  # Python 3.11 and later
        if qualname is None:
            owner = self.frame.f_locals.get("self")
            qualname = code.co_name if owner is None else f"{type(owner).__name__}.{code.co_name}"
        qualname = qualname.rpartition(".<locals>.")[2]
        return f"{qualname} ({os.path.basename(code.co_filename)}:{self.lineno})"


class _Made(NamedTuple):
    """A tensor the forward used on another device than its module's."""

    name: str
    call: _Call
    device: torch.device


def _inside_calls(module: torch.nn.Module, error: BaseException) -> list[_Call]:
    """The frames of the user's code inside ``module``'s call, outermost first.

    The call begins at the first frame of the module's forward, or of PyTorch's code
    calling it (``module(x)``); a user's method of the module that called it (a
    ``fit()``) is not inside.
    """
    forward = getattr(type(module).forward, "__code__", None)
    calls: list[_Call] = []
    inside = False
    each = error.__traceback__
    while each is not None:
        frame = each.tb_frame
        library = is_library(frame.f_code.co_filename)
        if not inside and frame.f_locals.get("self") is module:
            inside = library or frame.f_code is forward
        if inside and not library:
            calls.append(_Call(frame, each.tb_lineno, each.tb_lasti))
        each = each.tb_next
    return calls


def _failing_source(call: _Call) -> str | None:
    """The source of the call that failed in ``call``'s frame, as one line; None if unknown.

    Python 3.11 and later say where the call is in its line (``co_positions``), so
    ``h = self.cell(x, (h, c))`` gives ``self.cell(x, (h, c))``; older Pythons give the line.
    """
    code = call.frame.f_code
    first, last, start, end = call.lineno, call.lineno, None, None
    positions = getattr(code, "co_positions", None)
    if positions is not None and call.lasti >= 0:
        found = next(itertools.islice(positions(), call.lasti // 2, None), None)
        if found is not None and found[0] is not None and found[1] is not None:
            first, last, start, end = found
    lines = _source_lines(code, call.frame.f_globals, (first, last, start, end))
    return None if lines is None else " ".join(line.strip() for line in lines)


def _source_lines(
    code: CodeType, globals_: dict[str, Any], span: tuple[int, int, int | None, int | None]
) -> list[str] | None:
    """The lines of ``code``'s file from ``span``'s first to its last, cut at its columns.

    None where they cannot be read, or span :data:`_SOURCE_LINES` or more.
    """
    first, last, start, end = span
    if last - first >= _SOURCE_LINES:
        return None
    lines = [
        linecache.getline(code.co_filename, number, globals_) for number in range(first, last + 1)
    ]
    if not all(lines):
        return None
    # Columns count bytes of UTF-8; the end first, as the start may be on the same line.
    if end is not None:
        lines[-1] = lines[-1].encode()[:end].decode(errors="ignore")
    if start is not None:
        lines[0] = lines[0].encode()[start:].decode(errors="ignore")
    return lines


def _functions_named(call: _Call, source: str) -> Iterator[tuple[str, FunctionType]]:
    """The user's functions the failing call names: closures, lambdas, helpers of the user's.

    Their frames are gone where the failing call used what they returned
    (``self.fc(x) + bias()``): only their code is left to read.
    """
    frame = call.frame
    for name in dict.fromkeys(_NAME.findall(source)):
        function = frame.f_locals.get(name, frame.f_globals.get(name))
        if isinstance(function, FunctionType) and not is_library(function.__code__.co_filename):
            yield name, function


def _body_span(code: CodeType) -> tuple[int, int, int | None, int | None] | None:
    """Where ``code``'s instructions are: first and last lines, columns where known."""
    positions = getattr(code, "co_positions", None)  # Python 3.11 and later
    if positions is None:
        numbers = [number for _, _, number in code.co_lines() if number is not None]
        return (min(numbers), max(numbers), None, None) if numbers else None
    # The first instruction (RESUME, at the def's line) has no columns.
    spans = [p for p in positions() if None not in p and p[2:] != (0, 0)]
    if not spans:
        return None
    first, start = min((p[0], p[2]) for p in spans)
    last, end = max((p[1], p[3]) for p in spans)
    return first, last, start, end


def _factory_in(function: FunctionType) -> tuple[str, int] | None:
    """The first tensor factory ``function``'s body calls without ``device=``, and its line."""
    code = function.__code__
    span = _body_span(code)
    lines = None if span is None else _source_lines(code, function.__globals__, span)
    if span is None or lines is None:
        return None
    first = span[0]
    body = _COMMENT.sub("", "\n".join(lines))  # a comment inside a call is not the call
    for match in _FACTORY.finditer(body):
        depth, close = 1, match.end()
        while close < len(body) and depth:  # to the parenthesis that closes the call
            depth += {"(": 1, ")": -1}.get(body[close], 0)
            close += 1
        text = _INSIDE_PARENTHESES.sub("", " ".join(body[match.start() : close].split()))
        if "device" not in text:
            return text, first + body.count("\n", 0, match.start())
    return None


def _factory_run(call: _Call, source: str) -> tuple[str, str, str] | None:
    """A function the failing call runs, whose factory call lacks ``device=``.

    Its name, that call, and where it is (``model.py:12``); None if the call runs none.
    """
    for name, function in _functions_named(call, source):
        found = _factory_in(function)
        if found is not None:
            factory, line = found
            return name, factory, f"{os.path.basename(function.__code__.co_filename)}:{line}"
    return None


def _tensors_named(name: str, value: Any) -> list[tuple[str, torch.Tensor]]:
    """The tensors in a local variable, with their paths; none in a module or optimizer."""
    if isinstance(value, torch.nn.Module | torch.optim.Optimizer):
        return []  # its parameters are the module's, checked before the forward
    if isinstance(value, torch.Tensor):
        return [(name, value)]
    try:
        return list(tensor_paths(value, name))
    except Exception:  # a local that cannot be walked names nothing: the user's error goes on
        return []


def _inputs_in(module: torch.nn.Module, calls: list[_Call]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors among the forward's positional inputs, as its own frame holds them."""
    own = next((call for call in calls if call.frame.f_locals.get("self") is module), None)
    if own is None:
        return
    for name in input_names(type(module).forward)[0]:
        yield from _tensors_named(name, own.frame.f_locals.get(name))


def _made_elsewhere(calls: list[_Call], source: str | None, home: torch.device) -> list[_Made]:
    """The tensors the failing call used that are not on ``home``, named where first seen.

    The failing call is the innermost frame's; its tensors are the locals its source
    names (all its locals where the source cannot be read). Each is named as the
    outermost frame inside the forward calls it: ``h0`` made in ``Model.forward`` and
    passed to a block whose forward calls it ``h``. A host scalar tensor, which PyTorch
    takes next to any device, is left out.
    """
    innermost = calls[-1]
    local = innermost.frame.f_locals
    used = dict.fromkeys(_NAME.findall(source)) if source is not None else dict.fromkeys(local)
    for name in list(used):  # what a closure called there holds of the frame's (its cells)
        if isinstance(function := local.get(name), FunctionType):
            used.update(dict.fromkeys(function.__code__.co_freevars))
    found: dict[int, _Made] = {}
    for name in used:
        if name == "self" or name not in local:
            continue
        for path, tensor in _tensors_named(name, local[name]):
            scalar = tensor.dim() == 0 and tensor.device.type == "cpu"
            if tensor.device != home and not scalar and id(tensor) not in found:
                found[id(tensor)] = _Made(path, innermost, tensor.device)
    if not found:
        return []
    renamed: dict[int, _Made] = {}
    for call in calls[:-1]:
        for name, value in call.frame.f_locals.items():
            if isinstance(value, torch.Tensor) and id(value) in found and id(value) not in renamed:
                renamed[id(value)] = _Made(name, call, value.device)
    return [renamed.get(key, made) for key, made in found.items()]


def made_inside(module: torch.nn.Module, error: BaseException) -> DeviceMismatchError | None:
    """The error naming what the guarded forward made on another device; None if unknown.

    Read from PyTorch's own error for mixed devices raised inside the module's call:
    where the module's parameters are on several devices, that split and the fix (move
    the model); else the tensors the failing call used that are not on the module's
    device, or a tensor factory called without ``device=`` there or in a function of the
    user's it runs.
    """
    if isinstance(error, DeviceKitError) or not is_device_mismatch(error):
        return None
    calls = _inside_calls(module, error)
    first_input = next((tensor.device for _, tensor in _inputs_in(module, calls)), None)
    split = split_model(module, type(module).__name__, first_input)
    if split is not None:  # a layer left behind: PyTorch refused it, the model moves
        said, fix, devices = split
        refused = f" in {calls[-1].where}" if calls else f" in {type(module).__name__}'s call"
        return DeviceMismatchError(f"{said} PyTorch refused to mix them{refused}. {fix}", devices)
    if not calls:
        return None
    first = next((tensor for _, tensor in tensors_of(module, own=False)), None)
    params = first is not None
    if first is None:
        first = next((tensor for _, tensor in _inputs_in(module, calls)), None)
        if first is None:
            return None
    home = first.device
    # What a fix makes new tensors next to: the first input on the module's device, by
    # its name in forward, else the first parameter (self.fc.weight).
    near = next((path for path, t in _inputs_in(module, calls) if t.device == home), None)
    if near is None:
        near = next((f"self.{name}" for name, t in tensors_of(module, own=False)), "input")
    source = _failing_source(calls[-1])
    made = _made_elsewhere(calls, source, home)
    label = type(module).__name__
    default = torch.get_default_device()
    if made:
        return _named_made(made, home, _near(label, near, parameters=params), near)
    if source is None or default == home:
        return None
    shown_source = source if len(source) <= _SOURCE_SHOWN else source[: _SOURCE_SHOWN - 3] + "..."
    where = calls[-1].where
    if _FACTORY.search(source) and "device" not in source:
        maker, made_at = "makes a tensor", f"the call in {where}"
    else:  # a closure, a lambda or a helper that the call runs may have made it
        found = _factory_run(calls[-1], source)
        if found is None:
            return None
        name, factory, at = found
        maker, made_at = f"runs {name}, whose {factory} ({at}) makes a tensor", f"{name} ({at})"
    msg = (
        f"The call {shown_source} in {where} {maker} without device=, which puts it on "
        f"{default}, but {_near(label, near, parameters=params)} on {home}. " + _fix("it", near)
    )
    return DeviceMismatchError(msg, {home: [near], default: [made_at]})


def _near(label: str, near: str, *, parameters: bool) -> str:
    """``the input and the parameters of Net are``: what the tensors should be next to."""
    if near.startswith("self."):
        return f"the parameters of {label} are"
    return (
        f"the input and the parameters of {label} are" if parameters else f"the input of {label} is"
    )


def _fix(them: str, near: str) -> str:
    """How to make a tensor next to ``near`` (an input, or a parameter as ``self.fc.weight``)."""
    if near.startswith("self."):
        return (
            f"Make {them} on the parameters' device: torch.zeros(..., device={near}.device) "
            f"or {near}.new_zeros(...)."
        )
    return (
        f"Make {them} on the input's device: torch.zeros(..., device={near}.device), "
        f"{near}.new_zeros(...) or torch.zeros_like({near})."
    )


def _named_made(
    made: list[_Made], home: torch.device, near_said: str, near: str
) -> DeviceMismatchError:
    """The error naming the tensors the failing call used off the module's device."""
    groups: dict[_Call, list[str]] = {}
    for each in made:
        groups.setdefault(each.call, []).append(each.name)
    subject = " and ".join(f"{listing(names)} in {call.where}" for call, names in groups.items())
    devices = list(dict.fromkeys(each.device for each in made))
    one = len(made) == 1
    # Where the default device is the host: a factory called without device= made it.
    host = all(device == torch.get_default_device() == torch.device("cpu") for device in devices)
    made_there = (
        " A tensor made inside forward is put on the host unless told otherwise." if host else ""
    )
    msg = (
        f"{subject} {'is' if one else 'are'} on {' and '.join(map(str, devices))} but "
        f"{near_said} on {home}.{made_there} {_fix('it' if one else 'them', near)}"
    )
    found: dict[torch.device, list[str]] = {home: [near]}
    for each in made:
        found.setdefault(each.device, []).append(each.name)
    return DeviceMismatchError(msg, found)
