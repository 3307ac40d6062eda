"""The parts of PyTorch that devicekit reads although they are private, in one place.

Each has been in PyTorch since 2.5 at least (devicekit needs 2.6); a release that moves
one breaks this module's tests, not a user's checkpoint.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

__all__ = ["one_graph", "raise_past_the_compiler", "run_while_tracing", "weights_only_refusal"]


def weights_only_refusal(pickled: bytes) -> str | None:
    """Why a weights-only load would refuse this pickle of ``torch.save``'s; None if it would not.

    The pickle is read with PyTorch's own scan of what a weights-only load looks up,
    which knows exactly the operations that load knows, and its globals are checked
    against the ones the load allows: PyTorch's, and those added with
    ``torch.serialization.add_safe_globals`` at the time of the call. Nothing is built,
    so the check costs about a fifth of the save of a model's state (a full dry run of
    the load, about twice the save). The refusal is worded as the load words it:
    ``"Unsupported global: GLOBAL module.Name ..."``.
    """
    from torch import _weights_only_unpickler  # noqa: PLC0415 - private: read here

    loader: Any = _weights_only_unpickler  # partly untyped

    try:
        named = loader.get_globals_in_pkl(io.BytesIO(pickled))
    except pickle.UnpicklingError as unknown:  # an operation the load does not know
        return str(unknown)
    allowed = loader._get_allowed_globals().keys() | loader._get_user_allowed_globals().keys()
    refused = sorted(named - allowed)
    if not refused:
        return None
    more = f" (and {', '.join(refused[1:])})" if len(refused) > 1 else ""
    return f"Unsupported global: GLOBAL {refused[0]} was not an allowed global{more}"


F = TypeVar("F", bound=Callable[..., Any])


def run_while_tracing(fn: F) -> F:
    """Mark ``fn`` as torch.compile's ``assume_constant_result`` does, without importing dynamo.

    The compiler then calls ``fn`` in Python while it traces, its result a constant of
    the graph. ``torch.compiler.assume_constant_result`` imports ``torch._dynamo`` (about
    a second) to set this one attribute; marked here, ``import devicekit`` stays light.
    """
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


_passing: dict[type[Exception], type[Exception]] = {}


def _passed_through(kind: type[Exception]) -> type[Exception]:
    """``kind``, made an error torch.compile hands to the user as it is.

    Raised while the compiler traces, an error is wrapped (an "internal error", or an
    "observed exception" under ``fullgraph=True``) unless dynamo counts it as the
    user's: a ``UserError``. This subclass of both keeps ``kind`` for ``except`` clauses
    and its message first; dynamo adds where in the user's code it happened.
    """
    from torch._dynamo import exc  # noqa: PLC0415 - loaded already: a region is tracing

    def init(self: Any, message: str) -> None:
        Exception.__init__(self, message)
        self.error_type, self.message, self.case_name = (
            exc.UserErrorType.INVALID_INPUT,
            message,
            None,
        )

    if kind not in _passing:
        namespace = {"__init__": init, "__module__": kind.__module__}
        _passing[kind] = type(kind.__name__, (kind, exc.UserError), namespace)
    return _passing[kind]


@run_while_tracing
def one_graph() -> bool:
    """Whether the region being traced must be one graph (``fullgraph=True``).

    There a graph break is an error; elsewhere an error raised in traced code breaks the
    graph, and the call runs eagerly, where it succeeds or raises the same error itself.
    """
    from torch._dynamo.symbolic_convert import InstructionTranslator  # noqa: PLC0415

    try:
        tracer = InstructionTranslator.current_tx()
        return bool(tracer.one_graph or getattr(tracer, "error_on_graph_break", False))
    except AttributeError:  # no tracer to ask: say one graph, where the error is clearest
        return True


@run_while_tracing
def raise_past_the_compiler(kind: type[Exception], message: str) -> NoReturn:
    """Raise ``kind(message)`` from a compiled region so that it reaches the user as it is.

    Called in traced code, it runs in Python while the compiler traces (see
    :func:`run_while_tracing`), where an error it raises leaves the compiler unwrapped.
    """
    raise _passed_through(kind)(message)
